"""The decode step replayed as one CUDA graph must give exactly the tokens of the same step run eagerly, from
the engine's own prefill, from injected KV, across requests of different lengths (one graph serves every
position) and with seeded sampling. The GPU tests run where CUDA is present (the GPU check: scripts/gpu_check.py
tests); the option's validation runs everywhere."""

from __future__ import annotations

import pytest
import torch

from expresslane.engine.decode import DecodeEngine, SamplingParams

from .test_engine_vs_transformers import N_NEW, PROMPT, dense_kv, hf_greedy

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_graph_is_off_on_cpu_and_refused_there(hf_model):
    _, path, _ = hf_model
    assert DecodeEngine.from_pretrained(path, device="cpu", max_seq_len=64).cuda_graph is False
    with pytest.raises(ValueError, match="cuda_graph needs device cuda"):
        DecodeEngine.from_pretrained(path, device="cpu", max_seq_len=64, cuda_graph=True)


def test_server_flag_validation():
    from expresslane.engine.server.config import parse_args  # the server package needs fastapi; import late

    assert parse_args(["--model", "m"]).cuda_graph is None
    assert parse_args(["--model", "m", "--device", "cuda", "--cuda-graph", "on"]).cuda_graph is True
    assert parse_args(["--model", "m", "--device", "cuda", "--cuda-graph", "off"]).cuda_graph is False
    for bad in (["--cuda-graph", "on"], ["--device", "cuda", "--attention", "sliced", "--cuda-graph", "on"]):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", *bad])


@pytest.fixture(scope="module")
def gpu_engines(hf_model):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kind, path, model = hf_model
    graph = DecodeEngine.from_pretrained(path, dtype="float32", device="cuda", max_seq_len=128)
    eager = DecodeEngine.from_pretrained(path, dtype="float32", device="cuda", max_seq_len=128, cuda_graph=False)
    assert graph.cuda_graph and not eager.cuda_graph
    return model, graph, eager


def _greedy(engine: DecodeEngine, prompt: list[int], n: int) -> list[int]:
    first = int(engine.prefill(prompt).argmax())
    return list(engine.generate(first, len(prompt), SamplingParams(max_tokens=n, ignore_eos=True)))


@cuda
def test_graph_replay_matches_eager_and_transformers(gpu_engines):
    model, graph, eager = gpu_engines
    expected, _ = hf_greedy(model, PROMPT, N_NEW)
    assert _greedy(graph, PROMPT, N_NEW) == _greedy(eager, PROMPT, N_NEW) == expected
    assert graph.runner._graphs, "the graph path did not run"


@cuda
def test_one_graph_serves_every_length(gpu_engines):
    _, graph, eager = gpu_engines
    for prompt in ([9], PROMPT * 3, list(range(40, 97))):
        assert _greedy(graph, prompt, 25) == _greedy(eager, prompt, 25)


@cuda
def test_graph_after_injected_kv(gpu_engines):
    model, graph, _ = gpu_engines
    expected, past = hf_greedy(model, PROMPT, N_NEW)
    k, v = dense_kv(past)
    graph.prefill([5] * 50)  # dirty the cache so a no-op inject cannot pass
    graph.inject(k.cuda(), v.cuda(), len(PROMPT))
    got = list(graph.generate(expected[0], len(PROMPT), SamplingParams(max_tokens=N_NEW, ignore_eos=True)))
    assert got == expected


@cuda
def test_seeded_sampling_matches_eager(gpu_engines):
    _, graph, eager = gpu_engines
    params = dict(max_tokens=30, temperature=0.9, top_p=0.9, top_k=20, seed=1234, ignore_eos=True)
    runs = []
    for engine in (graph, eager):
        first = int(engine.prefill(PROMPT).argmax())
        runs.append(list(engine.generate(first, len(PROMPT), SamplingParams(**params))))
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 5
