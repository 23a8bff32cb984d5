"""Speculative decoding: who proposes drafts, and the counters of how many the target accepted.

A `Drafter` proposes up to k next tokens after the text so far; the engine verifies them in one forward of
k + 1 rows (decode/runner.py) and keeps the longest prefix the target agrees with plus one token of its own
(greedy: exact match with the target's argmax; sampling: standard rejection sampling, sampling.py), so the
output is the target's, with speculation on or off. The static cache makes rollback a position reset: rows
written for rejected drafts lie past the new length, are never read (attention reads rows < length only)
and are overwritten by the next step.

Drafters:
* `AdaptiveDrafter` wraps the default drafter: it lowers k after rejections and stops drafting for a while
  (probing again later, with growing pauses) where drafts keep missing, so speculation costs little where it
  does not pay and full k where it does.
* `PromptLookupDrafter` (the default, wrapped): n-gram lookup over the prompt and the generated text. Agentic and
  code-edit traffic repeats its context, so the continuation of the latest earlier occurrence of the last n
  tokens is a good guess, at no model cost.
* `DraftModelDrafter`: a smaller model of the same vocabulary, run greedily by its own DecodeEngine.
* A drafter may also say where it cannot draft at the next step (`may_draft_next`, optional): there the engine's
  greedy chain queues the plain step ahead of the host (decode/chain.py). Prompt lookup answers it from its
  index, the adaptive wrapper from its pauses.
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

    # Optional (a drafter without it is taken to draft at any step):
    #   may_draft_next() -> bool: False where the next `propose` returns no drafts whatever one token the target
    #   emits next. Read-only. The engine then queues that plain step on the device before it reads the
    #   current one's token (decode/chain.py); a hint, not a promise: where it is wrong the output stays the
    #   same and a verify whose first draft is kept costs one more forward.


@dataclass(frozen=True)
class SpeculationConfig:
    """Engine-wide speculation. k: most drafts per step (a step verifies up to k + 1 rows);
    ngram_min/max: n-gram lengths prompt lookup matches, longest first; adaptive: wrap the drafter in
    `AdaptiveDrafter` (k follows acceptance, pauses where drafts miss)."""

    k: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    adaptive: bool = True

    def drafter(self) -> "Drafter":
        """A fresh default drafter for one request."""
        lookup = PromptLookupDrafter(self.ngram_min, self.ngram_max)
        return AdaptiveDrafter(lookup) if self.adaptive else lookup

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
        self._heads: set[tuple[int, ...]] = set()  # every key of _index but its last token

    def start(self, context: Sequence[int]) -> None:
        self.tokens = []
        self._index = {}
        self._heads = set()
        self.extend(context)

    def extend(self, tokens: Sequence[int]) -> None:
        toks, index, heads = self.tokens, self._index, self._heads
        for tok in tokens:
            j = len(toks)  # the new token's index: it follows the n-grams ending at j - 1
            for n in range(self.ngram_min, self.ngram_max + 1):
                if j >= n:
                    index[tuple(toks[j - n:j])] = j
                    heads.add(tuple(toks[j - n:j - 1]))
            toks.append(int(tok))

    def may_draft_next(self) -> bool:
        """After one more token t, `propose` looks up (the last n - 1 tokens, t) for each n: a key only if the
        last n - 1 tokens head a key already, or head the key extend([t]) adds (the last n tokens)."""
        toks = self.tokens
        for n in range(self.ngram_min, self.ngram_max + 1):
            if len(toks) < n - 1:
                continue
            head = tuple(toks[len(toks) - n + 1:])
            if head in self._heads or (len(toks) >= n and tuple(toks[-n:-1]) == head):
                return True
        return False

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

    def may_draft_next(self) -> bool:
        return True  # it drafts at every step

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


class AdaptiveDrafter:
    """Adaptive k around another drafter: how many drafts a step verifies follows how many the last verify
    step kept. All kept: k doubles (up to the engine's k). Some kept (a of d): k = a + 1. None kept: k halves;
    a miss at k = 1 pauses drafting for `pause` steps (plain forwards, no verify cost), and each further miss
    at k = 1 doubles the pause up to `max_pause`; any kept draft ends the pauses. Worst case (drafts proposed
    and always wrong): one 2-row verify every max_pause + 1 steps. The output is the target's either way.

    It reads the outcome from the protocol alone: after a verify step of d drafts the engine extends with
    the kept drafts plus one token of the target's, so kept = len(tokens) - 1."""

    def __init__(self, inner: Drafter, *, pause: int = 4, max_pause: int = 64) -> None:
        if not 1 <= pause <= max_pause:
            raise ValueError(f"need 1 <= pause <= max_pause, got {pause}, {max_pause}")
        self.inner = inner
        self.base_pause, self.max_pause = pause, max_pause
        self.k: int | None = None  # current cap; None = the engine's k (first proposal)
        self.pause = pause
        self.skip = 0  # plain steps left before the next probe
        self.k_max = 0  # the largest k the engine asked for
        self._drafted = 0

    def start(self, context: Sequence[int]) -> None:
        self.k, self.pause, self.skip, self._drafted = None, self.base_pause, 0, 0
        self.inner.start(context)

    def may_draft_next(self) -> bool:
        """Not while pausing (the next proposal only counts the pause down); else as the inner drafter says."""
        if self.skip > 0:
            return False
        may = getattr(self.inner, "may_draft_next", None)
        return may is None or may()

    def propose(self, k: int) -> list[int]:
        self._drafted = 0
        if self.skip > 0:
            self.skip -= 1
            return []
        self.k_max = max(self.k_max, k)
        drafts = self.inner.propose(min(k, self.k) if self.k is not None else k)
        self._drafted = len(drafts)
        return drafts

    def extend(self, tokens: Sequence[int]) -> None:
        d = self._drafted
        if d:
            kept = len(tokens) - 1
            cur = self.k if self.k is not None else self.k_max
            if kept >= d:
                self.k = min(self.k_max, 2 * cur)
                self.pause = self.base_pause
            elif kept > 0:
                self.k = kept + 1
                self.pause = self.base_pause
            elif cur > 1:
                self.k = cur // 2
            else:  # a miss at k = 1: stop drafting for a while, longer each time
                self.skip = self.pause
                self.pause = min(self.max_pause, 2 * self.pause)
        self._drafted = 0
        self.inner.extend(tokens)
