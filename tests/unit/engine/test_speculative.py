"""Speculative decoding is exact: greedy output token-identical with speculation on and off (and to
transformers), for prompt lookup, a draft model and drafters that are always wrong (every step a rollback);
the per-request opt-out, the budget (max_tokens, stop ids, max_seq_len) and the counters behave."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from expresslane.engine.decode import (AdaptiveDrafter, DecodeEngine, DraftModelDrafter, PromptLookupDrafter,
                                       SamplingParams, SpeculationConfig, StepCosts)

from .test_engine_vs_transformers import dense_kv, hf_greedy

# A prompt that repeats itself, so prompt lookup finds matches (agentic / code-edit traffic does this).
LOOP_PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38] * 3 + [3, 14, 15]
N_NEW = 60


class WrongDrafter:
    """Proposes k tokens chosen without the model (almost always wrong): nearly every verify step rejects
    at row 0, leaving k rows of rejected K/V past the length that must be rolled back."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.last = 0

    def start(self, context):
        self.last = context[-1]

    def propose(self, k):
        return [(self.last * 7 + i + 1) % self.vocab for i in range(k)]

    def extend(self, tokens):
        self.last = tokens[-1]


@pytest.fixture(scope="module")
def engines(hf_model):
    kind, path, model = hf_model
    spec = DecodeEngine.from_pretrained(path, max_seq_len=256)
    plain = DecodeEngine.from_pretrained(path, max_seq_len=256, speculation=None)
    assert spec.speculation is not None and plain.speculation is None
    return model, spec, plain


def _greedy(engine, prompt, n, lookup=None, **kw):
    first = int(engine.prefill(prompt).argmax())
    gen = engine.generate(first, len(prompt), SamplingParams(max_tokens=n, ignore_eos=True,
                                                             prompt_token_ids=lookup or prompt, **kw))
    return list(gen), gen


def test_greedy_identical_with_prompt_lookup(engines):
    """Random weights do not copy their prompt, so most lookups here miss or are rejected: this is the
    exactness check under mixed accept / reject (the next test has the drafts mostly right)."""
    model, spec, plain = engines
    expected, _ = hf_greedy(model, LOOP_PROMPT, N_NEW)
    got, gen = _greedy(spec, LOOP_PROMPT, N_NEW)
    ref, ref_gen = _greedy(plain, LOOP_PROMPT, N_NEW)
    assert got == ref == expected
    assert gen.spec.verify_steps > 0, gen.spec.as_dict()
    assert ref_gen.spec.verify_steps == 0


def test_greedy_identical_when_the_context_holds_the_answer(engines):
    """The lookup context contains the continuation (as an edit request's output copies its input): drafts
    are mostly accepted, several tokens per forward, and the output is still exactly the target's."""
    model, spec, plain = engines
    prompt = LOOP_PROMPT[:13]
    expected, _ = hf_greedy(model, prompt, N_NEW)
    got, gen = _greedy(spec, prompt, N_NEW, lookup=prompt + expected)
    assert got == expected == _greedy(plain, prompt, N_NEW)[0]
    s = gen.spec
    assert s.mean_acceptance > 2.5 and s.tokens_per_forward > 3, s.as_dict()


def test_every_draft_rejected_rolls_back(engines):
    """k garbage rows are written past the length at every step; output must not change."""
    _, spec, plain = engines
    spec.set_drafter(lambda: WrongDrafter(spec.vocab_size))
    try:
        got, gen = _greedy(spec, LOOP_PROMPT, N_NEW)
    finally:
        spec.set_drafter(lambda: PromptLookupDrafter(2, 4))
    ref, _ = _greedy(plain, LOOP_PROMPT, N_NEW)
    assert got == ref
    s = gen.spec
    assert s.verify_steps >= N_NEW // 2 and s.drafted_tokens >= 3 * s.verify_steps
    assert s.accepted_tokens <= s.verify_steps // 4, "the wrong drafter was right too often to test rollback"


def test_injected_kv_then_speculation(engines):
    model, spec, _ = engines
    expected, past = hf_greedy(model, LOOP_PROMPT, N_NEW)
    k, v = dense_kv(past)
    spec.prefill([5] * 80)  # dirty the cache so a no-op inject cannot pass
    spec.inject(k, v, len(LOOP_PROMPT))
    gen = spec.generate(expected[0], len(LOOP_PROMPT),
                        SamplingParams(max_tokens=N_NEW, ignore_eos=True, prompt_token_ids=LOOP_PROMPT + expected))
    assert list(gen) == expected and gen.spec.accepted_tokens > 0


def test_draft_model_drafter(hf_model):
    """The target itself as the draft model: every draft is the target's choice (acceptance k each step)."""
    _, path, model = hf_model
    target = DecodeEngine.from_pretrained(path, max_seq_len=256, speculation=SpeculationConfig(k=3))
    draft = DecodeEngine.from_pretrained(path, max_seq_len=256, speculation=None)
    target.set_drafter(lambda: DraftModelDrafter(draft))
    prompt = LOOP_PROMPT[:13]
    expected, _ = hf_greedy(model, prompt, 40)
    got, gen = _greedy(target, prompt, 40)
    assert got == expected
    assert gen.spec.mean_acceptance == pytest.approx(3.0, abs=0.5), gen.spec.as_dict()


def test_opt_out_and_penalties_decode_without_drafts(engines):
    _, spec, plain = engines
    got, gen = _greedy(spec, LOOP_PROMPT, 30, speculative=False)
    assert gen.spec.verify_steps == 0 and got == _greedy(plain, LOOP_PROMPT, 30)[0]
    got, gen = _greedy(spec, LOOP_PROMPT, 30, presence_penalty=1.0)
    assert gen.spec.verify_steps == 0
    assert got == _greedy(plain, LOOP_PROMPT, 30, presence_penalty=1.0)[0]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 12])
def test_budget_is_exact(engines, n):
    """max_tokens is honoured even when a verify step could emit more tokens than are left."""
    _, spec, plain = engines
    got, gen = _greedy(spec, LOOP_PROMPT, n)
    assert len(got) == n and gen.finish_reason == "length"
    assert got == _greedy(plain, LOOP_PROMPT, n)[0]


def test_stop_token_inside_accepted_drafts(engines):
    _, spec, plain = engines
    ref, _ = _greedy(plain, LOOP_PROMPT, N_NEW)
    stop = ref[20]
    cut = ref.index(stop)
    for engine in (spec, plain):
        first = int(engine.prefill(LOOP_PROMPT).argmax())
        gen = engine.generate(first, len(LOOP_PROMPT), SamplingParams(
            max_tokens=N_NEW, stop_token_ids=[stop], prompt_token_ids=LOOP_PROMPT))
        assert list(gen) == ref[: cut + 1] and gen.finish_reason == "stop"
    # min_tokens masks stop ids per verified row
    got = [_greedy(e, LOOP_PROMPT, N_NEW, stop_token_ids=[stop], min_tokens=cut + 5)[0] for e in (spec, plain)]
    assert got[0] == got[1]


def test_max_seq_len_with_speculation(hf_model):
    _, path, _ = hf_model
    spec = DecodeEngine.from_pretrained(path, max_seq_len=64)
    plain = DecodeEngine.from_pretrained(path, max_seq_len=64, speculation=None)
    a, gen = _greedy(spec, LOOP_PROMPT, 1000)
    assert len(a) == 64 - len(LOOP_PROMPT) and gen.finish_reason == "length"
    assert a == _greedy(plain, LOOP_PROMPT, 1000)[0]


def test_counters_accumulate_on_the_engine(engines):
    _, spec, plain = engines
    expected, _ = _greedy(plain, LOOP_PROMPT, N_NEW)
    before = spec.spec_stats.accepted_tokens
    _, gen = _greedy(spec, LOOP_PROMPT, N_NEW, lookup=LOOP_PROMPT + expected)
    assert gen.spec.accepted_tokens > 0
    assert spec.spec_stats.accepted_tokens == before + gen.spec.accepted_tokens
    d = gen.spec.as_dict()
    assert sum(d["accepted_histogram"]) == d["verify_steps"]
    assert spec.capabilities()["speculative"] is True


def test_prompt_lookup_drafter():
    d = PromptLookupDrafter(ngram_min=2, ngram_max=3)
    d.start([1, 2, 3, 4, 5, 1, 2])
    assert d.propose(3) == [3, 4, 5]  # "1 2" was followed by 3 4 5
    d.extend([9])
    assert d.propose(3) == []  # "2 9" never seen
    d.start([1, 2, 3, 1, 2, 4, 1, 2])
    assert d.propose(2) == [4, 1]  # the LATEST earlier occurrence wins
    d.start([5, 6, 7, 8, 6, 7, 9, 5, 6, 7])
    assert d.propose(2) == [8, 6]  # longest n-gram first: "5 6 7" -> 8, not "6 7" -> 9
    with pytest.raises(ValueError):
        SpeculationConfig(k=0)


@pytest.mark.parametrize("ngrams", [(2, 4), (1, 3), (3, 3)])
def test_lookup_start_builds_what_extend_builds(ngrams):
    """start() builds the index of its context at once (zips); extend() token by token: the same n-gram index,
    heads, proposals and hints, for contexts of every length from 0 up, on small and large vocabularies."""
    import random

    rnd = random.Random(1)
    for length in [*range(0, 12), 100, 2000]:
        for vocab in (2, 7, 50_000):
            ctx = [rnd.randrange(vocab) for _ in range(length)]
            at_once, by_token = PromptLookupDrafter(*ngrams), PromptLookupDrafter(*ngrams)
            at_once.start(ctx)
            by_token.start([])
            by_token.extend(ctx)
            assert (at_once.tokens, at_once._index, at_once._heads) == \
                (by_token.tokens, by_token._index, by_token._heads), (length, vocab)
            for tok in (ctx[-1:] or [0]) * 3:  # and they go on alike
                assert at_once.propose(4) == by_token.propose(4)
                assert at_once.may_draft_next() == by_token.may_draft_next()
                at_once.extend([tok])
                by_token.extend([tok])


@pytest.mark.skipif(not os.environ.get("EXPRESSLANE_COMPILE_TESTS"),
                    reason="compiles the step twice (T = 1 and T > 1): about 2 min of CPU; set EXPRESSLANE_COMPILE_TESTS=1 "
                           "(the express-lane integration tests run the compiled step with speculation too)")
def test_compiled_cpu_step_with_verify_rows(hf_model):
    """torch.compile'd live attention (SDPA over the live rows, a [T, L] mask for verify rows) decodes
    exactly like transformers, with drafts accepted and rejected. One architecture: compiling costs time."""
    kind, path, model = hf_model
    if kind != "qwen3":
        pytest.skip("one architecture is enough for the compiled path (the eager tests cover all three)")
    torch._dynamo.reset()
    compiled = DecodeEngine.from_pretrained(path, max_seq_len=256, compile=True)
    prompt = LOOP_PROMPT[:13]
    expected, _ = hf_greedy(model, prompt, N_NEW)
    got, gen = _greedy(compiled, prompt, N_NEW, lookup=prompt + expected[:30] + [1, 2, 3] + expected[33:])
    assert got == expected
    assert gen.spec.accepted_tokens > 10 and gen.spec.drafted_tokens > gen.spec.accepted_tokens, gen.spec.as_dict()
    torch._dynamo.reset()


def test_adaptive_drafter_is_exact_and_cheap_where_drafts_miss(engines):
    """Always-wrong drafts behind the adaptive wrapper, with verifies that cost what they do on a GPU's CUDA-core
    step (each row half a step more): output unchanged, and few verify forwards (the first, then probes)."""
    _, spec, plain = engines
    costs = StepCosts((0, 256), (1.0, 1.5, 2.0, 2.5, 3.0), (1.0, 1.5, 2.0, 2.5, 3.0))
    spec.set_drafter(lambda: AdaptiveDrafter(WrongDrafter(spec.vocab_size), costs))
    try:
        got, gen = _greedy(spec, LOOP_PROMPT, N_NEW)
    finally:
        spec.set_drafter(None)
    assert got == _greedy(plain, LOOP_PROMPT, N_NEW)[0]
    s = gen.spec
    assert 1 <= s.verify_steps <= 8 and s.plain_steps >= N_NEW - 10, s.as_dict()
    assert isinstance(SpeculationConfig().drafter(), AdaptiveDrafter)
    assert isinstance(SpeculationConfig(adaptive=False).drafter(), PromptLookupDrafter)


def test_warmup_measures_the_step_costs_the_default_drafter_weighs(hf_model):
    """warmup() times forwards of 1 .. k + 1 rows near the cache's start and end; the engine's default drafter
    (and only it: a custom factory is the caller's) gets that table and the request's length; capabilities
    show it."""
    _, path, _ = hf_model
    engine = DecodeEngine.from_pretrained(path, max_seq_len=128, speculation=SpeculationConfig(k=2))
    assert not engine.step_costs.measured
    engine.warmup(steps=2)
    c = engine.step_costs
    assert c.measured and c.lengths == (16, 128 - 3 - 1) and len(c.short) == len(c.long) == 3
    assert all(a <= b for a, b in zip(c.short, c.short[1:])) and all(a <= b for a, b in zip(c.short, c.long))
    assert engine.capabilities()["speculation"]["step_costs"] == c.as_dict()
    d = engine.new_drafter(40)
    assert isinstance(d, AdaptiveDrafter) and d.costs is c and d.start_length == 40
    engine.set_drafter(lambda: PromptLookupDrafter())
    assert isinstance(engine.new_drafter(40), PromptLookupDrafter)
    engine.set_drafter(None)
    assert isinstance(engine.new_drafter(40), AdaptiveDrafter)
    off = DecodeEngine.from_pretrained(path, max_seq_len=64, speculation=None)
    off.warmup(steps=2)
    assert off.new_drafter(10) is None and not off.step_costs.measured and off.capabilities()["speculation"] is None
    # where each warm-up's time went, by phase (the calibration only where the engine speculates)
    for e, phases in ((engine, ["prefill", "capture", "verify_rows", "generate", "calibrate"]),
                      (off, ["prefill", "capture", "verify_rows", "generate"])):
        report = e.warmup_report
        assert list(report["phases"]) == phases, report
        # each figure is rounded to the ms on its own: the phases' sum may pass the total by half a ms each
        assert 0 < sum(report["phases"].values()) <= report["seconds"] + 5e-4 * (len(phases) + 1)
        assert report["phases"]["calibrate" if e is engine else "generate"] > 0


def test_a_recorded_trace_replays_step_for_step(engines):
    """bench.py's RecordingDrafter takes down the node's own drafter (adaptive prompt lookup) step by step, and
    its ReplayDrafter, given only that trace and the greedy continuation, makes another request verify the same
    row counts and keep the same drafts: the same counters, histogram and tokens (how the GPU check replays the
    copy model's code-edit / agentic requests at the 8B shape)."""
    from expresslane.engine.decode.bench import RecordingDrafter, ReplayDrafter

    model, spec, plain = engines
    prompt = LOOP_PROMPT  # its loop drafts what random weights do not say: drafts missed
    expected, _ = hf_greedy(model, prompt, N_NEW)
    steps: list[tuple[int, int]] = []
    spec.set_drafter(lambda: RecordingDrafter(SpeculationConfig().drafter(), steps))
    try:
        # the continuation's second half in the lookup context: drafts kept there, missed before
        recorded, rec_gen = _greedy(spec, prompt, N_NEW, lookup=prompt + expected[N_NEW // 2:])
        trace = list(steps)
        spec.set_drafter(lambda: ReplayDrafter(recorded, trace, spec.vocab_size))
        replayed, rep_gen = _greedy(spec, prompt, N_NEW, lookup=[0])  # no context to look anything up in
    finally:
        spec.set_drafter(None)
    assert recorded == replayed == expected
    assert len(trace) == rec_gen.spec.verify_steps + rec_gen.spec.plain_steps
    assert rec_gen.spec.accepted_tokens > 0 and any(d > a for d, a in trace), trace  # kept and missed drafts
    assert rep_gen.spec.as_dict() == rec_gen.spec.as_dict()
    with pytest.raises(ValueError, match="0 <= kept <= drafted"):
        ReplayDrafter(recorded, [(1, 2)], spec.vocab_size)


def test_a_recorded_text_replays_the_drafter_and_the_simulation_matches_the_engine(engines):
    """bench.py's TextReplayDrafter runs the node's drafter on a recorded request's text and has this model
    verify what it picks there: replaying a request of this very model gives the same counters and tokens as
    the request itself. And simulate_speedup, which plays the engine's loop over a fixed greedy output
    without a model, takes the same steps as the engine did (how the policy simulator of
    docs/bench/2026-12-04-cost-aware-drafter/ predicts a policy at a GPU's measured costs)."""
    from expresslane.engine.decode.bench import RecordingDrafter, TextReplayDrafter, simulate_speedup

    model, spec, plain = engines
    prompt = LOOP_PROMPT
    expected, _ = hf_greedy(model, prompt, N_NEW)
    lookup = prompt + expected[N_NEW // 2:]  # drafts kept in the second half, missed before
    costs = StepCosts((0, 256), (1.0, 1.1, 1.2, 1.3, 1.4), (1.0, 1.2, 1.4, 1.6, 1.8))
    steps: list[tuple[int, int]] = []
    spec.set_drafter(lambda: RecordingDrafter(SpeculationConfig().drafter(costs, len(prompt)), steps))
    try:
        direct, gen = _greedy(spec, prompt, N_NEW, lookup=lookup)
        engine_steps = list(steps)
        spec.set_drafter(lambda: TextReplayDrafter(SpeculationConfig().drafter(costs, len(prompt)), lookup, direct,
                                                   direct, spec.vocab_size))
        replayed, rep_gen = _greedy(spec, prompt, N_NEW, lookup=[0])
    finally:
        spec.set_drafter(None)
    assert direct == replayed == expected
    assert gen.spec.accepted_tokens > 0 and gen.spec.drafted_tokens > gen.spec.accepted_tokens, gen.spec.as_dict()
    assert rep_gen.spec.as_dict() == gen.spec.as_dict()
    sim_steps: list[tuple[int, int]] = []
    speedup = simulate_speedup(RecordingDrafter(SpeculationConfig().drafter(costs, len(prompt)), sim_steps),
                               lookup, direct, costs, k=spec.speculation.k)
    assert sim_steps == engine_steps and speedup > 1.0


def test_text_replay_translates_drafts_to_this_model():
    """Kept where the recorded output agrees, this model's continuation in their place, one wrong token where
    the recorded output disagrees; nothing past the recorded output."""
    from expresslane.engine.decode.bench import TextReplayDrafter, load_texts

    class Fixed:
        def __init__(self):
            self.seen = []

        def start(self, context):
            self.seen = list(context)

        def propose(self, k):
            return [5, 6, 99, 8][:k]

        def extend(self, tokens):
            self.seen += list(tokens)

    inner = Fixed()
    d = TextReplayDrafter(inner, [1, 2], [4, 5, 6, 7, 8], [40, 50, 60, 70, 80], vocab_size=100)
    d.start([0])
    assert inner.seen == [1, 2, 4]
    assert d.propose(4) == [50, 60, 71, 80]  # 5, 6 kept; 99 is not 7: this model's 70 + 1 there
    d.extend([50, 60, 70])
    assert inner.seen == [1, 2, 4, 5, 6, 7] and d.i == 4
    assert d.propose(4) == [81]  # one recorded token left: one draft at most, wrong (5 is not 8)
    d.extend([80])
    assert d.propose(4) == [] and not d.may_draft_next()
    with pytest.raises(ValueError, match="at least one output token"):
        TextReplayDrafter(inner, [1], [], [1], vocab_size=10)
    texts = load_texts(str(Path(__file__).resolve().parents[3] / "docs/bench/2026-12-04-cost-aware-drafter/texts.json"))
    assert set(texts) == {"code-edit", "agentic", "code-edit-long"}
    assert all(len(o) == 480 and len(p) > 200 for p, o in texts.values())
