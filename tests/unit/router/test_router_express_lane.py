"""Express lane against a fake prefill and a fake TileRT-contract node (/pd/decode, /pd/cancel):
exact bodies, detokenized responses (JSON and SSE), node errors, gate/queue policies, cancellation."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from ._kit import EXPRESS, NATIVE, PREFILL, config_dict, make_config, ndjson, parse_config, parse_sse

PROMPT_IDS = [5, 6, 7, 8, 9, 10]
TEXT = " hello world, hello router"


class FakeNode:
    """Prefill + express node. `answer` is the token ids the node generates (first one = prefill's)."""

    def __init__(self, upstreams, tokenizer, *, answer_text: str = TEXT, kind: str = "expresslane"):
        self.up = upstreams
        self.answer = tokenizer.encode(answer_text).ids
        self.kind = kind
        self.decode_statuses: list[int] = []  # statuses to answer /pd/decode with before succeeding
        self.reserve_statuses: list[int] = []  # statuses to answer /pd/reserve with before succeeding
        self.hang_after: int | None = None  # stream: send this many tokens, then hang
        self.hang_non_stream = False  # hang before the first token
        self.die_after: int | None = None  # send this many tokens, then end the stream without a done line
        self.cancelled: list[str] = []
        self.reserved: list[str] = []
        self.finish_reason = "length"
        for path in ("/v1/completions", "/v1/chat/completions"):
            upstreams.on(PREFILL, path, self.prefill)
        upstreams.on(EXPRESS, "/pd/reserve", self.reserve)
        upstreams.on(EXPRESS, "/pd/decode", self.decode)
        upstreams.on(EXPRESS, "/pd/cancel", self.cancel)

    def reserve(self, request, body):
        if self.reserve_statuses:
            status = self.reserve_statuses.pop(0)
            return httpx.Response(status, json={"error": "busy" if status == 429 else "not_ready"})
        self.reserved.append(body["rid"])
        return httpx.Response(200, json={"rid": body["rid"], "reserved": True, "ttl_s": body["ttl_s"]})

    def prefill(self, request, body):
        chat = request.url.path.endswith("chat/completions")
        choice = {"index": 0, "finish_reason": "length", "token_ids": [self.answer[0]]}
        out = {"id": ("chatcmpl-" if chat else "cmpl-") + "abc123-0-1a2b3c4d", "choices": [choice],
               "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": 1,
                         "total_tokens": len(PROMPT_IDS) + 1}}
        if chat:
            out["prompt_token_ids"] = PROMPT_IDS
        else:
            choice["prompt_token_ids"] = PROMPT_IDS
        return httpx.Response(200, json=out)

    async def decode(self, request, body):
        if self.decode_statuses:
            status = self.decode_statuses.pop(0)
            return httpx.Response(status, json={"error": f"fake {status}"})
        ids = self.answer[: body["max_tokens"]]
        assert body["stream"] is True  # the router always streams from the node (bounded waits)
        if self.hang_non_stream:
            await asyncio.Event().wait()

        async def lines():
            for i, t in enumerate(ids):
                if self.hang_after is not None and i >= self.hang_after:
                    await asyncio.Event().wait()
                if self.die_after is not None and i >= self.die_after:
                    return
                yield ndjson({"t": [t]})
            yield ndjson({"done": True, "n": len(ids), "seq_len": 9, "finish_reason": self.finish_reason})

        return httpx.Response(200, content=lines(), headers={"content-type": "application/x-ndjson"})

    def cancel(self, request, body):
        self.cancelled.append(body["rid"])
        return httpx.Response(200, json={"cancelled": body["rid"]})


@pytest.fixture
def node(upstreams, tokenizer):
    return FakeNode(upstreams, tokenizer)


def gate_of(app):
    return app.state.lanes.express.gates["express"]


COMP = {"model": "tiny-x", "prompt": "hi", "max_tokens": 4, "temperature": 0, "seed": 3}


async def test_non_stream_completion_exact_bodies_and_detokenized_text(make_client, node, upstreams, tokenizer):
    async with make_client() as (client, app):
        r = await client.post("/v1/completions", json=COMP)
        assert gate_of(app).busy_count == 0
    assert r.status_code == 200, r.text
    (pre,) = upstreams.bodies(PREFILL, "/v1/completions")
    marker = pre["kv_transfer_params"]
    assert set(marker) == {"expresslane_host", "expresslane_ctrl_port", "expresslane_rid"}
    paths = [p for (_, p, _) in upstreams.calls if p != "/capabilities"]  # capability routing asks the node
    assert paths == ["/pd/reserve", "/v1/completions", "/pd/decode"]  # the node is reserved BEFORE the prefill
    assert upstreams.bodies(EXPRESS, "/pd/reserve") == [{"rid": marker["expresslane_rid"], "ttl_s": 60.0}]
    assert (marker["expresslane_host"], marker["expresslane_ctrl_port"]) == ("10.0.0.9", 5556)
    assert pre == {"model": "served", "prompt": "hi", "max_tokens": 1, "temperature": 0, "seed": 3, "stream": False,
                   "return_token_ids": True, "logprobs": 1, "kv_transfer_params": marker}
    assert upstreams.bodies(EXPRESS, "/pd/decode") == [{
        "rid": marker["expresslane_rid"], "first_token_id": node.answer[0], "max_tokens": 4,
        "sampling": {"temperature": 0, "seed": 3}, "stream": True, "timeout_s": 3.0,
        "prompt_token_ids": PROMPT_IDS}]  # always sent: prompt-lookup speculation drafts from it
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == "tiny-x" and out["id"] == "cmpl-abc123-0-1a2b3c4d"
    assert out["choices"][0]["text"] == tokenizer.decode(node.answer[:4])
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10,
                            "prompt_tokens_details": None, "completion_tokens_details": None}
    assert node.cancelled == []  # the node finished on its own: nothing to cancel


async def test_sampling_defaults_and_max_tokens_default(make_client, node, upstreams):
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json={"model": "tiny-x", "prompt": "hi", "top_k": 5,
                                                       "repetition_penalty": 1.1, "stop_token_ids": [1],
                                                       "min_tokens": 2, "frequency_penalty": 0.5})
    assert r.status_code == 200
    (pre,) = upstreams.bodies(PREFILL, "/v1/completions")
    assert pre["min_tokens"] == 1  # the first token must not be EOS either
    (dec,) = upstreams.bodies(EXPRESS, "/pd/decode")
    assert dec["sampling"] == {"temperature": 0.7, "top_k": 5, "repetition_penalty": 1.1, "stop_token_ids": [1],
                               "min_tokens": 2, "frequency_penalty": 0.5}
    assert dec["prompt_token_ids"] == PROMPT_IDS  # repetition_penalty covers the prompt, like vLLM
    assert dec["max_tokens"] == 16  # vLLM 0.32's completions default (CompletionRequest.max_tokens = 16)
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json={"model": "tiny-x", "prompt": "hi", "max_tokens": None})
        r2 = await client.post("/v1/chat/completions", json={"model": "tiny-x",
                                                             "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200 and r2.status_code == 200
    assert [b["max_tokens"] for b in upstreams.bodies(EXPRESS, "/pd/decode")[1:]] == [64 - len(PROMPT_IDS)] * 2


async def test_stream_chat_is_shaped_like_vllm(make_client, node, tokenizer):
    body = {"model": "tiny-x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}}
    node.finish_reason = "stop"
    async with make_client() as (client, app):
        r = await client.post("/v1/chat/completions", json=body)
        metrics = (await client.get("/metrics")).text
        assert gate_of(app).busy_count == 0
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    role, *content, finish, usage = events[:-1]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and e["model"] == "tiny-x" for e in events[:-1])
    assert all(e["id"] == "chatcmpl-abc123-0-1a2b3c4d" for e in events[:-1])
    streamed = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert streamed + finish["choices"][0]["delta"]["content"] == TEXT
    assert all(c["choices"][0]["finish_reason"] is None for c in content)
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(node.answer)
    assert usage["usage"]["prompt_tokens"] == len(PROMPT_IDS)
    assert f'expresslane_router_generated_tokens_total{{lane="express"}} {float(len(node.answer))}' in metrics
    assert 'expresslane_router_time_to_first_token_seconds_count{lane="express"} 1.0' in metrics


async def test_stream_completion_without_usage(make_client, node):
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json=dict(COMP, stream=True, max_tokens=3))
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all(e["object"] == "text_completion" for e in events[:-1])


async def test_stop_string_truncates_and_cancels_the_node(make_client, node):
    async with make_client() as (client, app):
        r = await client.post("/v1/completions", json=dict(COMP, stream=True, max_tokens=50, stop=[","]))
        assert gate_of(app).busy_count == 0
    events = parse_sse(r.text)
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == " hello world"
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-2]["choices"][0]["stop_reason"] == ","
    assert len(node.cancelled) == 1  # the node was told to stop generating


async def test_non_stream_stop_string_truncates(make_client, node):
    async with make_client() as (client, _):
        r = await client.post("/v1/chat/completions", json={"model": "tiny-x", "messages": [{"role": "user",
                              "content": "x"}], "max_tokens": 50, "stop": ["router"]})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == " hello world, hello "
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "router")


async def test_busy_node_is_retried(make_client, node, upstreams):
    node.decode_statuses = [429]
    async with make_client() as (client, app):
        r = await client.post("/v1/completions", json=COMP)
        assert gate_of(app).busy_count == 0
    assert r.status_code == 200
    assert len(upstreams.bodies(PREFILL, "/v1/completions")) == 2  # the whole leg was redone
    rids = [b["rid"] for b in upstreams.bodies(EXPRESS, "/pd/decode")]
    assert len(set(rids)) == 2
    assert node.cancelled == rids[:1]  # the retry after 429 cancels the first rid (no orphan)


async def test_busy_node_after_all_retries_is_a_429(make_client, node):
    node.decode_statuses = [429, 429]
    async with make_client() as (client, app):
        r = await client.post("/v1/completions", json=COMP)
        metrics = (await client.get("/metrics")).text
        assert gate_of(app).busy_count == 0
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert 'expresslane_router_rejected_total{pool="express",reason="node_busy"} 1.0' in metrics


@pytest.mark.parametrize("status,want,stream", [(504, 503, False), (504, 503, True), (500, 503, False),
                                               (502, 503, True), (501, 400, True), (400, 400, False),
                                               (499, 503, False), (503, 503, False), (409, 503, True)])
async def test_node_errors_before_the_first_token_map_and_cancel_and_release(make_client, node, status, want,
                                                                             stream):
    """tiny-x does not spill: a node that fails before the first token is a typed 503 with Retry-After;
    a parameter the node refuses is the client's 400. The rid is cancelled on the node unless it refused."""
    node.decode_statuses = [status]
    cfg = make_config(resilience={"first_token_at_once": False})  # wait for the node's first token
    async with make_client(cfg) as (client, app):
        r = await client.post("/v1/completions", json=dict(COMP, stream=stream))
        assert gate_of(app).busy_count == 0
        metrics = (await client.get("/metrics")).text
    assert r.status_code == want, r.text
    assert "error" in r.json() and "Traceback" not in r.text
    assert 'expresslane_router_upstream_errors_total{lane="express",stage="express_decode"' in metrics
    if want == 503:
        assert r.headers["retry-after"] == "2" and r.json()["error"]["code"] == "express_lane_unavailable"
        assert node.cancelled == node.reserved  # node 504/502/...: the rid is cancelled (no orphan)
    else:
        assert node.cancelled == []


async def test_node_unreachable_is_503(make_client, node, upstreams):
    def refused(request, body):
        raise httpx.ConnectError("refused")

    upstreams.on(EXPRESS, "/pd/reserve", refused)  # (a completed reserve would be a success: it breaks the run)
    upstreams.on(EXPRESS, "/pd/decode", refused)
    async with make_client(make_config(outlier={"consecutive_gateway_failure": 2})) as (client, app):
        r = await client.post("/v1/completions", json=COMP)
        assert gate_of(app).busy_count == 0
        r2 = await client.post("/v1/completions", json=COMP)
        metrics = (await client.get("/metrics")).text
        assert app.state.lanes.ctx.available("express", EXPRESS)  # request errors never eject a pool's last node
    assert r.status_code == 503 and r2.status_code == 503 and "refused" in r2.json()["error"]["message"]
    assert ('expresslane_router_outlier_decisions_total{decision="keep",node="express:5557",pool="express",'
            'reason="last_serving_node"} 1.0') in metrics  # the second failure in a row tripped the rule


async def test_error_line_mid_stream_becomes_an_sse_error_event(make_client, node, upstreams):
    async def decode(request, body):
        return httpx.Response(200, content=ndjson({"t": [node.answer[0]]}, {"error": "gpu on fire"}))

    upstreams.on(EXPRESS, "/pd/decode", decode)
    async with make_client(make_config(resilience={"midstream_failover": False})) as (client, app):
        r = await client.post("/v1/completions", json=dict(COMP, stream=True))
        assert gate_of(app).busy_count == 0
    events = parse_sse(r.text)
    assert "gpu on fire" in events[-2]["error"]["message"] and events[-1] == "[DONE]"


async def test_prefill_4xx_passes_through_and_releases(make_client, node, upstreams):
    upstreams.on(PREFILL, "/v1/completions", lambda rq, b: httpx.Response(400, content=b'{"error": {"message": "x"}}'))
    async with make_client() as (client, app):
        r = await client.post("/v1/completions", json=COMP)
        assert gate_of(app).busy_count == 0
    assert r.status_code == 400 and r.content == b'{"error": {"message": "x"}}'
    assert upstreams.bodies(EXPRESS, "/pd/decode") == []


@pytest.mark.parametrize("field,value", [("echo", True), ("prompt_logprobs", 1),
                                         ("response_format", {"type": "structural_tag", "format": {}})])
async def test_unsupported_options_are_refused_on_the_express_lane(make_client, node, upstreams, field, value):
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json=dict(COMP, **{field: value}))
    assert r.status_code == 400 and field in r.json()["error"]["message"] and "X-Lane" in r.json()["error"]["message"]
    assert upstreams.calls == []


async def test_x_lane_header_moves_a_native_alias_to_the_express_lane(make_client, node, upstreams):
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json=dict(COMP, model="tiny"), headers={"X-Lane": "express"})
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    assert len(upstreams.bodies(EXPRESS, "/pd/decode")) == 1


async def test_tilert_pool_uses_tilert_marker_and_derived_rid(make_client, node, upstreams):
    cfg = make_config(pools={
        "native": {"kind": "native", "nodes": [NATIVE]},
        "express": {"kind": "tilert", "nodes": [{"url": EXPRESS, "ctrl_host": "10.0.0.9", "ctrl_port": 5556}]}})
    async with make_client(cfg) as (client, _):
        r = await client.post("/v1/chat/completions", json={"model": "tiny-x", "max_tokens": 3,
                                                            "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200
    (pre,) = upstreams.bodies(PREFILL, "/v1/chat/completions")
    assert pre["kv_transfer_params"] == {"tilert_host": "10.0.0.9", "tilert_ctrl_port": 5556}
    assert (pre["logprobs"], pre["top_logprobs"]) == (True, 1)
    (dec,) = upstreams.bodies(EXPRESS, "/pd/decode")
    assert dec["rid"] == "abc123"


TILERT = {"native": {"kind": "native", "nodes": [NATIVE]},
          "express": {"kind": "tilert", "nodes": [{"url": EXPRESS, "ctrl_host": "h", "ctrl_port": 1}]}}


@pytest.mark.parametrize("field,value", [("min_tokens", 2), ("frequency_penalty", 0.5)])
async def test_tilert_pools_refuse_what_tilert_cannot_honour(make_client, node, upstreams, field, value):
    async with make_client(make_config(pools=TILERT)) as (client, _):
        r = await client.post("/v1/completions", json=dict(COMP, **{field: value}))
    assert r.status_code == 400 and field in r.json()["error"]["message"]
    assert upstreams.calls == []


async def test_tilert_nodes_get_no_stop_token_ids_but_the_router_still_stops_on_them(make_client, node, upstreams):
    cfg = make_config(pools=TILERT)
    stop_id = node.answer[2]
    async with make_client(cfg) as (client, _):
        r = await client.post("/v1/completions", json=dict(COMP, max_tokens=20, stop_token_ids=[stop_id]))
    (dec,) = upstreams.bodies(EXPRESS, "/pd/decode")
    assert "stop_token_ids" not in dec["sampling"]
    choice = r.json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)
    assert r.json()["usage"]["completion_tokens"] == 3


# ---- queue policies ----------------------------------------------------------------------------------

async def _hold_node(client, node):
    """Start a streaming request that keeps the only express node busy; returns its task."""
    node.hang_after = 1
    task = asyncio.ensure_future(client.post("/v1/completions", json=dict(COMP, stream=True, max_tokens=50)))
    for _ in range(200):
        await asyncio.sleep(0.005)
        if node.up.bodies(EXPRESS, "/pd/decode"):
            return task
    raise AssertionError("the holding request never reached the node")


async def test_all_nodes_busy_spill_goes_to_native(make_client, node, upstreams):
    upstreams.on(NATIVE, "/v1/completions", lambda rq, b: httpx.Response(200, json={
        "id": "cmpl-n", "choices": [{"text": "native!"}], "usage": {"prompt_tokens": 6, "completion_tokens": 1}}))
    node.up.routes[(PREFILL, "/v1/completions")] = _prefill_with_kvp(node)
    async with make_client() as (client, app):
        holder = await _hold_node(client, node)
        r = await client.post("/v1/completions", json=dict(COMP, model="tiny-xs"))
        metrics = (await client.get("/metrics")).text
        holder.cancel()
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "native!"
    assert r.json()["model"] == "tiny-xs"
    assert 'expresslane_router_spillover_total{from_pool="express",to_pool="native"} 1.0' in metrics
    assert 'expresslane_router_requests_total{alias="tiny-xs",lane="native",status="200"} 1.0' in metrics


def _prefill_with_kvp(node):
    def handler(request, body):
        r = node.prefill(request, body)
        data = r.json()
        data["kv_transfer_params"] = {"remote_engine_id": "e"}
        return httpx.Response(200, json=data)
    return handler


async def test_all_nodes_busy_reject_after_max_wait_with_retry_after(make_client, node):
    async with make_client() as (client, app):
        holder = await _hold_node(client, node)
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=COMP)  # tiny-x: max_wait_s 0.3, reject
        waited = time.monotonic() - t0
        metrics = (await client.get("/metrics")).text
        holder.cancel()
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert 0.25 <= waited < 2
    assert 'expresslane_router_rejected_total{pool="express",reason="queue_timeout"} 1.0' in metrics
    assert 'expresslane_router_queue_wait_seconds_count{lane="express"} 1.0' in metrics  # only the holder


async def test_full_queue_rejects_immediately(make_client, node):
    async with make_client() as (client, app):
        holder = await _hold_node(client, node)
        waiters = [asyncio.ensure_future(client.post("/v1/completions", json=COMP)) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert gate_of(app).waiting == 2
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=COMP)
        assert time.monotonic() - t0 < 0.2
        assert r.status_code == 429
        assert 'expresslane_router_queue_depth{pool="express"} 2.0' in (await client.get("/metrics")).text
        holder.cancel()
        for w in waiters:
            w.cancel()


async def test_a_waiter_gets_the_node_when_it_frees_up(make_client, node, upstreams):
    async with make_client() as (client, app):
        first = asyncio.ensure_future(client.post("/v1/completions", json=dict(COMP, stream=True)))
        second = asyncio.ensure_future(client.post("/v1/completions", json=COMP))
        r1, r2 = await asyncio.gather(first, second)
        assert gate_of(app).busy_count == 0
    assert r1.status_code == 200 and r2.status_code == 200
    assert len(upstreams.bodies(EXPRESS, "/pd/decode")) == 2


# ---- client disconnect -------------------------------------------------------------------------------

async def asgi_post(app, path: str, body: dict, disconnect: asyncio.Event, on_send=None) -> list[dict]:
    """Drive the ASGI app directly so the client can 'disconnect' while the response is open."""
    sent: list[dict] = []
    first = True

    async def receive():
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if on_send:
            on_send(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"router")],
             "client": ("127.0.0.1", 1234), "server": ("router", 80)}
    await app(scope, receive, send)
    return sent


async def test_client_disconnect_mid_stream_cancels_and_releases_within_a_second(make_client, node):
    node.hang_after = 2
    gone = asyncio.Event()

    def on_send(message):
        if message["type"] == "http.response.body" and b'"text"' in message.get("body", b""):
            gone.set()  # the client leaves after the first token chunk

    async with make_client() as (client, app):
        task = asyncio.ensure_future(asgi_post(app, "/v1/completions", dict(COMP, stream=True, max_tokens=50),
                                               gone, on_send))
        await asyncio.wait_for(gone.wait(), 2)
        t0 = time.monotonic()
        await asyncio.wait_for(task, 2)
        for _ in range(100):
            if gate_of(app).busy_count == 0:
                break
            await asyncio.sleep(0.01)
        elapsed = time.monotonic() - t0
        assert gate_of(app).busy_count == 0
        metrics = (await client.get("/metrics")).text
    assert elapsed < 1.0
    assert len(node.cancelled) == 1
    assert 'expresslane_router_requests_total{alias="tiny-x",lane="express",status="499"} 1.0' in metrics


async def test_client_disconnect_during_non_stream_decode_cancels_and_releases(make_client, node, upstreams):
    node.hang_non_stream = True
    gone = asyncio.Event()
    async with make_client() as (client, app):
        task = asyncio.ensure_future(asgi_post(app, "/v1/completions", COMP, gone))
        for _ in range(200):
            await asyncio.sleep(0.005)
            if upstreams.bodies(EXPRESS, "/pd/decode"):
                break
        assert gate_of(app).busy_count == 1
        t0 = time.monotonic()
        gone.set()
        sent = await asyncio.wait_for(task, 2)
        assert time.monotonic() - t0 < 1.0
        assert gate_of(app).busy_count == 0
    rid = upstreams.bodies(EXPRESS, "/pd/decode")[0]["rid"]
    assert node.cancelled == [rid]
    assert sent[0]["status"] == 499


async def test_client_disconnect_while_queued_leaves_the_queue(make_client, node):
    gone = asyncio.Event()
    async with make_client() as (client, app):
        holder = await _hold_node(client, node)
        task = asyncio.ensure_future(asgi_post(app, "/v1/completions", dict(COMP), gone))
        await asyncio.sleep(0.05)
        assert gate_of(app).waiting == 1
        gone.set()
        await asyncio.wait_for(task, 1)
        assert gate_of(app).waiting == 0
        holder.cancel()


def test_generation_defaults_fill_only_what_the_client_left_and_the_node_kind_takes():
    from expresslane.router.lanes.express_options import sampling_of

    defaults = {"temperature": 0.6, "top_k": 20, "min_p": 0.05, "frequency_penalty": 0.25}
    assert sampling_of({"temperature": 0, "seed": 1}, defaults) == {"temperature": 0, "seed": 1, "top_k": 20,
                                                                    "min_p": 0.05, "frequency_penalty": 0.25}
    # a TileRT node takes neither min_p nor frequency_penalty: its own loop applies its model's config
    assert sampling_of({}, defaults, "tilert") == {"temperature": 0.6, "top_k": 20}


async def test_generation_config_max_new_tokens_is_the_default_budget(upstreams, node, model_text):
    """A chat request without max_tokens gets the model's generation_config max_new_tokens as its budget, as
    vLLM falls back to it (completions keep their 16; an explicit value wins)."""
    import dataclasses

    from prometheus_client import CollectorRegistry

    from expresslane.router.app import create_app

    app = create_app(make_config(), transport=upstreams.transport, registry=CollectorRegistry(),
                     model_text=dataclasses.replace(model_text, default_max_tokens=3))
    chat = {"model": "tiny-x", "messages": [{"role": "user", "content": "x"}]}
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            for body in (chat, dict(chat, max_tokens=9), {"model": "tiny-x", "prompt": "hi"}):
                assert (await client.post("/v1/" + ("chat/completions" if "messages" in body else "completions"),
                                          json=body)).status_code == 200
    assert [d["max_tokens"] for d in upstreams.bodies(EXPRESS, "/pd/decode")] == [3, 9, 16]


async def test_max_model_len_is_asked_once_for_a_burst_on_a_fresh_router(make_client, node, upstreams):
    """Without max_model_len in the config, the express lane learns it from the prefill's /v1/models: one call that
    a burst of requests on a fresh router shares (it once sent one per request, and a busy prefill timed them out)."""
    calls = []

    async def models(request, body):
        calls.append(request.url.path)
        await asyncio.sleep(0.2)
        return httpx.Response(200, json={"data": [{"id": "served", "max_model_len": 64}]})

    upstreams.on(PREFILL, "/v1/models", models)
    d = config_dict()
    d["max_model_len"] = None
    d["aliases"]["tiny-x"]["queue"] = {"max_waiting": 8, "max_wait_s": 5, "when_full": "reject"}
    async with make_client(parse_config(d)) as (client, app):
        rs = await asyncio.gather(*(client.post("/v1/completions", json=COMP) for _ in range(5)))
    assert [r.status_code for r in rs] == [200] * 5, [r.text for r in rs]
    assert calls == ["/v1/models"]
