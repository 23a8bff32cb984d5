"""The greedy chain (decode/chain.py) gives the per-token loop's tokens, stop reasons and cache state.

Plain greedy requests run through GreedyChain: step n + 1 is submitted before step n's token is read. These
tests run it against the same engine with `greedy_chain = False` (the per-token loop) and against transformers,
through every way a stream ends (stop token, max_tokens, max_seq_len, cancel), and check that the step the chain
queued past the end leaves nothing behind for the next request. On a CUDA device the same tests run the chain's
CUDA graph (and the lean step where it applies)."""

from __future__ import annotations

import threading

import pytest
import torch

from expresslane.engine.decode import DecodeEngine, SamplingParams
from expresslane.engine.decode.grammar import RequestGrammar  # noqa: F401  (the non-chained kinds below)
from expresslane.engine.decode.sampling import Sampler

from ._models import EOS
from .test_engine_vs_transformers import hf_greedy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]
MAX_SEQ = 96


@pytest.fixture(scope="module")
def engine(hf_model):
    kind, path, model = hf_model
    kw = dict(attention="split") if DEVICE == "cuda" else {}
    e = DecodeEngine.from_pretrained(path, dtype="float32", device=DEVICE, max_seq_len=MAX_SEQ, speculation=None,
                                     **kw)
    return model, e


def _run(engine: DecodeEngine, prompt, chain: bool, cancel_after: int | None = None, **params):
    engine.greedy_chain = chain
    try:
        first = int(engine.prefill(prompt).argmax())
        cancel = threading.Event()
        gen = engine.generate(first, len(prompt), SamplingParams(**params), cancel_event=cancel)
        out = []
        for tok in gen:
            out.append(tok)
            if cancel_after is not None and len(out) == cancel_after:
                cancel.set()
        return out, gen.finish_reason, engine.cached_tokens, gen.spec.plain_steps
    finally:
        engine.greedy_chain = True


def test_chain_equals_the_token_loop_and_transformers(engine):
    model, e = engine
    expected, _ = hf_greedy(model, PROMPT, 40)
    chained = _run(e, PROMPT, True, max_tokens=40, ignore_eos=True)
    loop = _run(e, PROMPT, False, max_tokens=40, ignore_eos=True)
    assert chained == loop
    assert chained[0] == expected and chained[1] == "length" and e._chain.submitted == 39
    assert chained[2] == len(PROMPT) + 39 and chained[3] == 39  # 39 steps for 40 tokens, the last not cached


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_the_shortest_budgets(engine, max_tokens):
    _, e = engine
    assert _run(e, PROMPT, True, max_tokens=max_tokens, ignore_eos=True) == \
        _run(e, PROMPT, False, max_tokens=max_tokens, ignore_eos=True)


def test_stop_token_ends_the_stream_where_the_loop_does(engine):
    model, e = engine
    expected, _ = hf_greedy(model, PROMPT, 60)
    # Stop on the 8th generated token's id (its first occurrence), whatever the random weights produce.
    stop = expected[7]
    chained = _run(e, PROMPT, True, max_tokens=60, stop_token_ids=[stop], ignore_eos=True)
    assert chained == _run(e, PROMPT, False, max_tokens=60, stop_token_ids=[stop], ignore_eos=True)
    assert chained[1] == "stop" and chained[0][-1] == stop and len(chained[0]) == expected.index(stop) + 1


def test_eos_ends_the_stream(engine):
    _, e = engine
    chained = _run(e, PROMPT, True, max_tokens=80)
    assert chained == _run(e, PROMPT, False, max_tokens=80)
    assert chained[1] == "length" or (chained[1] == "stop" and chained[0][-1] == EOS)


def test_max_seq_len_bounds_the_chain(engine):
    """prompt + output <= max_seq_len: the chain submits no step past the last row."""
    _, e = engine
    prompt = (PROMPT * 8)[:MAX_SEQ - 5]
    chained = _run(e, prompt, True, max_tokens=50, ignore_eos=True)
    assert chained == _run(e, prompt, False, max_tokens=50, ignore_eos=True)
    assert chained[1] == "length" and len(chained[0]) == 5 and chained[2] == MAX_SEQ - 1
    assert e._chain.submitted == 4  # one step per token after the first: none queued past the limit


def test_cancel_stops_between_tokens(engine):
    _, e = engine
    chained = _run(e, PROMPT, True, cancel_after=6, max_tokens=40, ignore_eos=True)
    assert chained == _run(e, PROMPT, False, cancel_after=6, max_tokens=40, ignore_eos=True)
    assert chained[1] == "abort" and len(chained[0]) == 6


def test_the_step_queued_past_a_stop_leaves_nothing_behind(engine):
    """A stream that stopped early (its queued step wrote one row past the live length) is followed by a
    request on a shorter prompt whose rows overlap: its tokens are those of a fresh engine state."""
    model, e = engine
    expected, _ = hf_greedy(model, PROMPT, 60)
    _run(e, PROMPT + PROMPT, True, max_tokens=3, ignore_eos=True)  # rows past len(PROMPT) now hold other K/V
    stop = expected[4]
    assert _run(e, PROMPT, True, max_tokens=60, stop_token_ids=[stop], ignore_eos=True)[0] == \
        expected[:expected.index(stop) + 1]
    assert _run(e, PROMPT, True, max_tokens=30, ignore_eos=True)[0] == expected[:30]


def test_only_plain_greedy_requests_chain() -> None:
    """Everything that changes the token beyond the argmax keeps the per-token loop."""
    def plain(**kw) -> bool:
        return Sampler(SamplingParams(**kw), 64, (EOS,), torch.device("cpu")).plain_greedy

    assert plain() and plain(ignore_eos=True, max_tokens=5, stop_token_ids=[3], min_tokens=1)
    for kw in (dict(temperature=0.7), dict(repetition_penalty=1.1), dict(presence_penalty=0.5),
               dict(frequency_penalty=0.5), dict(min_tokens=3), dict(logit_bias=[(3, 1.0)]),
               dict(allowed_token_ids=[1, 2, 3])):
        assert not plain(**kw), kw
