"""On a GPU: speculative decoding through the CUDA graphs of each verify bucket (split-KV and masked
attention, plain and compiled steps) gives exactly the tokens of plain eager decoding and of transformers.
Skipped where there is no CUDA device (CI); the CPU tests in test_speculative.py cover the logic."""

from __future__ import annotations

import pytest
import torch

from expresslane.engine.decode import DecodeEngine, SamplingParams

from .test_engine_vs_transformers import PROMPT, hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
N_NEW = 48


# lean_gemv: the lean step's GEMV kernels (models/lean.py); auto is the CUDA-core family, so the tensor-core one
# (the opt-in for traffic that repeats) runs here by name.
@pytest.mark.parametrize("attention,compile,lean_gemv", [("split", False, "auto"), ("masked", False, "auto"),
                                                         ("split", True, "auto"), ("split", False, "tensor-core")])
def test_graph_speculation_matches_plain_and_transformers(hf_model, attention, compile, lean_gemv):
    kind, path, model = hf_model
    engine = DecodeEngine.from_pretrained(path, device="cuda", max_seq_len=256, attention=attention,
                                          compile=compile, lean_gemv=lean_gemv)
    if lean_gemv == "tensor-core":  # Qwen3's per-head q/k norms keep the PyTorch step: no lean GEMVs there
        assert engine.runner.lean_gemv == (None if kind == "qwen3" else "tensor-core")
    plain = DecodeEngine.from_pretrained(path, device="cuda", max_seq_len=256, cuda_graph=False, speculation=None)
    assert engine.cuda_graph
    expected, _ = hf_greedy(model, PROMPT, N_NEW)
    for lookup, min_accepted in ((PROMPT + expected, N_NEW // 3), (PROMPT, 0)):
        outs = []
        for e in (engine, plain):
            first = int(e.prefill(PROMPT).argmax())
            gen = e.generate(first, len(PROMPT), SamplingParams(max_tokens=N_NEW, ignore_eos=True,
                                                                prompt_token_ids=lookup))
            outs.append(list(gen))
            if e is engine:
                assert gen.spec.accepted_tokens >= min_accepted, gen.spec.as_dict()
        assert outs[0] == outs[1] == expected
    assert len(engine.runner._graphs) > 1, "no verify bucket was captured"


def test_seeded_speculative_sampling_graph_vs_eager(hf_model):
    _, path, _ = hf_model
    runs = []
    for cuda_graph in (True, False):
        e = DecodeEngine.from_pretrained(path, device="cuda", max_seq_len=256, cuda_graph=cuda_graph,
                                         attention="split")
        first = int(e.prefill(PROMPT).argmax())
        gen = e.generate(first, len(PROMPT), SamplingParams(max_tokens=40, temperature=0.8, top_k=20, seed=7,
                                                            ignore_eos=True, prompt_token_ids=PROMPT * 2))
        runs.append(list(gen))
    assert runs[0] == runs[1]


def test_a_per_request_engine_is_exact_in_each_family_from_its_first_request(hf_model):
    """lean_gemv per-request (decode/family.py): a runner of each GEMV family over one model and cache. No
    warm-up, so each family's first request captures its graphs: pinned to each family in turn, with drafts
    that are right (the continuation as the lookup context) and mostly not, speculating and not, every request
    equals transformers; then a chosen family does too."""
    from expresslane.engine.decode.family import FAMILIES

    kind, path, model = hf_model
    engine = DecodeEngine.from_pretrained(path, device="cuda", max_seq_len=256, lean_gemv="per-request")
    assert engine.families == FAMILIES
    assert [r.lean_gemv for r in engine.runners] == ([None, None] if kind == "qwen3" else list(FAMILIES))
    expected, _ = hf_greedy(model, PROMPT, N_NEW)

    def greedy(lookup, speculative=True):
        first = int(engine.prefill(PROMPT).argmax())
        gen = engine.generate(first, len(PROMPT), SamplingParams(max_tokens=N_NEW, ignore_eos=True,
                                                                prompt_token_ids=lookup, speculative=speculative))
        return list(gen), gen

    for family in FAMILIES:
        engine.pinned_family = family
        for lookup in (PROMPT + expected, PROMPT):
            for speculative in (True, False):
                got, gen = greedy(lookup, speculative)
                assert got == expected, (family, len(lookup), speculative)
                assert gen.family.family == family
    engine.pinned_family = None
    got, gen = greedy(PROMPT + expected)
    assert got == expected and gen.family.family in FAMILIES, gen.family
