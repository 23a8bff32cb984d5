"""logprobs.py against vLLM 0.32's own code (dev venv): token strings as its output processor decodes them, and the
chat / completions logprobs objects its serving layer builds from the same per-position data."""

from __future__ import annotations

import functools
import json
import random
import types

import pytest

from expresslane.router.openai.detokenizer import load_model_text
from expresslane.router.openai.logprobs import (TokenStrings, chat_logprobs, completion_logprobs, from_node, from_prefill,
                                         wanted_k)

vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this environment (the reference)")


@pytest.fixture(scope="module")
def toks(tiny_model_dir):
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(tiny_model_dir)), TokenStrings(load_model_text(tiny_model_dir).tokenizer)


def _vllm_decode(hf, ids, context):
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.v1.engine.logprobs import LogprobsProcessor

    fake = types.SimpleNamespace(tokenizer=hf)
    fake._correct_decoded_token = functools.partial(LogprobsProcessor._correct_decoded_token, fake)
    return LogprobsProcessor._verify_tokens(fake, convert_ids_list_to_tokens(hf, ids), ids, context)


def _corpus(hf):
    rng = random.Random(0)
    texts = ["hello world", "Zürich café ñ", "日本語のテキスト", "emoji 🦙🚀 ok", "tabs\tand\nnewlines  x"]
    seqs = [hf.encode(t, add_special_tokens=False) for t in texts]
    seqs.append([rng.randrange(hf.vocab_size) for _ in range(64)])
    return seqs


def test_token_strings_match_vllm_for_every_vocab_id_and_split_characters(toks):
    hf, mine = toks
    for tid in range(hf.vocab_size):
        assert mine.one(tid, []) == _vllm_decode(hf, [tid], [])[0], tid
    for seq in _corpus(hf):
        for i, tid in enumerate(seq):
            ctx = seq[max(0, i - 4):i]
            assert mine.one(tid, ctx) == _vllm_decode(hf, [tid], ctx)[0], (seq, i)


def _positions(hf, seq, k, rng):
    """Per position: the sampled id + logprob and a top-k ([id, logprob] desc), sometimes without the sampled id."""
    out = []
    for i, tid in enumerate(seq):
        alts = rng.sample(range(hf.vocab_size), k + 1)
        vals = sorted((-rng.random() * 10 for _ in alts), reverse=True)
        top = [[a, v] for a, v in zip(alts, vals)][:k]
        if i % 2 == 0 and k:  # greedy-like: the sampled token is the top-1
            top = [[tid, vals[0]]] + [t for t in top if t[0] != tid][:k - 1]
        lp = top[0][1] if top and top[0][0] == tid else -12.5 - i
        out.append((tid, lp, top))
    return out


def _vllm_logprobs(hf, seq, raw, flat):
    from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs

    store = create_sample_logprobs(flat)
    for i, (tid, lp, top) in enumerate(raw):
        ids = [tid] + [t[0] for t in top]
        vals = [lp] + [t[1] for t in top]
        decoded = _vllm_decode(hf, ids, seq[max(0, i - 4):i])
        rank = next((r + 1 for r, t in enumerate(top) if t[0] == tid), len(top) + 1)
        append_logprobs_for_next_position(store, ids, vals, decoded, rank, len(top))
    return store


def _serving(cls, as_ids):
    fake = types.SimpleNamespace(return_tokens_as_token_ids=as_ids, _get_decoded_token=cls._get_decoded_token)
    if hasattr(cls, "_get_top_logprobs"):
        fake._get_top_logprobs = functools.partial(cls._get_top_logprobs, fake)
    return fake


@pytest.mark.parametrize("k", [0, 1, 3, 5])
@pytest.mark.parametrize("as_ids", [False, True])
@pytest.mark.parametrize("flat", [False, True])
def test_chat_and_completion_shapes_match_vllm(toks, k, as_ids, flat):
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    hf, mine = toks
    rng = random.Random(k)
    for seq in _corpus(hf):
        raw = _positions(hf, seq, max(k, 1), rng)
        store = _vllm_logprobs(hf, seq, raw, flat)
        positions = [from_node(tid, lp, top) for tid, lp, top in raw]
        fake = _serving(OpenAIServingChat, as_ids)
        want = OpenAIServingChat._create_chat_logprobs(fake, seq, store, hf, num_output_top_logprobs=k)
        got = chat_logprobs(positions, seq, 0, k, mine, as_ids=as_ids)
        assert got == json.loads(want.model_dump_json()), seq
        # split in two chunks: the same entries (text_offset continues)
        fake = _serving(OpenAIServingCompletion, as_ids)
        want_c = OpenAIServingCompletion._create_completion_logprobs(fake, seq, store, k, hf)
        got_c = completion_logprobs(positions, seq, 0, k, mine, as_ids=as_ids)
        assert got_c == json.loads(want_c.model_dump_json()), seq


def test_first_token_from_the_prefill_reply_placeholders_decoded(toks):
    hf, mine = toks
    tid = hf.encode("hello", add_special_tokens=False)[0]
    chat_reply = {"choices": [{"logprobs": {"content": [{
        "token": f"token_id:{tid}", "logprob": -0.5, "bytes": [1],
        "top_logprobs": [{"token": f"token_id:{tid}", "logprob": -0.5}, {"token": "token_id:7", "logprob": -2.0}]}]}}]}
    pos = from_prefill(chat_reply, tid, chat=True)
    out = chat_logprobs([pos], [tid], 0, 2, mine, as_ids=False)["content"][0]
    assert out["token"] == mine.one(tid, []) and out["top_logprobs"][1]["token"] == mine.one(7, [])
    assert chat_logprobs([pos], [tid], 0, 2, mine, as_ids=True)["content"][0]["token"] == f"token_id:{tid}"
    comp_reply = {"choices": [{"logprobs": {"tokens": ["hel"], "token_logprobs": [-0.25],
                                            "top_logprobs": [{"hel": -0.25, "x": -3.0}], "text_offset": [0]}}]}
    pos = from_prefill(comp_reply, tid, chat=False)
    assert completion_logprobs([pos], [tid], 0, 1, mine, as_ids=False) == {
        "tokens": ["hel"], "token_logprobs": [-0.25], "top_logprobs": [{"hel": -0.25, "x": -3.0}], "text_offset": [0]}


def test_wanted_k():
    assert wanted_k({"logprobs": True, "top_logprobs": 3}, True) == 3
    assert wanted_k({"logprobs": True}, True) == 0
    assert wanted_k({"logprobs": False, "top_logprobs": 3}, True) is None
    assert wanted_k({"logprobs": 0}, False) == 0 and wanted_k({}, False) is None
