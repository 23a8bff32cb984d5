"""Prefill-leg body rewriting, first-token/rid extraction, lane selection, request validation, SSE framing."""

from __future__ import annotations

import json

import pytest

from expresslane.router.app import resolve_lane
from expresslane.router.errors import BadRequest, ModelNotFound, UpstreamError
from expresslane.router.openai.shapes import iter_sse_data, parse_request, sse
from expresslane.router.lanes.prefill import (derive_tilert_rid, express_prefill_body, first_token_id, native_prefill_body,
                                        prompt_token_ids, prompt_tokens)

from ._kit import config_dict, make_config
from expresslane.router.config import parse_config

CLIENT_BODY = {
    "model": "tiny", "prompt": "hi", "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
    "stream_options": {"include_usage": True}, "stop": ["\n"], "include_stop_str_in_output": True,
    "min_tokens": 3, "logprobs": 2, "prompt_logprobs": 1, "echo": True, "temperature": 0.5, "seed": 7,
    "ignore_eos": True, "stop_token_ids": [5], "kv_transfer_params": {"evil": 1}, "return_token_ids": True,
}


def test_native_prefill_body_is_a_one_token_non_streaming_remote_decode_request():
    assert native_prefill_body(CLIENT_BODY, "served") == {
        "model": "served", "prompt": "hi", "max_tokens": 1, "stream": False, "temperature": 0.5, "seed": 7,
        "ignore_eos": True, "stop_token_ids": [5], "kv_transfer_params": {"do_remote_decode": True},
    }


def test_express_prefill_body_asks_for_token_ids_and_logprobs_and_carries_the_marker():
    marker = {"expresslane_host": "h", "expresslane_ctrl_port": 1, "expresslane_rid": "r"}
    body = express_prefill_body(CLIENT_BODY, "served", chat=False, kv_transfer_params=marker)
    assert body == {
        "model": "served", "prompt": "hi", "max_tokens": 1, "stream": False, "temperature": 0.5, "seed": 7,
        "ignore_eos": True, "stop_token_ids": [5], "min_tokens": 1, "logprobs": 2, "return_token_ids": True,
        "kv_transfer_params": marker,
    }  # the client's k: the first token's logprobs entry is taken from this reply
    chat = express_prefill_body({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "served", chat=True,
                                kv_transfer_params=marker)
    assert (chat["logprobs"], chat["top_logprobs"], "min_tokens" in chat) == (True, 1, False)
    msgs = [{"role": "user", "content": "x"}]
    for client, want in [({"logprobs": True}, (True, 1)), ({"logprobs": True, "top_logprobs": 5}, (True, 5)),
                         ({"logprobs": True, "top_logprobs": 50}, (True, 50)),  # vLLM's own 400 (max 20)
                         ({"top_logprobs": 3}, (None, 3))]:  # without logprobs: vLLM's own 400
        b = express_prefill_body({"model": "m", "messages": msgs, **client}, "s", chat=True, kv_transfer_params={})
        assert (b.get("logprobs"), b["top_logprobs"]) == want, client
    for client, want in [({"logprobs": 0}, 1), ({"logprobs": 3}, 3), ({"logprobs": 21}, 21)]:
        b = express_prefill_body({"model": "m", "prompt": "x", **client}, "s", chat=False, kv_transfer_params={})
        assert b["logprobs"] == want


def test_client_body_is_not_mutated_by_rewriting():
    before = json.dumps(CLIENT_BODY, sort_keys=True)
    native_prefill_body(CLIENT_BODY, "s")
    express_prefill_body(CLIENT_BODY, "s", chat=False, kv_transfer_params={})
    assert json.dumps(CLIENT_BODY, sort_keys=True) == before


def test_first_token_id_prefers_token_ids_then_logprobs():
    assert first_token_id({"choices": [{"token_ids": [42], "logprobs": {"tokens": ["token_id:7"]}}]}, chat=False) == 42
    assert first_token_id({"choices": [{"logprobs": {"tokens": ["token_id:7"]}}]}, chat=False) == 7
    assert first_token_id({"choices": [{"logprobs": {"content": [{"token": "token_id:9"}]}}]}, chat=True) == 9
    with pytest.raises(UpstreamError, match="return-tokens-as-token-ids"):
        first_token_id({"choices": [{"logprobs": {"tokens": ["hello"]}}]}, chat=False)
    with pytest.raises(UpstreamError, match="no choices"):
        first_token_id({"choices": []}, chat=False)


def test_prompt_ids_and_count_from_chat_and_completion_replies():
    assert prompt_token_ids({"prompt_token_ids": [1, 2], "choices": [{}]}) == [1, 2]
    assert prompt_token_ids({"choices": [{"prompt_token_ids": [3]}]}) == [3]
    assert prompt_tokens({"usage": {"prompt_tokens": 11}, "choices": [{}]}) == 11
    assert prompt_tokens({"choices": [{"prompt_token_ids": [3, 4]}]}) == 2


@pytest.mark.parametrize(
    "rid,want",
    [
        ("chatcmpl-abc123-0-1a2b3c4d", "abc123"),
        ("cmpl-5f1e2d3c4b5a69788796a5b4c3d2e1f0-0-deadbeef", "5f1e2d3c4b5a69788796a5b4c3d2e1f0"),
        ("cmpl-abc-deadbeef", "abc"),
        ("cmpl-abc-12", "abc"),
        ("cmpl-abc-1234", "abc"),  # "1234" is also hex (<= 8 chars): the first rule strips it
        ("plain", "plain"),
        ("chatcmpl-x-notahexsuffix", "x-notahexsuffix"),
    ],
)
def test_tilert_rid_rule(rid, want):
    assert derive_tilert_rid(rid) == want


def test_lane_comes_from_the_alias_and_x_lane_overrides_it():
    cfg = make_config()
    assert resolve_lane(cfg, "tiny", None) == ("native", "native")
    assert resolve_lane(cfg, "tiny-x", None) == ("express", "express")
    assert resolve_lane(cfg, "tiny", "express") == ("express", "express")
    assert resolve_lane(cfg, "tiny-x", " Native ") == ("native", "native")
    assert resolve_lane(cfg, "tiny-x", "express") == ("express", "express")
    with pytest.raises(BadRequest, match="X-Lane"):
        resolve_lane(cfg, "tiny", "fast")
    with pytest.raises(ModelNotFound, match="nope"):
        resolve_lane(cfg, "nope", None)


def test_x_lane_to_a_lane_without_a_pool_is_a_400():
    d = config_dict()
    del d["pools"]["express"]
    d["aliases"] = {"tiny": {"pool": "native"}}
    d.pop("tokenizer_dir")
    with pytest.raises(BadRequest, match="no express pool"):
        resolve_lane(parse_config(d), "tiny", "express")


@pytest.mark.parametrize(
    "raw,kind,needle",
    [
        (b"{nope", "completion", "json"),
        (b"[1]", "completion", "object"),
        (b'{"prompt": "x"}', "completion", "model"),
        (b'{"model": "m", "prompt": "x", "max_tokens": "many"}', "completion", "max_tokens"),
        (b'{"model": "m", "prompt": "x", "max_tokens": 0}', "completion", "max_tokens"),
        (b'{"model": "m", "prompt": "x", "max_tokens": true}', "completion", "max_tokens"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}', "chat",
         "max_tokens must be at least 1, got -1."),  # vLLM's words (SamplingParams)
        (b'{"model": "m", "prompt": "x", "n": 2}', "completion", "'n'"),
        (b'{"model": "m", "prompt": "x", "stream": "yes"}', "completion", "stream"),
        (b'{"model": "m", "prompt": "x", "stop": [1]}', "completion", "stop"),
        (b'{"model": "m", "prompt": ["a", "b"]}', "completion", "prompt"),
        (b'{"model": "m"}', "completion", "prompt"),
        (b'{"model": "m", "messages": "not a list"}', "chat", "messages"),
        (b'{"model": "m", "messages": []}', "chat", "messages"),
    ],
)
def test_bad_requests_are_400_with_a_clear_message(raw, kind, needle):
    with pytest.raises(BadRequest) as e:
        parse_request(raw, kind)
    assert needle.lower() in e.value.message.lower()
    vllm_worded = "at least 1" in e.value.message  # the limits vLLM itself words (output_limits.py, errors.py)
    assert e.value.status == 400 and e.value.body()["error"]["type"] == (
        "BadRequestError" if vllm_worded else "invalid_request_error")


def test_parse_request_reads_stream_usage_and_max_tokens():
    r = parse_request(b'{"model": "m", "prompt": [1, 2], "stream": true, "stream_options": {"include_usage": true},'
                      b' "max_completion_tokens": 9}', "completion")
    # completions have no max_completion_tokens field in vLLM (ignored there too): max_tokens' default 16 applies
    assert (r.stream, r.include_usage, r.max_tokens, r.path) == (True, True, 16, "/v1/completions")
    r = parse_request(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5,'
                      b' "max_completion_tokens": 9}', "chat")
    assert r.max_tokens == 9  # chat: max_completion_tokens wins, as in vLLM
    r = parse_request(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": "END"}', "chat")
    assert (r.stream, r.include_usage, r.max_tokens, r.stop_strings()) == (False, False, None, ["END"])


def test_sse_framing_is_data_json_blank_line():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()


async def test_sse_reader_joins_events_and_skips_comments():
    async def lines():
        for ln in [": keepalive", "data: {\"a\": 1}", "", "data:{\"b\": 2}", "", "data: x", "data: y", "",
                   "data: [DONE]", ""]:
            yield ln

    got = [d async for d in iter_sse_data(lines())]
    assert got == ['{"a": 1}', '{"b": 2}', "x\ny", "[DONE]"]


@pytest.mark.parametrize("read_s", [0.25, 5.0, 600.0])
def test_a_legs_timeout_equals_httpxs_own(read_s):
    """LaneContext.timeout sets httpx.Timeout's fields itself (hot path): the result must be httpx's own."""
    import httpx

    from expresslane.router.lanes.base import LaneContext
    from expresslane.router.metrics import RouterMetrics
    from prometheus_client import CollectorRegistry

    cfg = make_config()
    ctx = LaneContext(config=cfg, client=None, metrics=RouterMetrics(cfg, CollectorRegistry()),  # type: ignore[arg-type]
                      clock=lambda: 0.0, calls=object())  # type: ignore[arg-type]
    got = ctx.timeout(read_s)
    want = httpx.Timeout(read_s, connect=cfg.timeouts.connect_s)
    assert isinstance(got, httpx.Timeout) and got == want and got.as_dict() == want.as_dict()
    assert vars(got) == vars(want)
