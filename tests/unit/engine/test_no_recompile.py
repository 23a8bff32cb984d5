"""The compiled CPU step compiles at warmup only: a long greedy stream with speculation (plain steps and verify
steps of every row count, drafts kept and rejected, growing lengths) must not compile anything after
`warmup()`. Seen before the fix: the first verify steps of a stream recompiled mid-stream (dynamo guards on a
tensor's dispatch keys, and the warmup's rows were a slice of a tensor made outside inference mode): a 17 s
gap at token 151 on the 2-CPU stack, past the router's stall timeout. Counted with dynamo's own counters
(`torch._dynamo.utils.counters`: frames compiled, graphs built), so a recompile of any cause fails here.

One architecture (compiling costs tens of seconds of CPU); the eager tests cover all three."""

from __future__ import annotations

import pytest
import torch

from expresslane.engine.decode import DecodeEngine, SamplingParams

from .test_engine_vs_transformers import hf_greedy
from .test_speculative import LOOP_PROMPT


def _compiles() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"], counters["stats"]["unique_graphs"]


def test_no_compile_after_warmup(hf_model):
    kind, path, model = hf_model
    if kind != "llama":
        pytest.skip("one architecture is enough for the compiled path")
    torch._dynamo.reset()
    try:
        engine = DecodeEngine.from_pretrained(path, max_seq_len=256, compile=True)
        engine.warmup()
        before = _compiles()
        assert before[0] > 0, "warmup compiled nothing: the step is not compiled, the test would prove nothing"
        prompt = LOOP_PROMPT[:13]
        expected, _ = hf_greedy(model, prompt, 120)
        # Lookup context = the answer with holes: verify steps keep all, some or none of their drafts, so
        # the adaptive k visits every row count 2 .. k + 1, and pauses give plain steps in between.
        lookup = list(prompt + expected)
        for i in range(20, len(lookup), 17):
            lookup[i] = (lookup[i] + 1) % engine.vocab_size
        rows_seen = set()
        forward = engine.runner.forward

        def counting_forward(tokens, start_pos):
            rows_seen.add(len(tokens))
            return forward(tokens, start_pos)

        engine.runner.forward = counting_forward
        greedy_step = engine.runner.greedy_step  # plain steps run on the greedy chain (decode/chain.py)

        def counting_greedy_step(start_pos):
            rows_seen.add(1)
            return greedy_step(start_pos)

        engine.runner.greedy_step = counting_greedy_step
        first = int(engine.prefill(prompt).argmax())
        gen = engine.generate(first, len(prompt), SamplingParams(max_tokens=120, ignore_eos=True,
                                                                 prompt_token_ids=lookup))
        got = list(gen)
        after = _compiles()
        assert got == expected
        assert 1 in rows_seen and len(rows_seen - {1}) >= 2, f"the stream did not exercise plain and verify rows: {sorted(rows_seen)}"
        assert after == before, (f"compiled after warmup: frames/graphs {before} -> {after} "
                                 f"(rows {sorted(rows_seen)}, {gen.spec.as_dict()})")
    finally:
        torch._dynamo.reset()
