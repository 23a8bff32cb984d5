"""The FIRST request after a fresh engine equals transformers, in every way a step can run on a GPU.

A fresh engine has captured nothing: its first request is the one that captures graphs lazily, and a capture's
warm-up runs write a K/V row. The express node's real first request arrives by injection (the prefill's KV), so
that is the path taken here, with the engine's own prefill as a second case. Each combination gets its own
fresh engine: eager, graph, compiled graph and lean graph steps; the greedy chain on and off; speculation on
(prompt lookup over a context that holds the answer, so drafts are made and kept) and off.

On the H200 on 2026-12-04 the lean graph with the chain decoded the first request wrong from its second token
on (the greedy graph was captured with the runner's buffers still at the last forward's start and token, and
its warm-ups overwrote row 0 of the prompt); StepRunner.start_greedy now sets the buffers before it captures.
Skipped where there is no CUDA device (CI): the GPU check (scripts/gpu_check.py tests) runs it on a GPU."""

from __future__ import annotations

import itertools

import pytest
import torch

from expresslane.engine.decode import DecodeEngine, SamplingParams
from expresslane.engine.decode.runner import StepMode

from .test_engine_vs_transformers import N_NEW, PROMPT, dense_kv, hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (step mode, engine options). compiled-graph costs torch.compile time per fresh engine: it runs with the
# chain on and off, speculation off and on, for one model kind only (below).
MODES = {
    StepMode.EAGER: dict(cuda_graph=False, attention="split"),
    StepMode.GRAPH: dict(cuda_graph=True, attention="split", lean=False),
    StepMode.COMPILED_GRAPH: dict(cuda_graph=True, attention="split", lean=False, compile=True),
    StepMode.LEAN_GRAPH: dict(cuda_graph=True, attention="split", lean=True),
}
CASES = [(mode, chain, spec, path) for mode, chain, spec, path in
         itertools.product(MODES, (True, False), (False, True), ("inject", "prefill"))
         if mode is not StepMode.COMPILED_GRAPH or path == "inject"]


def _fresh(model_dir, mode: StepMode, chain: bool, spec: bool) -> DecodeEngine:
    kw = dict(MODES[mode])
    if not spec:
        kw["speculation"] = None
    e = DecodeEngine.from_pretrained(model_dir, dtype="float32", device="cuda", max_seq_len=160, **kw)
    e.greedy_chain = chain
    assert e.runner.mode is mode, (e.runner.mode, mode)
    assert not e.runner._graphs, "a fresh engine has captured nothing"
    return e


@pytest.mark.parametrize("mode,chain,spec,path", CASES,
                         ids=[f"{m.value}-chain{int(c)}-spec{int(s)}-{p}" for m, c, s, p in CASES])
def test_the_first_request_of_a_fresh_engine_equals_transformers(hf_model, mode, chain, spec, path):
    kind, model_dir, model = hf_model
    if mode is StepMode.LEAN_GRAPH and kind == "qwen3":
        pytest.skip("the lean step does not cover per-head q/k norms (Qwen3): the runner keeps the PyTorch step")
    if mode is StepMode.COMPILED_GRAPH and kind != "llama":
        pytest.skip("compiled graph: one model kind (torch.compile per fresh engine)")
    expected, past = hf_greedy(model, PROMPT, N_NEW)
    e = _fresh(model_dir, mode, chain, spec)
    if path == "inject":  # the express node's first request: the prefill's KV, then its first token
        k, v = dense_kv(past)
        e.inject(k.cuda(), v.cuda(), len(PROMPT))
        first = expected[0]
    else:
        first = int(e.prefill(PROMPT).argmax())
    lookup = PROMPT + expected  # the context holds the answer: prompt lookup drafts, and its drafts are kept
    gen = e.generate(first, len(PROMPT), SamplingParams(max_tokens=N_NEW, ignore_eos=True,
                                                        prompt_token_ids=lookup if spec else ()))
    got = list(gen)
    assert got == expected, f"first divergence at token {next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)}"
    if spec:
        assert gen.spec.accepted_tokens > 0, gen.spec.as_dict()
    # And the second request of the same engine (graphs now captured) too.
    first = int(e.prefill(PROMPT).argmax())
    assert list(e.generate(first, len(PROMPT), SamplingParams(max_tokens=N_NEW, ignore_eos=True))) == expected
