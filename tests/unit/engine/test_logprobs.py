"""logprobs / top_logprobs on the express engine (decode/logprobs.py): vLLM 0.32's raw_logprobs (float32 log_softmax
of the logits the sampler gets, grammar-masked), equal to a transformers float32 reference within 1e-4, top lists in
topk order, the same with speculation on, and the first token's entries None (the prefill has them)."""

from __future__ import annotations

import pytest
import torch

from expresslane.engine.decode import SamplingParams
from expresslane.engine.decode.grammar import StructuredOutputSpec
from expresslane.engine.decode.logprobs import MAX_TOP_LOGPROBS, pack, unpack

from .test_grammar_fixtures import (PERSON, compiler, engine, hf, hf_reference, prompt_ids, run,  # noqa: F401
                                    spec_engine, tiny_dir, tokenizer)

# 1e-4, absolute or relative: the engine's float32 forward and transformers' differ by ~1e-4 in the logits
# (summation order), which the logprobs inherit (seen: 1.3e-4 at a logprob of -2.03). A float32 sum's error
# grows with its terms: where the step's log-probs reach -166 (the tiny random model's logits span ~170) a
# CUDA GEMM's order gave 1.007e-4 at a logprob of -0.99 (H200), so the bound is also 2e-6 of that span.
TOL = 1e-4


def tol(ref: torch.Tensor) -> float:
    return max(TOL, 2e-6 * float(ref[torch.isfinite(ref)].abs().max()))


def check_against(gen, ref_tokens, ref_lps, k):
    assert gen.token_ids == ref_tokens
    assert gen.logprobs[0] is None and gen.top_logprobs[0] is None  # the first token's come from the prefill
    assert len(gen.logprobs) == len(gen.top_logprobs) == len(gen.token_ids)
    for i in range(1, len(gen.token_ids)):
        ref = ref_lps[i]
        t = tol(ref)
        assert gen.logprobs[i] == pytest.approx(float(ref[gen.token_ids[i]]), abs=t, rel=TOL)
        top = gen.top_logprobs[i]
        assert len(top) == k
        vals = [v for _, v in top]
        assert vals == sorted(vals, reverse=True)  # descending (topk order)
        ref_v, ref_i = ref.topk(k)
        finite = torch.isfinite(ref_v)
        assert [t for (t, _), f in zip(top, finite) if f] == ref_i[finite].tolist()
        assert vals == pytest.approx(ref_v.tolist(), abs=t, rel=TOL)


def test_logprobs_equal_a_transformers_float32_reference(engine, tokenizer, hf):
    prompt = prompt_ids(tokenizer, "Once upon a time ")
    gen = run(engine, None, prompt, None, max_tokens=24, ignore_eos=True, logprobs=5)
    ref_tokens, ref_lps = hf_reference(hf, None, prompt, None, 24, ())
    check_against(gen, ref_tokens, ref_lps, 5)
    assert all(lp < 0 for lp in gen.logprobs[1:])


def test_logprobs_under_a_grammar_are_those_of_the_masked_logits(engine, compiler, tokenizer, hf):
    """vLLM applies the bitmask before its sampler computes raw logprobs: disallowed tokens are -inf and the
    allowed ones renormalised (the top list can hold -inf entries when fewer than k tokens are allowed)."""
    prompt = prompt_ids(tokenizer)
    spec = StructuredOutputSpec.from_params(json=PERSON)
    gen = run(engine, compiler, prompt, spec, max_tokens=120, logprobs=3)
    ref_tokens, ref_lps = hf_reference(hf, compiler, prompt, spec, 120, engine.eos_token_ids)
    check_against(gen, ref_tokens, ref_lps, 3)
    assert any(v == float("-inf") for top in gen.top_logprobs[1:] for _, v in top)  # a forced step (e.g. '"')


def test_speculation_gives_the_same_tokens_and_logprobs(engine, spec_engine, compiler, tokenizer):
    spec = StructuredOutputSpec.from_params(regex=r"(ab ){6}(cd ){6}[a-z]{4}")
    prompt = prompt_ids(tokenizer, "ab ab ab cd cd cd ")
    off = run(engine, compiler, prompt, spec, max_tokens=80, logprobs=4)
    on = run(spec_engine, compiler, prompt, spec, max_tokens=80, logprobs=4, prompt_token_ids=tuple(prompt))
    assert on.spec.accepted_tokens > 0
    assert on.token_ids == off.token_ids
    assert on.logprobs[1:] == pytest.approx(off.logprobs[1:], abs=TOL)
    for a, b in zip(on.top_logprobs[1:], off.top_logprobs[1:]):
        assert [t for t, v in a if v > -1e30] == [t for t, v in b if v > -1e30]


def test_top_logprobs_zero_gives_the_token_logprob_only(engine, tokenizer):
    gen = run(engine, None, prompt_ids(tokenizer), None, max_tokens=6, ignore_eos=True, logprobs=0)
    assert gen.top_logprobs[1:] == [[]] * 5 and all(isinstance(x, float) for x in gen.logprobs[1:])
    assert run(engine, None, prompt_ids(tokenizer), None, max_tokens=3).logprobs is None


def test_pack_unpack_roundtrip_and_order():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 5.0, -1.0, 0.0]])
    rows = unpack(pack(logits, torch.tensor([2, 0]), 3).tolist(), 3)
    lp = logits.log_softmax(-1)
    assert [r.token for r in rows] == [2, 0]
    assert rows[0].logprob == pytest.approx(float(lp[0, 2]))
    assert [t for t, _ in rows[0].top] == [1, 3, 2]
    assert [t for t, _ in rows[1].top] == lp[1].topk(3).indices.tolist()  # ties: topk's own order
    big = torch.zeros(1, 300_000)
    big[0, 262_143] = 9.0
    assert unpack(pack(big, torch.tensor([262_143]), 1).tolist(), 1)[0].top[0][0] == 262_143  # ids stay exact


def test_top_logprobs_bounds():
    SamplingParams(logprobs=MAX_TOP_LOGPROBS)
    for bad in (-1, MAX_TOP_LOGPROBS + 1):
        with pytest.raises(ValueError, match="top_logprobs"):
            SamplingParams(logprobs=bad)
