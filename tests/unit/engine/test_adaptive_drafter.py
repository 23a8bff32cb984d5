"""The adaptive drafter verifies as many drafts as pay for their verify, and never makes decoding much slower
than plain decoding: its choice weighs the request's acceptance against measured step costs (StepCosts), its
probes where drafting does not pay are bounded to `explore` of plain decode time, and on the copy model's
recorded text (docs/bench/2026-12-04-cost-aware-drafter/texts.json) at the H200's measured costs it stays at
>= 0.97x plain on every request. Pure logic: no model runs here (bench.simulate_speedup plays the engine's loop
over a fixed greedy output)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expresslane.engine.decode import AdaptiveDrafter, PromptLookupDrafter, SpeculationConfig, StepCosts
from expresslane.engine.decode.bench import simulate_speedup

REPO = Path(__file__).resolve().parents[3]
TEXTS = REPO / "docs/bench/2026-12-04-cost-aware-drafter/texts.json"


def _table(short_ms: float, short: list[float], long_ms: float, long: list[float]) -> StepCosts:
    return StepCosts((1024, 32768), tuple(short_ms * r for r in short), tuple(long_ms * r for r in long))


# Forward ms of 1 .. 5 rows on one H200, bf16 (docs/bench/2026-12-04-gpu-check/: the 8B's CUDA-core family at
# 8k is used for both lengths, the only context its verify rows were timed at; the 1B's at 1k and 32k).
GPU = {
    "8b-cuda-core": _table(4.053, [1, 1.322, 1.78, 2.099, 2.481], 5.054, [1, 1.322, 1.78, 2.099, 2.481]),
    "8b-tensor-core": _table(4.222, [1, 1.013, 1.039, 1.055, 1.077], 5.220, [1, 1.082, 1.151, 1.28, 1.412]),
    "1b-cuda-core": _table(0.830, [1, 1.39, 1.967, 2.35, 3.07], 1.149, [1, 1.348, 1.871, 2.345, 2.984]),
    "flat": _table(1.0, [1, 1.01, 1.02, 1.03, 1.04], 1.0, [1, 1.01, 1.02, 1.03, 1.04]),
}


class Scripted:
    """Proposes k tokens at every step; the test plays the engine and decides how many of them are kept."""

    def start(self, context):
        pass

    def propose(self, k):
        return [0] * k

    def extend(self, tokens):
        pass


def play(d: AdaptiveDrafter, right, steps: int, costs: StepCosts, k: int = 4) -> tuple[float, list[int]]:
    """Runs `steps` engine steps; returns (time with drafts / time of plain steps, drafts verified per step)."""
    d.start([1, 2])
    spec = plain = 0.0
    verified = []
    for s in range(steps):
        drafts = d.propose(k)
        kept = len(drafts) if right(s) else 0
        c = costs.at(1024, k + 1)
        spec += c[len(drafts)]
        plain += c[0] * (kept + 1)
        verified.append(len(drafts))
        d.extend([7] * (kept + 1))
    return spec / plain, verified


def test_step_costs_interpolate_in_the_length_and_extend_past_the_rows():
    c = StepCosts((100, 1100), (1.0, 2.0, 3.0), (3.0, 5.0, 9.0))
    assert c.at(100, 3) == [1.0, 2.0, 3.0] and c.at(1100, 3) == [3.0, 5.0, 9.0]
    assert c.at(600, 3) == [2.0, 3.5, 6.0]
    assert c.at(2100, 1) == [5.0]  # linear beyond the longer length too
    assert c.at(100, 5) == [1.0, 2.0, 3.0, 4.0, 5.0]  # rows past the table: the last row's increment
    assert c.at(100, 2) == [1.0, 2.0]
    with pytest.raises(ValueError, match="same non-empty"):
        StepCosts((0, 1), (1.0,), (1.0, 2.0))
    with pytest.raises(ValueError, match="increase"):
        StepCosts((5, 5), (1.0,), (1.0,))
    with pytest.raises(ValueError, match="> 0"):
        StepCosts((0, 1), (0.0,), (1.0,))
    assert not StepCosts.assumed().measured and StepCosts.assumed().at(0, 3) == [1.0, 1.25, 1.5]


@pytest.mark.parametrize("table, alpha, want", [
    ("8b-cuda-core", 0.95, 4),  # (1 + .95 + .95^2 + .95^3 + .95^4) / 2.481 = 1.83 beats every shorter verify
    ("8b-cuda-core", 0.6, 1),  # 1.6 / 1.322 = 1.21; two drafts 1.96 / 1.78 = 1.10
    ("8b-cuda-core", 0.3, 0),  # 1.3 / 1.322 < 1: a plain step
    ("8b-tensor-core", 0.5, 4),  # rows nearly free: 1.9375 / 1.077 = 1.80
    ("8b-tensor-core", 0.01, 0),  # 1.01 / 1.013 < 1
    ("1b-cuda-core", 0.6, 1),  # 1.6 / 1.39 = 1.15
    ("1b-cuda-core", 0.38, 0),  # 1.38 / 1.39 < 1
    ("8b-cuda-core", 0.35, 0),  # 1.35 / 1.322 = 1.021: a 2 % gain, under the 4 % margin
    ("1b-cuda-core", 0.44, 0),  # 1.44 / 1.39 = 1.036: under the margin
    ("1b-cuda-core", 0.46, 1),  # 1.46 / 1.39 = 1.050: over it
])
def test_the_drafts_verified_are_those_that_pay(table, alpha, want):
    d = AdaptiveDrafter(Scripted(), GPU[table], start_length=1024)
    d.start([1])
    d.kept, d.missed = alpha, 1 - alpha
    assert d.alpha == pytest.approx(alpha)
    assert d.drafts_worth(4) == want
    assert d.drafts_worth(0) == 0


def test_the_margin_is_what_a_verify_must_gain_over_a_plain_step():
    """A verify predicted to gain 2 % is taken without a margin and not with the default 4 %; the margin is
    checked at construction."""
    for margin, want in ((0.0, 1), (0.01, 1), (0.04, 0)):
        d = AdaptiveDrafter(Scripted(), GPU["8b-cuda-core"], start_length=1024, margin=margin)
        d.start([1])
        d.kept, d.missed = 0.35, 0.65  # 1.35 / 1.322 = 1.021
        assert d.drafts_worth(4) == want, margin
    for bad in (-0.01, 1.0):
        with pytest.raises(ValueError, match="margin"):
            AdaptiveDrafter(Scripted(), margin=bad)


@pytest.mark.parametrize("table", sorted(GPU))
def test_drafts_that_are_always_right_reach_the_count_that_pays_best(table):
    """From the prior (alpha 2/3) the count grows with each kept verify to the one that earns most when every
    draft is kept: (d + 1) / cost(d + 1) at its largest. Four where rows are cheap; three on the 1B's CUDA-core
    costs (4 / 2.35 beats 5 / 3.07)."""
    costs = GPU[table]
    c = costs.at(1024, 5)
    best = max(range(5), key=lambda d: (d + 1) / c[d])
    ratio, verified = play(AdaptiveDrafter(Scripted(), costs), lambda s: True, 200, costs)
    assert verified[0] >= 1 and verified[10:] == [best] * 190, verified[:12]
    assert ratio < 0.65


@pytest.mark.parametrize("table", sorted(GPU))
def test_drafts_that_are_always_wrong_cost_little_and_are_still_probed(table):
    """Worst case: drafts offered at every step, never right. The loss is the first few verifies (until alpha
    falls below what a verify costs) plus probes bounded to `explore` (1 %) of plain time; and the probes go
    on (drafting would resume if drafts turned right)."""
    costs = GPU[table]
    d = AdaptiveDrafter(Scripted(), costs)
    ratio, verified = play(d, lambda s: False, 3000, costs)
    assert ratio <= 1.02, ratio
    late = verified[1000:]
    c = costs.at(1024, 2)
    assert d._max_pause() >= (c[1] - c[0]) / (0.01 * c[0])
    assert sum(1 for v in late if v) >= len(late) // (d._max_pause() + 1) - 1 > 0


@pytest.mark.parametrize("table", ["8b-cuda-core", "1b-cuda-core"])
def test_drafting_resumes_when_drafts_turn_right(table):
    costs = GPU[table]
    d = AdaptiveDrafter(Scripted(), costs)
    turn = 1500
    c = costs.at(1024, 5)
    best = max(range(5), key=lambda d: (d + 1) / c[d])
    _, verified = play(d, lambda s: s >= turn, 1700, costs)
    assert sum(verified[:turn]) < turn // 10  # paused, probing
    resumed = next(i for i in range(turn, 1700) if verified[i] == best)
    assert resumed - turn <= d._max_pause() + 10, resumed - turn
    assert all(v == best for v in verified[resumed:])


def test_a_partial_acceptance_lowers_the_drafts_on_costly_rows():
    """Half the drafts kept, step after step: alpha settles near 2/3 (two kept, then a miss), where one or two
    drafts pay on the CUDA-core 8B's costs and four do not."""
    costs = GPU["8b-cuda-core"]

    d = AdaptiveDrafter(Scripted(), costs)
    d.start([1])
    seen = []
    for _ in range(60):
        drafts = d.propose(4)
        seen.append(len(drafts))
        d.extend([7] * (min(2, len(drafts)) + 1))  # the first two kept, the third (if any) missed
    assert set(seen[20:]) <= {1, 2, 3} and 4 not in seen[20:], seen


def test_the_hint_says_no_where_a_proposal_would_be_empty():
    """may_draft_next (the greedy chain queues the next plain step where it is False) says no exactly where
    drafting does not pay and no probe is due; a probe verifies one draft, and a missed probe doubles the
    pause."""
    d = AdaptiveDrafter(PromptLookupDrafter(2, 2), GPU["8b-cuda-core"])
    d.start([1, 2, 3, 1, 2])
    assert d.may_draft_next()  # the prior (2 kept, 1 missed) pays for one draft, and "2 x" heads a key
    assert d.propose(4) == [3]  # "1 2" was followed by 3; one draft is what pays at alpha 2/3
    d.extend([9])  # missed
    d.kept, d.missed = 0.1, 3.0  # drafts have been missing
    assert not d.may_draft_next() and d.propose(4) == []
    d.extend([1])
    d.extend([2])
    assert not d.may_draft_next() and d.propose(4) == []  # "1 2" -> 3 is there, but one draft does not pay
    d.extend([3])
    d.since_verify = d.pause  # a probe is due
    assert d.may_draft_next()
    pause = d.pause
    assert d.propose(4) == [1]  # "2 3" was followed by 1: one draft, a probe
    d.extend([5])  # missed
    assert d.pause == 2 * pause and d.since_verify == 0 and not d.may_draft_next()


def test_a_new_request_starts_from_the_prior_at_its_own_length():
    costs = StepCosts((0, 1000), (1.0, 1.1), (1.0, 3.0))  # a verify is cheap short, costly long
    cfg = SpeculationConfig(k=1)
    short = cfg.drafter(costs, start_length=10)
    long = cfg.drafter(costs, start_length=990)
    assert isinstance(short, AdaptiveDrafter) and short.costs is costs
    for d in (short, long):
        d.start([5, 6, 5])
        d.kept, d.missed = 9.0, 1.0
        d.start([5, 6, 5])
        assert (d.kept, d.missed, d.since_verify) == (2.0, 1.0, 0)
    assert short.drafts_worth(1) == 1 and long.drafts_worth(1) == 0
    assert isinstance(SpeculationConfig(adaptive=False).drafter(costs), PromptLookupDrafter)
    with pytest.raises(ValueError):
        AdaptiveDrafter(PromptLookupDrafter(), decay=0.0)
    with pytest.raises(ValueError):
        AdaptiveDrafter(PromptLookupDrafter(), prior=(0.0, 0.0))


@pytest.mark.parametrize("table", sorted(GPU))
def test_recorded_text_is_never_slower_than_plain(table):
    """The node's drafter on the copy model's recorded requests (a code edit, an agentic answer quoting a tool
    result, a code edit past what the model learnt), played at each measured cost table: at least 0.97x plain
    on every request, and a gain on the text that repeats."""
    texts = json.loads(TEXTS.read_text())["texts"]
    costs = GPU[table]
    got = {}
    for name, t in texts.items():
        d = SpeculationConfig().drafter(costs, start_length=len(t["prompt"]))
        got[name] = simulate_speedup(d, t["prompt"], t["output"], costs, k=4)
    assert min(got.values()) >= 0.97, got
    assert got["agentic"] > 1.15, got


def test_the_simulation_tallies_forwards_as_the_greedy_chain_launches_them():
    """Every forward is counted once: verifies, plain steps after a host sync (after a verify, or where the hint
    said the drafter might draft) and plain steps queued ahead. Text that never repeats: the lookup drafter's
    hint is False after the first step, so its plain steps are queued; a drafter without the hint syncs all."""
    costs = GPU["8b-cuda-core"]
    prompt, output = list(range(100, 140)), list(range(200, 260))  # nothing repeats
    tally: dict[str, int] = {}
    assert simulate_speedup(PromptLookupDrafter(), prompt, output, costs, 4, tally=tally) == pytest.approx(1.0)
    assert tally == {"verify": 0, "synced": 1, "queued": len(output) - 2}

    class NoHint:
        def start(self, context):
            pass

        def propose(self, k):
            return []

        def extend(self, tokens):
            pass

    simulate_speedup(NoHint(), prompt, output, costs, 4, tally=tally)
    assert tally == {"verify": 0, "synced": len(output) - 1, "queued": 0}
    # sync_overhead is charged to the synced forwards only: all of them here, one (the first) for the lookup
    c1, pen = costs.at(len(prompt), 1)[0], 0.1 * costs.at(len(prompt), 1)[0]
    assert simulate_speedup(NoHint(), prompt, output, costs, 4, sync_overhead=pen) == pytest.approx(
        c1 / (c1 + pen), rel=1e-3)
    n = len(output) - 1
    assert simulate_speedup(PromptLookupDrafter(), prompt, output, costs, 4, sync_overhead=pen) == pytest.approx(
        n * c1 / (n * c1 + pen), rel=1e-3)

    class OneDraft:  # one right draft at the first step, then none; says it cannot draft next
        def __init__(self):
            self.steps = 0

        def start(self, context):
            self.steps = 0

        def propose(self, k):
            self.steps += 1
            return [output[1]] if self.steps == 1 else []

        def may_draft_next(self):
            return False

        def extend(self, tokens):
            pass

    # the step after the verify: synced as the chain runs now, queued where a verify left the chain ahead
    simulate_speedup(OneDraft(), prompt, output, costs, 4, tally=tally)
    assert tally == {"verify": 1, "synced": 1, "queued": len(output) - 4}
    simulate_speedup(OneDraft(), prompt, output, costs, 4, tally=tally, verify_queues_ahead=True)
    assert tally == {"verify": 1, "synced": 0, "queued": len(output) - 3}
    texts = json.loads(TEXTS.read_text())["texts"]
    t = texts["agentic"]
    d = SpeculationConfig().drafter(costs, start_length=len(t["prompt"]))
    simulate_speedup(d, t["prompt"], t["output"], costs, 4, tally=tally)
    assert tally["verify"] > 0 and tally["queued"] > 0
    assert sum(tally.values()) < len(t["output"]) - 1  # verifies kept drafts: fewer forwards than tokens
