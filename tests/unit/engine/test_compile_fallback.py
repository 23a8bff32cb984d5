"""--compile on a host where torch.compile cannot build its kernels: the node starts anyway and decodes without
it (warning logged), with the same tokens as an eager engine. The failure is real: inductor is pointed at a C++
compiler that does not exist, with its caches off so nothing compiled earlier can be reused."""

from __future__ import annotations

import logging

import pytest
import torch

from expresslane.engine.decode import DecodeEngine, SamplingParams
from expresslane.engine.server.__main__ import build_engine
from expresslane.engine.server.config import parse_args


def _tokens(engine: DecodeEngine) -> list[int]:
    """Greedy tokens of one request; the node's engine has several seats on a CPU (--seats auto), so it names one."""
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    seat = 0 if engine.seats > 1 else None
    first = int(engine.prefill(prompt).argmax())
    return list(engine.generate(first, len(prompt), SamplingParams(max_tokens=12, ignore_eos=True), seat=seat))


def test_compile_failure_falls_back_to_eager(hf_model, caplog):
    import torch._dynamo
    import torch._inductor.config as inductor_config

    kind, path, _ = hf_model
    if kind != "llama":
        pytest.skip("one architecture is enough for the fallback (it is the same code path for each)")
    torch._dynamo.reset()
    config = parse_args(["--model", str(path), "--max-seq-len", "64", "--compile"])
    no_compiler = {"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False}
    with inductor_config.patch(no_compiler), caplog.at_level(logging.WARNING, logger="expresslane.engine.server"):
        engine = build_engine(config)
    torch._dynamo.reset()
    assert engine.compile is False, "the failed compile must be turned off"
    assert any("torch.compile of the decode step failed" in r.getMessage() for r in caplog.records)
    eager = DecodeEngine.from_pretrained(path, max_seq_len=64)
    assert _tokens(engine) == _tokens(eager)


def test_a_failure_without_compile_still_raises(hf_model, monkeypatch):
    _, path, _ = hf_model
    config = parse_args(["--model", str(path), "--max-seq-len", "64"])
    monkeypatch.setattr(DecodeEngine, "warmup", lambda self, steps=4: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        build_engine(config)
