"""Speculative decoding: who proposes drafts, and the counters of how many the target accepted.

A `Drafter` proposes up to k next tokens after the text so far; the engine verifies them in one forward of
k + 1 rows (decode/runner.py) and keeps the longest prefix the target agrees with plus one token of its own
(greedy: exact match with the target's argmax; sampling: standard rejection sampling, sampling.py), so the
output is the target's, with speculation on or off. The static cache makes rollback a position reset: rows
written for rejected drafts lie past the new length, are never read (attention reads rows < length only)
and are overwritten by the next step.

Drafters:
* `PromptLookupDrafter` (the default): n-gram lookup over the prompt and the generated text. Agentic and
  code-edit traffic repeats its context, so the continuation of the latest earlier occurrence of the last n
  tokens is a good guess, at no model cost.
* `DraftModelDrafter`: a smaller model of the same vocabulary, run greedily by its own DecodeEngine.
* An MTP / EAGLE head implements the same protocol (it would take the target's hidden states through
  `observe_hidden`, which the engine does not produce yet: no supported checkpoint ships such a head).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from .engine import DecodeEngine


class Drafter(Protocol):
    def start(self, context: Sequence[int]) -> None:
        """A new request: `context` is every token known so far (prompt ids if given, then the first token)."""

    def propose(self, k: int) -> list[int]:
        """Up to k tokens to follow the context (fewer or none when there is no good guess)."""

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens the target emitted (accepted drafts and its own token), appended to the context."""


@dataclass(frozen=True)
class SpeculationConfig:
    """Engine-wide speculation. k: most drafts per step (a step verifies up to k + 1 rows);
    ngram_min/max: n-gram lengths prompt lookup matches, longest first."""

    k: int = 4
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.k <= 16:
            raise ValueError(f"speculation k must be in [1, 16], got {self.k}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")


@dataclass
class SpecStats:
    """Counters (per request on Generation.spec, cumulative on DecodeEngine.spec_stats).
    verify_steps: forwards that checked >= 1 draft; drafted / accepted: draft tokens proposed / kept;
    plain_steps: forwards without drafts. Mean acceptance = accepted / verify_steps; tokens per forward =
    (accepted + verify_steps + plain_steps) / (verify_steps + plain_steps)."""

    verify_steps: int = 0
    plain_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_histogram: list[int] = field(default_factory=list)  # [n] = verify steps that kept n drafts

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            self.plain_steps += 1
            return
        self.verify_steps += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        while len(self.accepted_histogram) <= accepted:
            self.accepted_histogram.append(0)
        self.accepted_histogram[accepted] += 1

    def add(self, other: "SpecStats") -> None:
        self.verify_steps += other.verify_steps
        self.plain_steps += other.plain_steps
        self.drafted_tokens += other.drafted_tokens
        self.accepted_tokens += other.accepted_tokens
        for n, c in enumerate(other.accepted_histogram):
            while len(self.accepted_histogram) <= n:
                self.accepted_histogram.append(0)
            self.accepted_histogram[n] += c

    @property
    def mean_acceptance(self) -> float:
        return self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def tokens_per_forward(self) -> float:
        forwards = self.verify_steps + self.plain_steps
        return (self.accepted_tokens + forwards) / forwards if forwards else 0.0

    def as_dict(self) -> dict:
        return {"verify_steps": self.verify_steps, "plain_steps": self.plain_steps,
                "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
                "mean_acceptance": round(self.mean_acceptance, 4),
                "tokens_per_forward": round(self.tokens_per_forward, 4),
                "accepted_histogram": list(self.accepted_histogram)}


class PromptLookupDrafter:
    """n-gram lookup over the context, O(ngram_max) per token: an index maps each n-gram to the position
    right after its latest occurrence whose follower is known; a proposal continues from there."""

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}

    def start(self, context: Sequence[int]) -> None:
        self.tokens = []
        self._index = {}
        self.extend(context)

    def extend(self, tokens: Sequence[int]) -> None:
        toks, index = self.tokens, self._index
        for tok in tokens:
            j = len(toks)  # the new token's index: it follows the n-grams ending at j - 1
            for n in range(self.ngram_min, self.ngram_max + 1):
                if j >= n:
                    index[tuple(toks[j - n:j])] = j
            toks.append(int(tok))

    def propose(self, k: int) -> list[int]:
        toks = self.tokens
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(toks) < n:
                continue
            follower = self._index.get(tuple(toks[-n:]))
            if follower is not None:
                return toks[follower:follower + k]
        return []


class DraftModelDrafter:
    """Drafts by greedy decoding with a smaller model (same tokenizer) in its own DecodeEngine. Its cache
    holds every context token but the last; after a partial acceptance it resumes from the last row that is
    still right (the static cache's rollback: a position reset)."""

    def __init__(self, engine: "DecodeEngine") -> None:
        self.engine = engine
        self.tokens: list[int] = []
        self.cached = 0  # draft-cache rows [0, cached) hold the KV of tokens[:cached]
        self._drafts: list[int] = []

    def start(self, context: Sequence[int]) -> None:
        self.tokens = [int(t) for t in context]
        self.cached = 0
        self._drafts: list[int] = []

    def extend(self, tokens: Sequence[int]) -> None:
        # After a proposal from a context of C tokens, rows [0, C) are right and rows C .. C+k-2 hold the KV
        # of drafts d1 .. d_{k-1}: right as far as the emitted tokens match the drafts.
        matched = 0
        while (matched < len(self._drafts) - 1 and matched < len(tokens)
               and tokens[matched] == self._drafts[matched]):
            matched += 1
        if self._drafts:
            self.cached = len(self.tokens) + matched
        self.tokens += [int(t) for t in tokens]
        self._drafts = []

    @torch.inference_mode()
    def propose(self, k: int) -> list[int]:
        e = self.engine
        k = min(k, e.max_seq_len - len(self.tokens) - 1)
        if k <= 0:
            return []
        runner = e.runner
        # Catch up: the context tokens the draft cache does not hold yet, except the last, in chunks.
        pending = self.tokens[self.cached:-1]
        if self.cached == 0 and pending:
            e.prefill(pending)
            self.cached = len(pending)
            pending = []
        for i in range(0, len(pending), runner.max_rows):
            chunk = pending[i:i + runner.max_rows]
            runner.forward(torch.tensor(chunk, dtype=torch.long, device=e.device), self.cached)
            self.cached += len(chunk)
        drafts: list[int] = []
        tok = self.tokens[-1]
        pos = len(self.tokens) - 1
        for _ in range(k):
            logits = runner.forward(torch.tensor([tok], dtype=torch.long, device=e.device), pos)
            tok = int(logits[-1].argmax())
            drafts.append(tok)
            pos += 1
        self.cached = len(self.tokens)  # rows [0, C) now; extend() adds the kept drafts' rows
        self._drafts = drafts
        return drafts
