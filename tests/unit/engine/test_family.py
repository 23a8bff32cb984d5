"""The GEMV family a request runs (decode/family.py) and the per-request engine that switches between them.

The predictor on the copy model's recorded requests at the H200's measured 8B step costs of both families: it
must pick the family that the replay of each request's recorded OUTPUT says is faster (tensor-core for the code
edit, the agentic request and the whole-file edit; cuda-core on random text). Then its edges (short prompt, no
prompt, the margin), that its replay charges what the bench's simulation charges, and on the CPU an engine with
a runner of each family: every request decodes the tokens a one-runner engine decodes, whichever family it ran.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from expresslane.engine.decode import DecodeEngine, SamplingParams, SpeculationConfig, StepCosts
from expresslane.engine.decode.bench import load_texts, simulate_speedup
from expresslane.engine.decode.family import FAMILIES, FamilyPolicy, choose_family, proposals, replay_seconds

REPO = Path(__file__).resolve().parents[3]
SIM = REPO / "docs/bench/2026-12-04-cost-aware-drafter"  # the policy simulator, beside the texts it replays
sys.path.insert(0, str(SIM))

from spec_policy_sim import cost_tables  # noqa: E402

TEXTS = SIM / "texts.json"
COSTS = REPO / "docs/bench/2026-12-04-gpu-check"  # bench.jsonl: tensor-core 8B; bench-8b-auto.jsonl: cuda-core


def _h200_8b_costs() -> dict[str, StepCosts]:
    """Each family's 8B forward ms by rows on the H200 (the decode bench's step_ms_by_rows), at the shortest and
    longest context measured (docs/bench/2026-12-04-cost-aware-drafter/spec_policy_sim.py reads them so)."""
    tables = cost_tables([str(COSTS / "bench.jsonl"), str(COSTS / "bench-8b-auto.jsonl")])
    out = {key.split()[-1]: c for key, c in tables.items() if key.startswith("llama-8b ")}
    assert set(out) == set(FAMILIES), tables.keys()
    return out


def _texts() -> dict[str, tuple[list[int], list[int]]]:
    texts = load_texts(str(TEXTS))
    rnd = random.Random(0)
    texts["random"] = ([rnd.randrange(1000) for _ in range(1200)], [rnd.randrange(1000) for _ in range(480)])
    return texts


def _output_seconds_per_token(prompt, output, costs: StepCosts, k: int = 4) -> float:
    """What the recorded output costs a token with the node's drafter at these costs (the truth the predictor
    predicts from the prompt alone)."""
    spec = SpeculationConfig(k=k)
    return replay_seconds(output, proposals(prompt, output, k, spec.ngram_min, spec.ngram_max), costs, k,
                          len(prompt)) / (len(output) - 1)


@pytest.mark.parametrize("name", ["code-edit", "agentic", "code-edit-long", "random"])
def test_the_prompt_predicts_the_family_its_output_runs_faster_on(name):
    costs = _h200_8b_costs()
    prompt, output = _texts()[name]
    truth = {f: _output_seconds_per_token(prompt, output, c) for f, c in costs.items()}
    faster = min(truth, key=truth.get)
    choice = choose_family(prompt, costs, SpeculationConfig())
    print(f"\n{name}: output s/token {truth}; chose {choice.family} ({choice.reason}) {choice.seconds_per_token}")
    assert faster == ("cuda-core" if name == "random" else "tensor-core")
    assert choice.family == faster


def test_short_missing_and_single_family_keep_the_default():
    costs = _h200_8b_costs()
    loop = [5, 6, 7, 8] * 100
    assert choose_family(loop, costs, SpeculationConfig()).family == "tensor-core"
    assert choose_family(loop[:63], costs, SpeculationConfig()).family == "cuda-core"  # < min_prompt
    assert choose_family(None, costs, SpeculationConfig()).reason == "no prompt ids"
    assert choose_family([], costs, SpeculationConfig()).family == "cuda-core"
    assert choose_family(loop, {"tensor-core": costs["tensor-core"]}, SpeculationConfig()).family == "tensor-core"
    with pytest.raises(ValueError):
        choose_family(loop, {}, SpeculationConfig())
    with pytest.raises(ValueError):
        FamilyPolicy(margin=1.0)
    with pytest.raises(ValueError):
        FamilyPolicy(repeats=1.0)


def test_the_other_family_must_win_by_the_margin():
    """Equal costs but 1 % cheaper verifies: the replay sees the gain, the 2 % margin keeps the default; with
    no margin the cheaper family wins."""
    base = StepCosts((0, 10_000), (1.0, 1.2, 1.4, 1.6, 1.8), (1.0, 1.2, 1.4, 1.6, 1.8))
    cheaper = StepCosts((0, 10_000), (1.0, 1.188, 1.386, 1.584, 1.782), (1.0, 1.188, 1.386, 1.584, 1.782))
    costs = {"cuda-core": base, "tensor-core": cheaper}
    loop = [5, 6, 7, 8, 9, 10, 11] * 60
    never = float("inf")  # the repeats rule off: a loop repeats, and it would take the cheaper verify
    kept = choose_family(loop, costs, SpeculationConfig(), FamilyPolicy(repeats=never))
    assert kept.family == "cuda-core" and kept.seconds_per_token["tensor-core"] < kept.seconds_per_token["cuda-core"]
    assert choose_family(loop, costs, SpeculationConfig(), FamilyPolicy(margin=0.0, repeats=never)).family \
        == "tensor-core"
    assert "the prompt repeats" in choose_family(loop, costs, SpeculationConfig()).reason


H100_AB = REPO / "docs/bench/2026-12-05-per-request-ab/h100-per-request/bench.jsonl"


def _h100_8b_costs() -> dict[str, StepCosts]:
    """Each family's 8B forward ms by rows on the H100 of the per-request A/B (one-family engines, 1k only)."""
    rows = [json.loads(line) for line in H100_AB.read_text().splitlines() if line.strip()]
    out = {}
    for family in FAMILIES:
        r = next(r for r in rows if r.get("gemv") == family and r["mode"] == "lookup")
        ms = tuple(v for _, v in sorted((int(k), v) for k, v in r["step_ms_by_rows"].items()))
        out[family] = StepCosts((r["context"], r["context"] + 1), ms, ms)
    return out


def _chooses_the_family_the_output_runs_faster_on(name: str, costs: dict[str, StepCosts]):
    """The recorded request's prompt and the choice for it, checked against what its recorded output costs a token
    on each family at these costs."""
    prompt, output = _texts()[name]
    truth = {f: _output_seconds_per_token(prompt, output, c) for f, c in costs.items()}
    choice = choose_family(prompt, costs, SpeculationConfig())
    print(f"\n{name}: output s/token {truth}; chose {choice.family} ({choice.reason})")
    assert choice.family == min(truth, key=truth.get)
    return prompt, choice


@pytest.mark.parametrize("name", ["code-edit", "agentic", "code-edit-long", "random"])
def test_a_prompt_that_repeats_runs_on_the_cheapest_verify_at_h100_costs(name):
    """On the H100 the CUDA-core verify is cheaper than on the H200 (five rows 1.79x one, not 2.49x), and the
    agentic prompt's tail predicted tensor-core only 1.017x faster: the margin kept it on cuda-core, where its
    output ran at 0.73x of the tensor-core engine (the A/B, H100_AB). Its replay's own gain says it repeats."""
    costs = _h100_8b_costs()
    prompt, choice = _chooses_the_family_the_output_runs_faster_on(name, costs)
    if name == "agentic":  # what the A/B measured: the margin rule alone keeps it on the slower family
        assert choose_family(prompt, costs, SpeculationConfig(), FamilyPolicy(repeats=float("inf"))).family \
            == "cuda-core"


H100_1B_AB = REPO / "docs/bench/2026-12-06-per-request-ab/h100-1b/bench.jsonl"


def _h100_1b_costs() -> dict[str, StepCosts]:
    """Each family's 1B forward ms by rows as the per-request engine of the 1B A/B measured them on the H100, at
    1k and 32k (the bench's step_ms_by_rows_by_family): five CUDA-core rows 2.29x one, five tensor-core rows
    1.11-1.41x one, one tensor-core row 1.09-1.14x a CUDA-core one."""
    rows = [json.loads(line) for line in H100_1B_AB.read_text().splitlines() if line.strip()]
    by_context = sorted((r["context"], r["step_ms_by_rows_by_family"]) for r in rows
                        if r.get("gemv") == "per-request" and r["mode"] == "lookup")
    (short_at, short), (long_at, long) = by_context[0], by_context[-1]

    def seconds(by_rows: dict) -> tuple[float, ...]:
        return tuple(v / 1e3 for _, v in sorted((int(k), v) for k, v in by_rows.items()))

    return {f: StepCosts((short_at, long_at), seconds(short[f]), seconds(long[f])) for f in FAMILIES}


@pytest.mark.parametrize("name", ["code-edit", "agentic", "code-edit-long", "random"])
def test_whether_a_prompt_repeats_is_read_on_the_cheapest_verify_at_h100_1b_costs(name):
    """At the 1B shape on an H100 the CUDA-core verify is so dear that the agentic prompt's replay runs barely
    faster speculating there: at the per-request engine's warm-up costs 1.036x (its chooser's record in
    H100_1B_AB), at the bench's costs here 1.058x, on either side of the 1.05 bar. Read on the default family the
    repeats rule missed it in the A/B, and the request ran at 0.65x of the tensor-core engine (1710.6 vs 2639.4
    tok/s at 1k). Read on the family with the cheapest verify, the replay runs 1.17x faster, far from the bar, and
    random text does not pass it: every request chooses what its output runs faster on."""
    costs = _h100_1b_costs()
    prompt, choice = _chooses_the_family_the_output_runs_faster_on(name, costs)
    assert choice.family == ("cuda-core" if name == "random" else "tensor-core")
    if name == "agentic":
        assert "the prompt repeats" in choice.reason
        n, per_token = len(prompt), choice.seconds_per_token
        on_default = costs["cuda-core"].at(n, 1)[0] / per_token["cuda-core"]  # the rule's first form: near the bar
        on_cheapest = costs["tensor-core"].at(n, 1)[0] / per_token["tensor-core"]
        assert on_default < 1.1 <= on_cheapest, (on_default, on_cheapest)


def test_the_agentic_request_of_the_1b_ab_runs_on_the_cheapest_verify():
    """The A/B's own choice, replayed: the CUDA-core costs its per-request engine measured at warm-up (the agentic
    row's step_costs; the chooser's record there: cuda-core 1.010763 ms a token, which this replay reproduces) and
    the tensor-core costs the bench measured. The rule's first form (the default family's replay, 1.036x there)
    kept the request on cuda-core; read on the cheapest verify it runs on tensor-core, 1.39x faster for its output."""
    rows = [json.loads(line) for line in H100_1B_AB.read_text().splitlines() if line.strip()]
    row = next(r for r in rows if r.get("gemv") == "per-request" and r["mode"] == "text-agentic")
    assert row["family"]["family"] == "cuda-core"  # what the A/B ran
    warm = row["step_costs"]
    costs = {**_h100_1b_costs(), "cuda-core": StepCosts(tuple(warm["lengths"]), tuple(warm["short"]),
                                                        tuple(warm["long"]))}
    prompt, output = _texts()["agentic"]
    choice = choose_family(prompt, costs, SpeculationConfig())
    assert choice.seconds_per_token["cuda-core"] == pytest.approx(row["family"]["seconds_per_token"]["cuda-core"],
                                                                  rel=1e-6)
    assert costs["cuda-core"].at(len(prompt), 1)[0] / choice.seconds_per_token["cuda-core"] < FamilyPolicy().repeats
    assert choice.family == "tensor-core" and "the prompt repeats" in choice.reason
    truth = {f: _output_seconds_per_token(prompt, output, c) for f, c in costs.items()}
    assert truth["cuda-core"] / truth["tensor-core"] > 1.3


@pytest.mark.parametrize("name", ["code-edit", "agentic", "random"])
def test_the_replay_charges_what_the_bench_simulation_charges(name):
    """replay_seconds (proposals computed once, then the adaptive drafter over them) spends what
    bench.simulate_speedup (the engine's loop with the real lookup drafter) spends, step for step."""
    costs = _h200_8b_costs()["cuda-core"]
    prompt, output = _texts()[name]
    spec = SpeculationConfig()
    ratio = simulate_speedup(spec.drafter(costs, start_length=len(prompt)), prompt, output, costs, spec.k)
    plain = sum(costs.at(len(prompt) + j, 1)[0] for j in range(len(output) - 1))
    got = replay_seconds(output, proposals(prompt, output, spec.k), costs, spec.k, len(prompt))
    assert got == pytest.approx(plain / ratio, rel=1e-9)


# ---- the per-request engine on the CPU (both runners run the PyTorch step; the switching is what is tested) ----

LOOP_PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38] * 8 + [3, 14, 15]  # 83 tokens that repeat


@pytest.fixture(scope="module")
def per_request(hf_model):
    kind, path, model = hf_model
    engine = DecodeEngine.from_pretrained(path, max_seq_len=256, lean_gemv="per-request")
    engine.warmup()
    plain = DecodeEngine.from_pretrained(path, max_seq_len=256, speculation=None)
    return engine, plain


def _greedy(engine, prompt, n, lookup):
    first = int(engine.prefill(prompt).argmax())
    gen = engine.generate(first, len(prompt), SamplingParams(max_tokens=n, ignore_eos=True,
                                                                prompt_token_ids=lookup or ()))
    return list(gen), gen


def test_a_per_request_engine_holds_a_runner_of_each_family(per_request):
    engine, _ = per_request
    assert engine.families == FAMILIES and len(engine.runners) == 2
    assert engine.runners[0] is not engine.runners[1]
    assert set(engine.warmup_report["families"]) == set(FAMILIES)
    caps = engine.capabilities()
    assert caps["lean_gemv"] == "per-request" and set(caps["gemv_families"]) == set(FAMILIES)
    for family in FAMILIES:  # each family's own costs, measured at its warm-up
        assert caps["gemv_families"][family]["step_costs"]["measured"], caps["gemv_families"][family]
    assert engine.family == FAMILIES[0] and engine.runner is engine.runners[0]
    with pytest.raises(ValueError):
        engine.use_family("no-such-family")


def test_every_family_decodes_the_tokens_of_a_one_runner_engine(per_request):
    """Each family pinned, then chosen (a prompt that repeats, and no prompt ids): the same greedy tokens as an
    engine without speculation, and the request counted under the family it ran."""
    engine, plain = per_request
    want, _ = _greedy(plain, LOOP_PROMPT, 40, LOOP_PROMPT)
    before = dict(engine.family_requests)
    try:
        for family in FAMILIES:
            engine.pinned_family = family
            got, gen = _greedy(engine, LOOP_PROMPT, 40, LOOP_PROMPT)
            assert got == want, family
            assert gen.family.family == family and engine.runner is engine.runners[FAMILIES.index(family)]
    finally:
        engine.pinned_family = None
    for lookup in (LOOP_PROMPT, None):
        got, gen = _greedy(engine, LOOP_PROMPT, 40, lookup)
        assert got == want
        assert gen.family is not None and gen.family.family in FAMILIES, gen.family
        print(f"\nprompt ids {'given' if lookup else 'absent'}: {gen.family.as_dict()}")
    assert sum(engine.family_requests.values()) - sum(before.values()) == 4


def test_per_request_needs_speculation(hf_model):
    _, path, _ = hf_model
    with pytest.raises(ValueError, match="speculation"):
        DecodeEngine.from_pretrained(path, max_seq_len=64, lean_gemv="per-request", speculation=None)


def test_a_request_that_never_speculates_keeps_the_default_family(per_request):
    """Penalties turn speculation off for a request (its sampling reads every earlier token): it runs the default
    family whatever `speculative` says, and decodes what a one-runner engine decodes."""
    engine, plain = per_request
    first = int(plain.prefill(LOOP_PROMPT).argmax())
    params = dict(max_tokens=30, ignore_eos=True, temperature=0.0, presence_penalty=0.5,
                  prompt_token_ids=LOOP_PROMPT)
    want = list(plain.generate(first, len(LOOP_PROMPT), SamplingParams(**params)))
    for speculative in (True, False):
        engine.prefill(LOOP_PROMPT)
        gen = engine.generate(first, len(LOOP_PROMPT), SamplingParams(**params, speculative=speculative))
        assert list(gen) == want
        assert (gen.family.family, gen.family.reason) == (FAMILIES[0], "its sampling never speculates")


def test_the_bench_drafts_each_text_row_from_the_continuation_of_the_family_it_runs(per_request, monkeypatch):
    """decode/bench.py: a recorded text's row replays drafts of the greedy continuation that the family chosen for
    its prompt decodes (that family's own plain decode, pinned), not the default family's: in bf16 the two part at
    the first near-tie, and from there every draft of the other's continuation is rejected (the first per-request
    run on the H200: acceptance 0.00 on every text row). The chosen family is the other one here; the decode it
    runs is counted under it, and the pin is put back."""
    from expresslane.engine.decode import bench
    from expresslane.engine.decode.family import FamilyChoice

    engine, plain = per_request
    prompt = LOOP_PROMPT
    first = int(engine.prefill(prompt).argmax())
    row = bench.time_decode(engine, prompt, first, 20, 1, speculative=False)
    assert row["family"]["family"] == FAMILIES[0]
    assert bench.family_continuation(engine, prompt, first, 20, row, [1, 2, 3], {}) is row["token_ids"]  # default: its own
    other = FAMILIES[1]
    monkeypatch.setattr(engine, "choose_family", lambda ids: FamilyChoice(other, {}, "test"))
    before = engine.family_requests[other]
    decoded = {}
    cont = bench.family_continuation(engine, prompt, first, 20, row, [1, 2, 3], decoded)
    assert engine.family_requests[other] == before + 1 and engine.pinned_family is None
    assert cont == row["token_ids"]  # on the CPU both families run the PyTorch step: the same tokens
    assert bench.family_continuation(engine, prompt, first, 20, row, [4], decoded) is cont  # decoded once a family
    assert engine.family_requests[other] == before + 1
