"""Speculative decoding: who proposes drafts, and the counters of how many the target accepted.

A `Drafter` proposes up to k next tokens after the text so far; the engine verifies them in one forward of
k + 1 rows (decode/runner.py) and keeps the longest prefix the target agrees with plus one token of its own
(greedy: exact match with the target's argmax; sampling: standard rejection sampling, sampling.py), so the
output is the target's, with speculation on or off. The static cache makes rollback a position reset: rows
written for rejected drafts lie past the new length, are never read (attention reads rows < length only)
and are overwritten by the next step.

Drafters:
* `AdaptiveDrafter` wraps the default drafter: each step it verifies the number of drafts that earns the most
  tokens per unit of device time, from the acceptance this request's drafts have had and what a verify of
  that many rows costs on this engine (`StepCosts`, measured at warm-up); where no number pays it takes plain
  steps, probing one draft now and then at a cost bounded to 1 % of plain decoding.
* `PromptLookupDrafter` (the default, wrapped): n-gram lookup over the prompt and the generated text. Agentic and
  code-edit traffic repeats its context, so the continuation of the latest earlier occurrence of the last n
  tokens is a good guess, at no model cost.
* `DraftModelDrafter`: a smaller model of the same vocabulary, run greedily by its own DecodeEngine.
* A drafter may also say where it cannot draft at the next step (`may_draft_next`, optional): there the engine's
  greedy chain queues the plain step ahead of the host (decode/chain.py). Prompt lookup answers it from its
  index (its 3- and 4-gram keys), the adaptive wrapper from whether drafting pays and when its next probe is due.
* An MTP / EAGLE head implements the same protocol (it would take the target's hidden states through
  `observe_hidden`, which the engine does not produce yet: no supported checkpoint ships such a head).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch



class Drafter(Protocol):
    def start(self, context: Sequence[int]) -> None:
        """A new request: `context` is every token known so far (prompt ids if given, then the first token)."""

    def propose(self, k: int) -> list[int]:
        """Up to k tokens to follow the context (fewer or none when there is no good guess)."""

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens the target emitted (accepted drafts and its own token), appended to the context."""

    # Optional (a drafter without it is taken to draft at any step):
    #   may_draft_next() -> bool: False where the next `propose` is predicted to return no drafts whatever one
    #   token the target emits next (prompt lookup: exact for its 3- and 4-grams, see there). Read-only. The
    #   engine then queues that plain step on the device before it reads the current one's token
    #   (decode/chain.py); a hint, not a promise: where it is wrong the output stays the same and a verify whose
    #   first draft is kept costs one more forward.


@dataclass(frozen=True)
class SpeculationConfig:
    """Engine-wide speculation. k: most drafts per step (a step verifies up to k + 1 rows);
    ngram_min/max: n-gram lengths prompt lookup matches, longest first; adaptive: wrap the drafter in
    `AdaptiveDrafter` (as many drafts a step as pay for their verify; none where none pays)."""

    k: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    adaptive: bool = True

    def drafter(self, costs: "StepCosts | None" = None, start_length: int = 0) -> "Drafter":
        """A fresh default drafter for one request: costs, the engine's measured step costs (None: assumed);
        start_length, the position the request's next token goes to (its prompt length)."""
        lookup = PromptLookupDrafter(self.ngram_min, self.ngram_max)
        return AdaptiveDrafter(lookup, costs, start_length=start_length) if self.adaptive else lookup

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


@dataclass(frozen=True)
class StepCosts:
    """What one forward of R = 1, 2, .. rows costs (any unit; seconds where measured), at two context lengths:
    `short[r - 1]` at `lengths[0]`, `long[r - 1]` at `lengths[1]`, linear in the length in between and beyond
    (attention grows with it; at the 8B shape on an H200 a verify of 5 rows costs 1.08x a plain step at 1k and
    1.41x at 32k with the tensor-core GEMVs). `DecodeEngine.calibrate_step_costs` measures them at warm-up;
    `assumed()` stands in before that. A row count past the table costs what its last two rows add per row."""

    lengths: tuple[int, int]
    short: tuple[float, ...]
    long: tuple[float, ...]
    measured: bool = True

    def __post_init__(self) -> None:
        if not self.short or len(self.short) != len(self.long):
            raise ValueError("StepCosts needs the same non-empty row counts at both lengths")
        if not self.lengths[0] < self.lengths[1]:
            raise ValueError(f"StepCosts lengths must increase, got {self.lengths}")
        if min(self.short + self.long) <= 0:
            raise ValueError("step costs must be > 0")

    @classmethod
    def assumed(cls) -> "StepCosts":
        """Before a measurement: each row past the first costs a quarter of a one-row step (between the GPU's
        tensor-core GEMVs, about 0.02 at 1k, and its CUDA-core ones and a compiled CPU step, 0.3 - 0.5)."""
        rows = tuple(1.0 + 0.25 * r for r in range(8))
        return cls((0, 1), rows, rows, measured=False)

    def at(self, length: int, rows: int) -> list[float]:
        """Costs of 1 .. rows rows at `length` (clamped at 0 below)."""
        (l0, l1), n = self.lengths, len(self.short)
        f = (max(0, length) - l0) / (l1 - l0)
        out = [max(1e-12, s + (l - s) * f) for s, l in zip(self.short, self.long)]
        step = out[-1] - out[-2] if n > 1 else 0.0
        out += [out[-1] + step * (i + 1) for i in range(rows - n)]
        return out[:rows]

    def as_dict(self) -> dict:
        return {"lengths": list(self.lengths), "short": list(self.short), "long": list(self.long),
                "measured": self.measured}


def kept_drafts(drafts: Sequence[int], text: Sequence[int], at: int) -> int:
    """How many of `drafts` a greedy verify keeps where the target's output is `text` and the drafts guess
    text[at:]: the longest prefix that matches (a replay of recorded text: bench.simulate_speedup,
    family.replay_seconds)."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == text[at + kept]:
        kept += 1
    return kept


class PromptLookupDrafter:
    """n-gram lookup over the context, O(ngram_max) per token: an index maps each n-gram to the position
    right after its latest occurrence whose follower is known; a proposal continues from there."""

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4, hint_ngram_min: int = 3) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        # The hint (may_draft_next) looks at keys of hint_ngram_min tokens and longer only (the longest at least);
        # see there.
        self.hint_ngram_min = min(max(ngram_min, hint_ngram_min), ngram_max)
        self.tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        self._heads: set[tuple[int, ...]] = set()  # every key of _index but its last token

    def start(self, context: Sequence[int]) -> None:
        """The index of `context` built at once: what extend(context) builds token by token (each n-gram's latest
        occurrence whose follower is known, and the keys' heads), from zips of the token list, so the loops run
        in C: a random 32k-token prompt took 53 -> 26 ms (50 ids) and 58 -> 39 ms (128k ids) on a loaded 2-CPU host
        (best of 5), time the node spends before its second token (tests/unit/engine/test_speculative.py checks
        the two agree)."""
        toks = [int(t) for t in context]
        keyed, headed = toks[:len(toks) - 1], toks[:max(0, len(toks) - 2)]
        index: dict[tuple[int, ...], int] = {}
        heads: set[tuple[int, ...]] = set()
        for n in range(self.ngram_min, self.ngram_max + 1):
            # n-grams ending at 0 .. len - 2 (their follower known) -> the follower's index; later ones win
            index.update(zip(zip(*(keyed[i:] for i in range(n))), range(n, len(toks))))
            heads.update(zip(*(headed[i:] for i in range(n - 1))))  # each such key but its last token
            if n == 1 and len(toks) >= 2:
                heads.add(())  # a 1-gram's head (zip of nothing yields nothing)
        self.tokens, self._index, self._heads = toks, index, heads

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
        last n - 1 tokens head a key already, or head the key extend([t]) adds (the last n tokens).

        A prediction, not a promise: only n >= hint_ngram_min (3) is asked. With 2-grams the head is the last
        token alone, which on text that does not repeat heads a key wherever that token was seen before (22.7 %
        of steps at a random 32k context, 0.8 % at 1k) while the next token almost never completes the key: a
        "may" there costs the greedy chain its queued step (a sync, 144-302 us on the H100). A 2-gram proposal
        after a "no" is still drafted and verified (a split verify, exact). Replayed on the recorded code-edit,
        agentic and whole-file-edit texts, n >= 3 keeps every right "may" (8 / 24 / 46) and drops every wrong
        one (29 / 31 / 59), adding no split verify (docs/bench/2026-12-05-h100-gpu-check/hint_eval.py).
        hint_ngram_min = ngram_min makes it exact: False only where the next proposal is empty."""
        toks = self.tokens
        for n in range(self.hint_ngram_min, self.ngram_max + 1):
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


class DraftEngine(Protocol):
    """What DraftModelDrafter uses of the small model's engine (a DecodeEngine is one): its step runner, its
    cache length and a prefill from position 0."""

    max_seq_len: int

    @property
    def runner(self): ...

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor: ...


class DraftModelDrafter:
    """Drafts by greedy decoding with a smaller model (same tokenizer) in its own DecodeEngine. Its cache
    holds every context token but the last; after a partial acceptance it resumes from the last row that is
    still right (the static cache's rollback: a position reset)."""

    def __init__(self, engine: DraftEngine) -> None:
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
            runner.forward(chunk, self.cached)
            self.cached += len(chunk)
        drafts: list[int] = []
        tok = self.tokens[-1]
        pos = len(self.tokens) - 1
        for _ in range(k):
            logits = runner.forward([tok], pos)
            tok = int(logits[-1].argmax())
            drafts.append(tok)
            pos += 1
        self.cached = len(self.tokens)  # rows [0, C) now; extend() adds the kept drafts' rows
        self._drafts = drafts
        return drafts


class AdaptiveDrafter:
    """How many of the inner drafter's drafts a step verifies: the number that earns the most tokens per unit of
    device time, from what this request's drafts have earned and what a verify costs on this engine.

    Acceptance: each draft is taken to be kept with probability `alpha` once the draft before it was; alpha is
    kept / (kept + first misses) over this request's verify steps, each verify weighing the older counts by
    `decay`, starting from the pseudo-counts `prior` (kept, missed), which decay with them (so a run of misses
    takes alpha towards 0, not towards the prior). Cost: `StepCosts` at the request's current length (the
    engine measures them at warm-up: a verify of d drafts is a forward of d + 1 rows). A step offered n drafts
    verifies the d <= n that maximises (1 + alpha + ... + alpha^d) / cost(d + 1); d = 0 is a plain step, taken
    wherever no d beats it by `margin` (4 %): alpha is estimated from a few verifies and the costs are timed to a
    few % (one warm-up to the next), so a verify predicted to gain less than that is as likely to lose. Predicted
    on the recorded text below at the H200's costs: the 1B's whole-file edit 1.006x -> 1.022x, no other request
    moved by more than 1.3 %; measured on the device, within the run-to-run spread
    (docs/bench/2026-12-05-drafter-margin/, docs/bench/2026-12-05-gpu-check-green/).

    Probes: where drafting does not pay, no verify would ever update alpha again. So once `pause` plain steps
    have run since the last verify, a step offered drafts verifies one (a probe). A probe that keeps nothing
    and leaves drafting still not worth it doubles the pause, up to the pause at which probes cost `explore`
    (1 %) of plain decoding: (cost(2) - cost(1)) / max_pause <= explore * cost(1); a kept draft resets it.
    Worst case (drafts offered at every step and always wrong): the first few verifies (until alpha falls
    below what a verify costs) plus `explore`. Measured against the previous rule (k doubling / halving with
    fixed pauses) on the copy model's recorded text at the H200's measured costs:
    docs/bench/2026-12-04-cost-aware-drafter/. The output is the target's either way.

    It reads each outcome from the protocol alone: after a verify of d drafts the engine extends with the
    kept drafts plus one token of the target's, so kept = len(tokens) - 1."""

    def __init__(self, inner: Drafter, costs: "StepCosts | None" = None, *, start_length: int = 0,
                 decay: float = 0.8, prior: tuple[float, float] = (2.0, 1.0), pause: int = 4,
                 explore: float = 0.01, margin: float = 0.04) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if prior[0] < 0 or prior[1] < 0 or sum(prior) <= 0:
            raise ValueError(f"prior (kept, missed) must be >= 0 and not both 0, got {prior}")
        if pause < 1 or not 0.0 < explore < 1.0:
            raise ValueError(f"need pause >= 1 and 0 < explore < 1, got {pause}, {explore}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        self.inner = inner
        self.costs = costs if costs is not None else StepCosts.assumed()
        self.decay, self.prior, self.base_pause, self.explore = decay, prior, pause, explore
        self.margin = margin
        self.start_length = start_length  # positions before the context's last token (see start)
        # Rows other requests put in the same forward (a node serving several users, decode/batch.py): a draft
        # must pay for what it adds to that step, cost(rows_before + 1 + d) against cost(rows_before + 1).
        self.rows_before = 0
        self._reset()

    def _reset(self) -> None:
        self.kept, self.missed = self.prior  # decayed counts: kept drafts, verifies that missed one
        self.pause = self.base_pause
        self.since_verify = 0  # plain steps since the last verify
        self.length = self.start_length
        self.k_max = 0  # the most drafts the engine asked for
        self._drafted = 0

    def start(self, context: Sequence[int]) -> None:
        self._reset()
        self.inner.start(context)

    @property
    def alpha(self) -> float:
        return self.kept / (self.kept + self.missed) if self.kept + self.missed > 0 else 0.0

    def drafts_worth(self, offered: int) -> int:
        """The number of drafts (0 .. offered) that earns the most tokens per unit of cost now; a verify must beat
        a plain step by `margin`."""
        a = self.alpha
        cost = self.costs.at(self.length, self.rows_before + offered + 1)[self.rows_before:]
        best, best_d, expected, term = (1.0 + self.margin) / cost[0], 0, 1.0, 1.0
        for d in range(1, offered + 1):
            term *= a
            expected += term
            if expected / cost[d] > best:
                best, best_d = expected / cost[d], d
        return best_d

    def _max_pause(self) -> int:
        c = self.costs.at(self.length, self.rows_before + 2)[self.rows_before:]
        return max(self.base_pause, math.ceil((c[1] - c[0]) / (self.explore * c[0])))

    def may_draft_next(self) -> bool:
        """False where the next proposal is surely empty: drafting does not pay and no probe is due then; else as
        the inner drafter says. Asked after a step without drafts (decode/chain.py), before its extend: the next
        proposal comes one plain step later."""
        upcoming = self.since_verify + (0 if self._drafted else 1)
        if upcoming < self.pause and self.drafts_worth(max(1, self.k_max)) == 0:
            return False
        may = getattr(self.inner, "may_draft_next", None)
        return may is None or may()

    def set_batch_rows(self, rows_before: int) -> None:
        """The rows other requests put in the next forward (0 alone): what a verify is weighed against."""
        self.rows_before = max(0, rows_before)

    def propose(self, k: int) -> list[int]:
        self._drafted = 0
        self.k_max = max(self.k_max, k)
        drafts = self.inner.propose(k)
        if not drafts:
            return []
        d = self.drafts_worth(len(drafts))
        if d == 0 and self.since_verify >= self.pause:
            d = 1  # a probe
        self._drafted = d
        return drafts[:d]

    def extend(self, tokens: Sequence[int]) -> None:
        d = self._drafted
        if d:
            kept = len(tokens) - 1
            self.kept = self.kept * self.decay + kept
            self.missed = self.missed * self.decay + (1 if kept < d else 0)
            self.since_verify = 0
            if kept:
                self.pause = self.base_pause
            elif self.drafts_worth(1) == 0:
                self.pause = min(self._max_pause(), 2 * self.pause)
        else:
            self.since_verify += 1
        self._drafted = 0
        self.length += len(tokens)
        self.inner.extend(tokens)
