"""On a GPU: structured output and logprobs through the lean step's CUDA graphs, with and without speculation.

The CPU tests (test_grammar.py, test_logprobs.py) check the mask, the logprobs and speculation under a grammar on
the CPU step. Here the same requests run where a node runs them on a GPU: the lean graph, the row-invariant
verify of up to five rows, in bf16 and in float32. Greedy output under a grammar with speculation on must equal
speculation off on the same engine token for token (each verify row's logits are the one-row step's bits), and
so must the logprobs of those rows; in float32 both equal a transformers reference decoded under an independent
matcher, as does an engine built without speculation. Skipped where
there is no CUDA device (CI)."""

from __future__ import annotations

import json

import pytest
import torch

from expresslane.engine.decode import DecodeEngine
from expresslane.engine.decode.grammar import StructuredOutputSpec
from expresslane.engine.decode.speculative import SpeculationConfig

from .test_grammar_fixtures import (MAX_SEQ, PERSON, compiler, engine, hf, hf_reference, prompt_ids,  # noqa: F401
                                    run, tiny_dir, tokenizer)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

REPEATING = r"(ab ){6}(cd ){6}[a-z]{4}"  # prompt lookup drafts it: some drafts kept, some refused


def _gpu(tiny_dir, dtype: str, k: int | None) -> DecodeEngine:
    e = DecodeEngine.from_pretrained(tiny_dir, device="cuda", dtype=dtype, max_seq_len=MAX_SEQ,
                                     speculation=SpeculationConfig(k=k) if k else None)
    e.warmup()
    return e


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def gpu_pair(request, tiny_dir):
    """(an engine without speculation, one with k = 4) on the GPU in one dtype, both on the lean graph. Their
    one-row steps need not share block shapes (a speculating engine picks among the shapes whose five-row
    kernels do not spill), so bit-for-bit comparisons are made within the speculating engine: a request with
    speculation off (`speculative=False`) against one with it on."""
    off, on = _gpu(tiny_dir, request.param, None), _gpu(tiny_dir, request.param, 4)
    assert off.runner.lean and on.runner.lean and on.runner.max_rows == 5
    return request.param, off, on


def _finite(top):
    """A step's top logprobs without the -inf entries (masked tokens tie there, in any order)."""
    return [(t, v) for t, v in top if v > -1e30]


@pytest.mark.parametrize("what", ["repeating regex", "json schema"])
def test_greedy_under_a_grammar_with_speculation_equals_without(gpu_pair, compiler, tokenizer, what):
    dtype, off, on = gpu_pair
    if what == "repeating regex":
        spec, prompt = StructuredOutputSpec.from_params(regex=REPEATING), prompt_ids(tokenizer, "ab ab ab cd cd cd ")
    else:
        spec, prompt = StructuredOutputSpec.from_params(json=PERSON), prompt_ids(tokenizer)
    a = run(on, compiler, prompt, spec, max_tokens=120, logprobs=3, speculative=False)
    b = run(on, compiler, prompt, spec, max_tokens=120, logprobs=3, prompt_token_ids=tuple(prompt))
    assert a.spec.verify_steps == 0
    assert a.finish_reason == b.finish_reason == "stop", (dtype, what)
    assert b.token_ids == a.token_ids, (dtype, what)
    if what == "repeating regex":
        assert b.spec.verify_steps > 0 and b.spec.accepted_tokens > 0, b.spec.as_dict()
    else:
        text = tokenizer.decode(b.token_ids[:-1])
        assert set(json.loads(text)) == {"name", "age"}, text
    # the kept rows' logits are the one-row step's bits, so their logprobs (float32 log_softmax of the masked
    # logits) are the same numbers; a verify row that differed by one bf16 ulp would move them by ~1e-2
    assert b.logprobs[1:] == pytest.approx(a.logprobs[1:], abs=1e-6), (dtype, what)
    for x, y in zip(b.top_logprobs[1:], a.top_logprobs[1:]):
        x, y = _finite(x), _finite(y)
        assert [t for t, _ in x] == [t for t, _ in y], (dtype, what)
        assert [v for _, v in x] == pytest.approx([v for _, v in y], abs=1e-6), (dtype, what)
    if dtype == "float32":  # the engine without speculation: the same tokens (its own block shapes)
        assert run(off, compiler, prompt, spec, max_tokens=120).token_ids == a.token_ids


def test_float32_under_a_grammar_equals_a_transformers_reference(gpu_pair, compiler, tokenizer, hf):
    dtype, off, on = gpu_pair
    if dtype != "float32":
        pytest.skip("the transformers reference is float32: bf16 is checked against speculation off above")
    prompt = prompt_ids(tokenizer, "The person record is ")
    spec = StructuredOutputSpec.from_params(json=PERSON)
    ref, _ = hf_reference(hf, compiler, prompt, spec, 120, off.eos_token_ids)
    for e in (off, on):
        assert run(e, compiler, prompt, spec, max_tokens=120, prompt_token_ids=tuple(prompt)).token_ids == ref
