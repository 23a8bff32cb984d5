"""The decode engine must decode exactly like transformers (float32, greedy), from its own prefill and from
KV injected out of transformers' past_key_values, and honour the sampling options it advertises."""

from __future__ import annotations

import pytest
import torch

from expresslane.engine.decode import DecodeEngine, SamplingParams

from ._models import EOS, VOCAB

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]
N_NEW = 40


def hf_greedy(model, prompt, n):
    """transformers greedy decode without eos stopping; returns (token ids, past_key_values after prompt)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        past = model(ids, use_cache=True).past_key_values
    return out[0, len(prompt):].tolist(), past


def dense_kv(past) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers cache ([1, H, T, D] per layer) -> dense [L, T, H, D] K and V."""
    k = torch.stack([layer.keys[0].transpose(0, 1) for layer in past.layers])
    v = torch.stack([layer.values[0].transpose(0, 1) for layer in past.layers])
    return k.contiguous(), v.contiguous()


@pytest.fixture(scope="module")
def engines(hf_model):
    kind, path, model = hf_model
    return kind, model, DecodeEngine.from_pretrained(path, dtype="float32", device="cpu", max_seq_len=128)


def test_prefill_then_greedy_matches_transformers(engines):
    _, model, engine = engines
    expected, _ = hf_greedy(model, PROMPT, N_NEW)
    assert len(set(expected)) > 10, "degenerate reference: the comparison would be too weak"
    first = int(engine.prefill(PROMPT).argmax())
    gen = engine.generate(first, len(PROMPT), SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    assert list(gen) == expected
    assert gen.finish_reason == "length"
    assert gen.seq_len == len(PROMPT) + N_NEW


def test_injected_transformers_kv_matches_transformers(engines):
    _, model, engine = engines
    expected, past = hf_greedy(model, PROMPT, N_NEW)
    k, v = dense_kv(past)
    assert k.shape == (engine.config.num_layers, len(PROMPT), engine.config.num_kv_heads, engine.config.head_dim)
    engine.prefill([5] * 50)  # dirty the cache so a no-op inject cannot pass
    engine.inject(k, v, len(PROMPT))
    got = list(engine.generate(expected[0], len(PROMPT), SamplingParams(max_tokens=N_NEW, ignore_eos=True)))
    assert got == expected


def test_comparison_detects_a_wrong_kernel(engines):
    """Guard against a vacuous test: perturbing RoPE must change the output."""
    _, model, engine = engines
    expected, _ = hf_greedy(model, PROMPT, N_NEW)
    saved = engine.cos.clone()
    try:
        engine.cos.mul_(0.9)
        first = int(engine.prefill(PROMPT).argmax())
        got = list(engine.generate(first, len(PROMPT), SamplingParams(max_tokens=N_NEW, ignore_eos=True)))
    finally:
        engine.cos.copy_(saved)
    assert got != expected


def _decode(engine, params, first=None):
    logits = engine.prefill(PROMPT)
    first = int(logits.argmax()) if first is None else first
    gen = engine.generate(first, len(PROMPT), params)
    return list(gen), gen.finish_reason


def test_seeded_sampling_is_reproducible(engines):
    _, _, engine = engines
    params = SamplingParams(max_tokens=30, temperature=1.5, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    a, _ = _decode(engine, params)
    b, _ = _decode(engine, params)
    c, _ = _decode(engine, SamplingParams(**{**params.__dict__, "seed": 99}))
    assert a == b
    assert a != c


def test_top_k_one_is_greedy(engines):
    _, _, engine = engines
    greedy, _ = _decode(engine, SamplingParams(max_tokens=20, ignore_eos=True))
    topk1, _ = _decode(engine, SamplingParams(max_tokens=20, temperature=2.0, top_k=1, seed=3, ignore_eos=True))
    assert topk1 == greedy


def test_max_tokens_counts_first_token(engines):
    _, _, engine = engines
    toks, reason = _decode(engine, SamplingParams(max_tokens=1), first=11)
    assert (toks, reason) == ([11], "length")
    toks, reason = _decode(engine, SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(toks) == 5 and reason == "length"


def test_stop_token_ids_and_eos(engines):
    _, _, engine = engines
    greedy, _ = _decode(engine, SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    stop = greedy[6]
    cut = greedy.index(stop)
    toks, reason = _decode(engine, SamplingParams(max_tokens=N_NEW, stop_token_ids=[stop]))
    assert toks == greedy[: cut + 1] and reason == "stop"  # the stop token is included, like vLLM token_ids
    # The prefill's first token may itself be eos: stop at once, unless ignore_eos / min_tokens say otherwise.
    assert _decode(engine, SamplingParams(max_tokens=10), first=EOS) == ([EOS], "stop")
    toks, reason = _decode(engine, SamplingParams(max_tokens=10, ignore_eos=True), first=EOS)
    assert len(toks) == 10 and reason == "length"
    toks, reason = _decode(engine, SamplingParams(max_tokens=10, min_tokens=4, stop_token_ids=[EOS]), first=EOS)
    assert len(toks) >= 4


def test_min_tokens_masks_stop_ids(engines):
    _, _, engine = engines
    greedy, _ = _decode(engine, SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    stop = greedy[3]
    cut = greedy.index(stop)
    toks, reason = _decode(engine, SamplingParams(max_tokens=N_NEW, stop_token_ids=[stop], min_tokens=cut + 3))
    assert stop not in toks[1 : cut + 2]
    assert len(toks) >= cut + 3


def test_presence_penalty_changes_repeats(engines):
    _, _, engine = engines
    greedy, _ = _decode(engine, SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    assert len(set(greedy)) < len(greedy), "reference has no repeats; the penalty test would be vacuous"
    penal, _ = _decode(engine, SamplingParams(max_tokens=N_NEW, ignore_eos=True, presence_penalty=2.0,
                                              repetition_penalty=2.0))
    assert penal != greedy
    assert len(set(penal)) >= len(set(greedy))


def test_max_seq_len_bounds_generation(engines):
    _, _, engine = engines
    engine.prefill(PROMPT)
    small = 128 - len(PROMPT)
    gen = engine.generate(1, len(PROMPT), SamplingParams(max_tokens=1000, ignore_eos=True))
    assert len(list(gen)) == small and gen.finish_reason == "length"


def test_cancel_between_steps(engines):
    _, _, engine = engines
    engine.prefill(PROMPT)
    gen = engine.generate(1, len(PROMPT), SamplingParams(max_tokens=100, ignore_eos=True))
    got = [next(gen) for _ in range(3)]
    gen.cancel()
    got += list(gen)
    assert len(got) == 3 and gen.finish_reason == "abort"


def test_bad_inputs_are_rejected(engines):
    _, _, engine = engines
    engine.prefill(PROMPT)
    with pytest.raises(ValueError, match="first_token_id"):
        engine.generate(VOCAB, len(PROMPT), SamplingParams())
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        engine.generate(1, len(PROMPT) + 1, SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    g = engine.config
    with pytest.raises(ValueError, match="shape"):
        engine.inject(torch.zeros(g.num_layers, 4, g.num_kv_heads + 1, g.head_dim),
                      torch.zeros(g.num_layers, 4, g.num_kv_heads, g.head_dim), 4)


def test_capabilities(engines):
    _, _, engine = engines
    caps = engine.capabilities()
    for option in ("temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "max_tokens"):
        assert option in caps["sampling"]
    assert caps["max_seq_len"] == 128
