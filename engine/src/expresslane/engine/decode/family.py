"""Which GEMV kernel family a request runs, decided from its prompt (the engine's `lean_gemv="per-request"`).

The lean step has two GEMV families (models/lean.py). On one H200 at the 8B shape the CUDA-core family runs the
fastest one-row step (4.04 ms at 1k) but a verify of five rows costs 2.49x a step; the tensor-core family's
one-row step costs 4 % more (4.22 ms) and its five-row verify 1.08x. So on text whose continuation repeats its
context (code edits, agentic loops quoting tool results) the tensor-core family earns about twice what the
CUDA-core one does from speculation (docs/performance.md), and on text that never repeats it is 4 % slower.
Neither family is right for every request; a node that holds both can run each request on the one that suits it.

A request's greedy tokens must not depend on whether it speculates, so the choice cannot wait for the drafter's
first verifies: a request runs one family from its first step to its last, chosen before it starts, from what
its prompt says. The predictor plays the node's own drafter (prompt lookup behind AdaptiveDrafter) over the
prompt's last `window` tokens (at most half the prompt) as if the model were generating them, after up to
`context` tokens before them, and charges each step what that family's forward of that many rows costs here (the
engine's StepCosts, measured at warm-up): the family whose replay takes less time per token wins. The default family (the one a node without
the choice runs) keeps the request unless the other is faster by `margin`. A prompt shorter than
`min_prompt` tokens, or one not given to the node, keeps the default.

The prompt's own repetition predicts what the drafter will earn on the output, but only in part. On the copy
model's recorded requests (docs/bench/2026-12-04-cost-aware-drafter/texts.json) at the H200's 8B costs the
replay of each prompt ranks the families as the replay of its recorded output does (tensor-core for the code
edit, the agentic request and the whole-file edit; cuda-core for random text). On an H100 at 8B
(docs/bench/2026-12-05-per-request-ab/), whose CUDA-core verify is cheaper, the agentic request's last 133
prompt tokens predicted tensor-core only 1.017x faster (kept on cuda-core by the margin), while its output ran
1.375x faster there (581.7 vs 423.1 tok/s): the output quotes the prompt far more than the prompt's tail repeats
itself. The two mistakes cost unequal amounts: repeating text on the CUDA-core family cost 0.73x; text that never
repeats on the tensor-core family costs its one-row premium (0.939x there, 0.96x on the H200). So where the
prompt repeats at all, the request runs on the family whose verify of k + 1 rows costs least (as a share of its
own one-row step). Whether it repeats is read on that same family: its replay runs `repeats` (1.05x) or more
faster than its one-row step. Read on the default family instead (the first form of the rule), it fails where that
family's verify is dear enough that speculation barely pays there: at the 1B shape on an H100 (five CUDA-core rows
2.29x one; docs/bench/2026-12-06-per-request-ab/) the agentic prompt's replay ran only 1.036x faster on cuda-core,
under the bar, and the request ran at 0.65x of the tensor-core engine; on the tensor-core family the same replay
runs 1.17x faster, random text 0.99x. At the three measured cost tables (the H200 and H100 at 8B, the H100 at 1B)
every recorded request then chooses the family its output runs faster on: tests/unit/engine/test_family.py.

Greedy output is fixed by the text, so the lookup drafter's proposal at each position depends on the text alone:
it is computed once (`proposals`) and each family's replay only decides how many of those drafts it verifies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .speculative import AdaptiveDrafter, PromptLookupDrafter, SpeculationConfig, StepCosts, kept_drafts

#: GEMV families in the order a tie keeps (the first: the default, what a node without the choice runs).
FAMILIES = ("cuda-core", "tensor-core")


@dataclass(frozen=True)
class FamilyPolicy:
    """window: prompt tokens replayed (the last ones, at most half the prompt: on the recorded 267-token agentic
    request the whole-window replay, with 11 tokens of history, predicted tensor-core 1.05x faster, half of it
    1.09x; the code edit 1.11x -> 1.21x); context: tokens before them the drafter indexes (the replay's cost
    grows with it: about 3.5 ms for 2,048 + 256 tokens on a slow 2-CPU host); margin: what the other family must
    gain over the default; min_prompt: shorter prompts keep the default; repeats: the cheapest-verify family's
    replay this much faster than its one-row step marks a prompt that repeats (see the module's docstring)."""

    window: int = 256
    context: int = 2048
    margin: float = 0.02
    min_prompt: int = 64
    repeats: float = 1.05

    def __post_init__(self) -> None:
        if self.window < 2 or self.context < 0 or self.min_prompt < 0:
            raise ValueError(f"need window >= 2, context >= 0, min_prompt >= 0: {self}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if not self.repeats > 1.0:
            raise ValueError(f"repeats must be > 1 (inf: never), got {self.repeats}")


@dataclass(frozen=True)
class FamilyChoice:
    """The family a request runs and why: each family's predicted seconds per token (empty where nothing was
    replayed) and the reason in words (for the node's log and the bench)."""

    family: str
    seconds_per_token: Mapping[str, float]
    reason: str

    def as_dict(self) -> dict:
        return {"family": self.family, "reason": self.reason,
                "seconds_per_token": {f: round(s, 9) for f, s in self.seconds_per_token.items()}}


class _Recorded:
    """A drafter that proposes what prompt lookup proposed at each position of a fixed text (`proposals[i]`: the
    proposal after text[:i + 1]); AdaptiveDrafter wraps it as it wraps PromptLookupDrafter."""

    def __init__(self, proposals: list[list[int]]) -> None:
        self.proposals, self.i = proposals, 0

    def start(self, context: Sequence[int]) -> None:
        self.i = 0

    def propose(self, k: int) -> list[int]:
        return self.proposals[self.i][:k] if self.i < len(self.proposals) else []

    def extend(self, tokens: Sequence[int]) -> None:
        self.i += len(tokens)


def proposals(context: Sequence[int], text: Sequence[int], k: int, ngram_min: int = 2,
              ngram_max: int = 4) -> list[list[int]]:
    """Prompt lookup's proposal of up to k tokens after context + text[:i + 1], for each i < len(text) - 1."""
    lookup = PromptLookupDrafter(ngram_min, ngram_max)
    lookup.start([*context, text[0]])
    out = []
    for tok in text[1:]:
        out.append(lookup.propose(k))
        lookup.extend([tok])
    return out


def replay_seconds(text: Sequence[int], props: list[list[int]], costs: StepCosts, k: int, start: int) -> float:
    """Seconds the engine's loop takes to emit text[1:] after text[0] (costed at positions `start` ..) with the
    adaptive drafter over `props` (proposals()) at `costs`: every step charged its forward of 1 + drafts rows;
    a draft is kept exactly where it matches the text (greedy output is fixed)."""
    drafter = AdaptiveDrafter(_Recorded(props), costs, start_length=start)
    drafter.start(())
    i, pos, spent = 1, start, 0.0
    while i < len(text):
        room = len(text) - i - 1
        drafts = drafter.propose(min(k, room)) if room > 0 else []
        kept = kept_drafts(drafts, text, i)
        spent += costs.at(pos, len(drafts) + 1)[len(drafts)]
        emitted = text[i:i + kept + 1]
        drafter.extend(emitted)
        i += len(emitted)
        pos += len(emitted)
    return spent


def choose_family(prompt: Sequence[int] | None, costs: Mapping[str, StepCosts], speculation: SpeculationConfig,
                  policy: FamilyPolicy = FamilyPolicy()) -> FamilyChoice:
    """The family (a key of `costs`, FAMILIES' order: the first present is the default) a request with this
    prompt runs; see the module's docstring."""
    families = [f for f in FAMILIES if f in costs] + [f for f in costs if f not in FAMILIES]
    if not families:
        raise ValueError("choose_family needs the step costs of at least one family")
    default = families[0]
    if len(families) == 1:
        return FamilyChoice(default, {}, "one family")
    if not prompt:
        return FamilyChoice(default, {}, "no prompt ids")
    if len(prompt) < max(policy.min_prompt, 2):
        return FamilyChoice(default, {}, f"prompt of {len(prompt)} tokens < {policy.min_prompt}")
    n = len(prompt)
    text = prompt[n - max(2, min(policy.window, n // 2)):]  # at most half: the rest is what it repeats
    begin = n - len(text)
    context = prompt[max(0, begin - policy.context):begin]
    props = proposals(context, text, speculation.k, speculation.ngram_min, speculation.ngram_max)
    per_token = {f: replay_seconds(text, props, costs[f], speculation.k, n) / (len(text) - 1)
                 for f in families}
    # Whether the prompt repeats, read where speculation pays the most for it: the family whose verify of k + 1
    # rows costs least, as a share of its own one-row step
    verify = {f: costs[f].at(n, speculation.k + 1)[speculation.k] / costs[f].at(n, 1)[0] for f in families}
    cheapest = min(families, key=verify.get)
    gain = costs[cheapest].at(n, 1)[0] / per_token[cheapest]  # its replay's speedup over its own one-row step
    if gain >= policy.repeats:
        return FamilyChoice(cheapest, per_token, f"{cheapest}: the prompt repeats (its last {len(text)} tokens "
                                                 f"{gain:.3f}x faster speculating there), the cheapest "
                                                 f"verify of {speculation.k + 1} rows")
    best = min(families, key=per_token.get)
    if best != default and per_token[best] < per_token[default] * (1 - policy.margin):
        return FamilyChoice(best, per_token, f"{best} {per_token[default] / per_token[best]:.3f}x faster "
                                             f"on the prompt's last {len(text)} tokens")
    return FamilyChoice(default, per_token, f"{default}: no family faster by {policy.margin:.0%} "
                                            f"on the prompt's last {len(text)} tokens")
