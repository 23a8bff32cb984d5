"""Native lane against fake vLLM upstreams: exact prefill/decode bodies, relay, ids/usage, error mapping."""

from __future__ import annotations

import httpx
import pytest

from ._kit import NATIVE, PREFILL, make_config, parse_sse, sse_bytes

KVP = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [1, 2], "remote_host": "p",
       "remote_port": 5600}


def prefill_reply(request, body):
    return httpx.Response(200, json={
        "id": "cmpl-prefill", "object": "text_completion", "model": "served",
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}, "kv_transfer_params": KVP})


def decode_reply(request, body):
    if body.get("stream"):
        chunks = [
            {"id": "cmpl-decode", "object": "text_completion", "model": "served",
             "choices": [{"index": 0, "text": "Hel", "logprobs": None, "finish_reason": None}]},
            {"id": "cmpl-decode", "object": "text_completion", "model": "served",
             "choices": [{"index": 0, "text": "lo", "logprobs": None, "finish_reason": "length"}]},
            {"id": "cmpl-decode", "object": "text_completion", "model": "served", "choices": [],
             "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}},
            "[DONE]",
        ]
        return httpx.Response(200, content=sse_bytes(*chunks), headers={"content-type": "text/event-stream"})
    return httpx.Response(200, json={
        "id": "cmpl-decode", "object": "text_completion", "model": "served",
        "choices": [{"index": 0, "text": "Hello", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9, "prompt_tokens_details": None},
        "kv_transfer_params": None})


@pytest.fixture
def vllm(upstreams):
    upstreams.on(PREFILL, "/v1/completions", prefill_reply)
    upstreams.on(NATIVE, "/v1/completions", decode_reply)
    upstreams.on(PREFILL, "/v1/chat/completions", prefill_reply)
    upstreams.on(NATIVE, "/v1/chat/completions", decode_reply)
    return upstreams


CLIENT = {"model": "tiny", "prompt": "hi there", "max_tokens": 2, "temperature": 0, "stop": ["\n"],
          "stream_options": None}


async def test_non_stream_sends_exact_prefill_and_decode_bodies(make_client, vllm):
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json=CLIENT)
    assert r.status_code == 200, r.text
    assert vllm.bodies(PREFILL, "/v1/completions") == [{
        "model": "served", "prompt": "hi there", "max_tokens": 1, "temperature": 0, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True}}]
    assert vllm.bodies(NATIVE, "/v1/completions") == [{
        "model": "served", "prompt": "hi there", "max_tokens": 2, "temperature": 0, "stop": ["\n"],
        "stream_options": None, "kv_transfer_params": KVP}]
    out = r.json()
    assert out["id"] == "cmpl-decode" and out["model"] == "tiny" and out["choices"][0]["text"] == "Hello"
    assert out["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                            "prompt_tokens_details": None}
    assert out["kv_transfer_params"] is None


async def test_prompt_tokens_come_from_the_prefill(make_client, vllm):
    def prefill_says_11(request, body):
        r = prefill_reply(request, body)
        data = r.json()
        data["usage"]["prompt_tokens"] = 11
        return httpx.Response(200, json=data)

    vllm.on(PREFILL, "/v1/completions", prefill_says_11)
    async with make_client() as (client, _):
        out = (await client.post("/v1/completions", json=CLIENT)).json()
    assert out["usage"]["prompt_tokens"] == 11 and out["usage"]["total_tokens"] == 13


async def test_stream_relays_sse_with_alias_and_drops_usage_unless_asked(make_client, vllm):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True}
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(r.text)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert [c["choices"][0]["text"] for c in chunks] == ["Hel", "lo"]
        assert all(c["model"] == "tiny" and "usage" not in c for c in chunks)
        # The decode leg was asked for usage anyway (for the token counter).
        assert vllm.bodies(NATIVE, "/v1/completions")[0]["stream_options"] == {"include_usage": True}
        r = await client.post("/v1/completions", json=dict(body, stream_options={"include_usage": True}))
        events = parse_sse(r.text)
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 2
        assert events[-2]["model"] == "tiny"
        metrics = (await client.get("/metrics")).text
    assert 'expresslane_router_generated_tokens_total{lane="native"} 4.0' in metrics
    assert 'expresslane_router_requests_total{alias="tiny",lane="native",status="200"} 2.0' in metrics


async def test_chat_goes_to_the_chat_endpoints(make_client, vllm):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with make_client() as (client, _):
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert [p for (_, p, _) in vllm.calls] == ["/v1/chat/completions", "/v1/chat/completions"]
    assert vllm.bodies(PREFILL, "/v1/chat/completions")[0]["messages"] == body["messages"]


async def test_vllm_4xx_reaches_the_client_unchanged(make_client, vllm):
    raw = (b'{"error": {"message": "This model\'s maximum context length is 64 tokens", '
           b'"type": "BadRequestError", "param": null, "code": 400}}')
    vllm.on(PREFILL, "/v1/completions", lambda rq, b: httpx.Response(400, content=raw,
                                                                    headers={"content-type": "application/json"}))
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json=CLIENT)
    assert r.status_code == 400 and r.content == raw
    assert vllm.bodies(NATIVE, "/v1/completions") == []


async def test_decode_4xx_also_passes_through(make_client, vllm):
    vllm.on(NATIVE, "/v1/completions", lambda rq, b: httpx.Response(422, json={"error": {"message": "nope"}}))
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json=CLIENT)
    assert r.status_code == 422 and r.json() == {"error": {"message": "nope"}}


@pytest.mark.parametrize(
    "exc,status,err_type",
    [
        (httpx.ConnectError("refused"), 503, "service_unavailable"),
        (httpx.ReadTimeout("slow"), 504, "timeout"),
        (httpx.RemoteProtocolError("garbage"), 502, "upstream_error"),
    ],
)
async def test_transport_failures_map_to_502_503_504(make_client, vllm, exc, status, err_type):
    def boom(request, body):
        raise exc

    vllm.on(PREFILL, "/v1/completions", boom)
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json=CLIENT)
        metrics = (await client.get("/metrics")).text
    assert r.status_code == status
    err = r.json()["error"]
    assert err["type"] == err_type and "prefill" in err["message"] and "Traceback" not in r.text
    assert 'expresslane_router_upstream_errors_total{lane="native",stage="prefill"' in metrics


@pytest.mark.parametrize("status,want", [(500, 502), (503, 503), (200, 502)])
async def test_bad_upstream_replies(make_client, vllm, status, want):
    vllm.on(PREFILL, "/v1/completions", lambda rq, b: httpx.Response(status, content=b"<html>oops</html>"))
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json=CLIENT)
    assert r.status_code == want and r.json()["error"]["message"]


async def test_prefill_without_kv_transfer_params_is_a_clear_502(make_client, vllm):
    vllm.on(PREFILL, "/v1/completions", lambda rq, b: httpx.Response(200, json={"id": "x", "choices": [{}],
                                                                               "usage": {"prompt_tokens": 1}}))
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json=CLIENT)
    assert r.status_code == 502 and "kv_transfer_params" in r.json()["error"]["message"]


async def test_least_outstanding_node_is_picked(make_client, upstreams):
    import asyncio

    cfg = make_config(pools={"native": {"kind": "native", "nodes": [NATIVE, "http://native2:8100"]}},
                      aliases={"tiny": {"pool": "native"}})
    cfg = cfg.model_copy(update={"tokenizer_dir": None})
    release = asyncio.Event()

    async def slow_decode(request, body):
        await release.wait()
        return decode_reply(request, body)

    upstreams.on(PREFILL, "/v1/completions", prefill_reply)
    upstreams.on(NATIVE, "/v1/completions", slow_decode)
    upstreams.on("http://native2:8100", "/v1/completions", slow_decode)
    async with make_client(cfg) as (client, _):
        tasks = [asyncio.ensure_future(client.post("/v1/completions", json=CLIENT)) for _ in range(4)]
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len([c for c in upstreams.calls if c[0] != PREFILL]) == 4:
                break
        release.set()
        assert all(r.status_code == 200 for r in await asyncio.gather(*tasks))
    hits = [c[0] for c in upstreams.calls if c[0] != PREFILL]
    assert sorted(hits) == sorted([NATIVE, NATIVE, "http://native2:8100", "http://native2:8100"])


async def test_models_lists_aliases_with_lanes_and_health_is_open(make_client):
    async with make_client() as (client, _):
        models = (await client.get("/v1/models")).json()
        health = await client.get("/health")
    assert {m["id"]: m["lane"] for m in models["data"]} == {"tiny": "native", "tiny-x": "express",
                                                            "tiny-xs": "express"}
    assert health.status_code == 200 and health.json()["status"] == "ok"


async def test_unknown_model_and_bad_json_are_openai_errors(make_client, vllm):
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "model_not_found"
        r = await client.post("/v1/chat/completions", content=b"{bad", headers={"content-type": "application/json"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert vllm.calls == []


async def test_metrics_show_zeros_for_configured_pools_before_any_request(make_client):
    async with make_client() as (client, _):
        text = (await client.get("/metrics")).text
    for line in [
        'expresslane_router_queue_depth{pool="express"} 0.0',
        'expresslane_router_inflight_requests{node="native:8100",pool="native"} 0.0',
        'expresslane_router_inflight_requests{node="express:5557",pool="express"} 0.0',
        'expresslane_router_rejected_total{pool="express",reason="queue_full"} 0.0',
        'expresslane_router_spillover_total{from_pool="express",to_pool="native"} 0.0',
        'expresslane_router_generated_tokens_total{lane="express"} 0.0',
        'expresslane_router_time_to_first_token_seconds_count{lane="express"} 0.0',
        'expresslane_router_requests_total{alias="tiny-x",lane="express",status="200"} 0.0',
    ]:
        assert line in text, line
