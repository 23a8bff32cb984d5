"""Block shapes decided by the whole step's time (models/step_tune.py): the rule on the CPU (which candidates
are timed, which one a plain or a verifying step keeps, what a re-pick changes), and on a GPU an engine whose
warm-up re-decides its picks, forced to the slowest candidate, still decodes exactly, speculating or not."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the jit functions are decorated

try:
    from expresslane.engine.models import fused, step_tune
except ImportError:  # no triton on this host
    fused = None
pytestmark = pytest.mark.skipif(fused is None, reason="needs triton")

A, B, C, D, E, F = (4, 1024, 1), (4, 1024, 1, 4, 8), (8, 512, 1, 4, 8), (16, 512, 0), (2, 2048, 0), (8, 256, 1)


def _pick(one_row: dict, picked, rows: int = 1, monkeypatch=None):
    key = ("k", 1, 2, rows, None, None)
    monkeypatch.setitem(fused._PICKED, key, picked)
    return fused.TimedPick(key, rows, dict(one_row), {"kernel": "k", "n": 1, "k": 2, "best": list(picked)})


def test_the_candidates_are_the_current_pick_then_the_fastest_alone_within_the_slack(monkeypatch):
    one_row = {A: 10.0, B: 10.2, C: 10.6, D: 12.0, E: 10.4, F: 10.45}
    pick = _pick(one_row, B, monkeypatch=monkeypatch)
    # the current pick first; then within 5 % of the fastest (10.5): A, E, F (C is 6 % slower, D 20 %)
    assert step_tune.candidates(pick) == [B, A, E, F]
    assert step_tune.candidates(pick, most=2) == [B, A, E]
    assert step_tune.candidates(pick, slack=0.0) == [B, A]
    alone = _pick({A: 10.0, D: 12.0}, A, monkeypatch=monkeypatch)
    assert step_tune.candidates(alone) == [A]  # nothing to decide: refine skips it


def test_a_plain_step_keeps_its_fastest_step_and_a_verifying_step_its_fastest_verify_within_the_slack():
    one = {A: 4.000, B: 4.010, C: 4.030, D: 3.990}
    assert step_tune.choose(one, None) == D
    # within 0.3 % of the fastest one-row step (3.990 -> 4.002): D and A; C's verify is faster but it costs
    # every plain step 1.0 % (within a 2 % slack it is kept)
    verify = {A: 9.0, B: 8.0, C: 5.0, D: 9.5}
    assert step_tune.choose(one, verify) == A
    assert step_tune.choose(one, verify, slack=0.02) == C
    # a tie keeps the earlier shape (the current pick is first)
    assert step_tune.choose({B: 4.0, A: 4.0}, None) == B
    assert step_tune.choose({B: 4.0, A: 4.0}, {B: 9.0, A: 9.0}) == B


def test_a_repick_takes_only_a_timed_candidate_and_says_what_it_picked(monkeypatch):
    pick = _pick({A: 10.0, B: 10.1}, A, rows=1, monkeypatch=monkeypatch)
    fused.repick(pick, B)
    assert fused._PICKED[pick.key] == B == pick.picked and pick.log["best"] == list(B)
    with pytest.raises(ValueError, match="not a timed candidate"):
        fused.repick(pick, D)
    assert pick.picked == B


def test_a_repick_compiles_the_verify_row_counts_in_between(monkeypatch):
    compiled = []
    monkeypatch.setattr(fused, "precompile", lambda jobs: [j() for j in jobs])
    pick = _pick({A: 10.0, B: 10.1}, A, rows=5, monkeypatch=monkeypatch)
    pick.compile = lambda cfg, r: compiled.append((cfg, r))
    fused.repick(pick, B, compile=False)
    assert compiled == []  # a trial: the one-row and five-row kernels of a timed candidate are compiled already
    fused.repick(pick, A)
    assert compiled == [(A, 2), (A, 3), (A, 4)]


def _wide_llama():
    """A random Llama wide enough that every lean kernel has several block shapes to choose from (the engine
    tests' checkpoints are 64 wide: each kernel fits one shape, so a warm-up has nothing to re-decide), with
    large logits so float32 summation order cannot flip an argmax."""
    from expresslane.engine.models.config import ModelConfig
    from expresslane.engine.models.transformer import Transformer

    cfg = ModelConfig(model_type="llama", vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_layers=3,
                      num_heads=16, num_kv_heads=4, head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=512,
                      tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
    torch.manual_seed(11)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.05 * torch.randn_like(p))
        model.lm_head.weight.mul_(8.0)
    return cfg, model.to(DEVICE, torch.float32).eval()


@pytest.mark.skipif(DEVICE != "cuda", reason="the lean step and its graphs need a CUDA device")
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculating"])
def test_a_warm_up_that_repicks_every_kernel_to_its_slowest_candidate_still_decodes_exactly(monkeypatch, spec):
    """The engine's warm-up re-decides every pick by the step's time; here the rule is replaced by "the last
    candidate timed", so every kernel with a choice changes shape after the first forward picked it (and, in a
    speculating engine, every verify row count runs the new shape). The first request then decodes the tokens of
    the PyTorch step (no lean kernels, no graphs), with drafts made and kept where speculation is on."""
    from expresslane.engine.decode import DecodeEngine, SamplingParams

    cfg, model = _wide_llama()
    prompt, n_new = [(7 * i + 3) % cfg.vocab_size for i in range(40)], 24
    kw = dict(dtype=torch.float32, device=torch.device("cuda"), max_seq_len=160, attention="split")
    ref = DecodeEngine(model, cfg, **kw, cuda_graph=False, lean=False, speculation=None)
    first = int(ref.prefill(prompt).argmax())
    expected = list(ref.generate(first, len(prompt), SamplingParams(max_tokens=n_new, ignore_eos=True)))
    # picked afresh (not an earlier test's), and put back after: a forced slow pick must not outlive the test
    monkeypatch.setattr(fused, "_PICKED", {})
    monkeypatch.setattr(fused, "TIMED_PICKS", {})
    monkeypatch.setattr(fused, "TUNING_LOG", [])
    monkeypatch.setattr(step_tune, "choose", lambda one_row, verify, slack=0.0: list(one_row)[-1])
    e = DecodeEngine(model, cfg, **kw, cuda_graph=True, lean=True, **({} if spec else {"speculation": None}))
    e.warmup()
    tuned = e.warmup_report.get("step_tuned", [])
    assert tuned and any(t["best"] != t["was"] for t in tuned), e.warmup_report
    assert all(p.step_timed for p in fused.TIMED_PICKS.values())
    for t in tuned:
        assert set(t["step_us"]) >= {t["best"], t["was"]} and all(v > 0 for v in t["step_us"].values()), t
        if spec and t.get("step_us_rows"):
            assert set(t["step_us_rows"]) == set(t["step_us"]), t
    assert int(e.prefill(prompt).argmax()) == first
    gen = e.generate(first, len(prompt), SamplingParams(max_tokens=n_new, ignore_eos=True,
                                                        prompt_token_ids=prompt + expected if spec else ()))
    assert list(gen) == expected
    if spec:
        assert gen.spec.accepted_tokens > 0, gen.spec.as_dict()
