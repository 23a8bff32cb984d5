"""Router behaviour when upstreams fail (fake upstreams; the real-process fault matrix is
tests/integration/test_faults.py): reserve before prefill, failover before the first token, no orphans,
stall timeouts, truthful streams on both lanes, native retries, and mid-stream failover stitching."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from ._kit import EXPRESS, NATIVE, PREFILL, config_dict, make_config, parse_config, parse_sse, sse_bytes
from .test_router_express_lane import COMP, PROMPT_IDS, TEXT, FakeNode, gate_of

NATIVE2 = "http://native2:8100"
ONE_FAILURE = {"consecutive_gateway_failure": 1}  # outlier detection decides at the first failure (default: 3)


def _node(upstreams, tokenizer) -> FakeNode:
    return FakeNode(upstreams, tokenizer)


def _prefill_with_kvp(node):
    def handler(request, body):
        data = node.prefill(request, body).json()
        if body["kv_transfer_params"] == {"do_remote_decode": True}:
            data["kv_transfer_params"] = {"remote_engine_id": "e", "remote_block_ids": [1]}
        return httpx.Response(200, json=data)
    return handler


class NativeTokens:
    """A fake native decode node that continues the stitched token-id prompt with `answer` (greedy: the
    continuation of `answer[:k]` is `answer[k:]`) and returns token ids in its chunks, like vLLM."""

    def __init__(self, upstreams, node: FakeNode, base: str = NATIVE):
        self.node, self.bodies = node, []
        upstreams.on(base, "/v1/completions", self.completions)
        upstreams.routes[(PREFILL, "/v1/completions")] = _prefill_with_kvp(node)

    def completions(self, request, body):
        self.bodies.append(body)
        k = len(body["prompt"]) - len(PROMPT_IDS)
        rest = self.node.answer[k:k + body["max_tokens"]]
        chunks = [{"id": "cmpl-native", "object": "text_completion", "choices": [
            {"index": 0, "text": "?", "token_ids": [t], "finish_reason": None}]} for t in rest]
        chunks[-1]["choices"][0]["finish_reason"] = "length"
        return httpx.Response(200, content=sse_bytes(*chunks, "[DONE]"))


def _text(events) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))


# ---- before the first token ----------------------------------------------------------------------

async def test_reserve_busy_costs_no_prefill_and_is_retried(make_client, upstreams, tokenizer):
    node = _node(upstreams, tokenizer)
    node.reserve_statuses = [429]
    async with make_client() as (client, app):
        r = await client.post("/v1/completions", json=COMP)
        assert gate_of(app).busy_count == 0
    assert r.status_code == 200
    assert len(upstreams.bodies(PREFILL, "/v1/completions")) == 1  # only the served attempt was prefilled
    assert len(upstreams.bodies(EXPRESS, "/pd/reserve")) == 2 and node.cancelled == []


async def test_a_node_without_pd_reserve_is_served_without_reservations(make_client, upstreams, tokenizer):
    node = _node(upstreams, tokenizer)
    del upstreams.routes[(EXPRESS, "/pd/reserve")]  # the fake answers 404, like an older node
    async with make_client() as (client, _):
        r1 = await client.post("/v1/completions", json=COMP)
        r2 = await client.post("/v1/completions", json=COMP)
    assert r1.status_code == r2.status_code == 200
    assert len(upstreams.bodies(EXPRESS, "/pd/reserve")) == 1  # asked once, then remembered
    assert node.cancelled == []


async def test_reserve_not_ready_spills_counted_with_a_reason_and_is_reported(make_client, upstreams, tokenizer):
    node = _node(upstreams, tokenizer)
    node.reserve_statuses = [503]
    NativeTokens(upstreams, node)
    upstreams.on(NATIVE, "/v1/completions", lambda rq, b: httpx.Response(200, json={
        "id": "cmpl-n", "choices": [{"text": "native!"}], "usage": {"prompt_tokens": 6, "completion_tokens": 1}}))
    async with make_client(make_config(outlier=ONE_FAILURE)) as (client, app):
        r = await client.post("/v1/completions", json=dict(COMP, model="tiny-xs"))
        metrics = (await client.get("/metrics")).text
        assert app.state.lanes.ctx.available("express", EXPRESS)  # the pool's last node: never ejected for it
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "native!"
    prefills = upstreams.bodies(PREFILL, "/v1/completions")
    assert [p["kv_transfer_params"] for p in prefills] == [{"do_remote_decode": True}]  # no express prefill spent
    assert ('expresslane_router_failovers_total{alias="tiny-xs",from_lane="express",reason="not_ready",'
            'to_lane="native"} 1.0') in metrics
    assert 'expresslane_router_outlier_decisions_total{decision="keep",node="express:5557",pool="express",reason="last_serving_node"} 1.0' in metrics


async def test_prefill_reports_failed_handoff_fast_spill_and_cancel(make_client, upstreams, tokenizer):
    node = _node(upstreams, tokenizer)

    def prefill(request, body):
        data = _prefill_with_kvp(node)(request, body).json()
        if "expresslane_rid" in body["kv_transfer_params"]:
            data["kv_transfer_params"] = {"expresslane_rid": body["kv_transfer_params"]["expresslane_rid"],
                                          "expresslane_status": "failed", "expresslane_error": "too_long: 99 > 64"}
        return httpx.Response(200, json=data)

    upstreams.on(PREFILL, "/v1/completions", prefill)
    upstreams.on(NATIVE, "/v1/completions", lambda rq, b: httpx.Response(200, json={
        "id": "cmpl-n", "choices": [{"text": "native!"}], "usage": {"prompt_tokens": 6, "completion_tokens": 1}}))
    async with make_client() as (client, app):
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=dict(COMP, model="tiny-xs"))
        elapsed = time.monotonic() - t0
        metrics = (await client.get("/metrics")).text
        r2 = await client.post("/v1/completions", json=COMP)  # tiny-x does not spill: typed 503
        assert gate_of(app).busy_count == 0
    assert r.status_code == 200 and elapsed < 1.0
    assert upstreams.bodies(EXPRESS, "/pd/decode") == []  # the node was never asked to wait for KV
    assert node.cancelled == node.reserved and len(node.reserved) == 2  # both reservations given back
    assert 'reason="prefill_too_long"' in metrics
    assert r2.status_code == 503 and "too_long" in r2.json()["error"]["message"]


async def test_no_first_token_in_time_is_a_fast_typed_failure(make_client, upstreams, tokenizer):
    node = _node(upstreams, tokenizer)
    node.hang_non_stream = True  # the node never sends its first token
    cfg = make_config(resilience={"first_token_timeout_s": 0.3, "first_token_at_once": False}, outlier=ONE_FAILURE)
    async with make_client(cfg) as (client, app):
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=dict(COMP, stream=True))
        elapsed = time.monotonic() - t0
        assert gate_of(app).busy_count == 0
        assert app.state.lanes.ctx.available("express", EXPRESS)  # reported, but the pool's last node
        assert 'expresslane_router_outlier_decisions_total{decision="keep",node="express:5557",pool="express",reason="last_serving_node"} 1.0' in (await client.get("/metrics")).text
    assert r.status_code == 503 and elapsed < 2.0
    assert node.cancelled == node.reserved  # no orphan


# ---- after the first token: stall, truncation, mid-stream failover ------------------------------------

async def test_stall_mid_stream_is_an_error_event_then_cancel_and_release(make_client, upstreams, tokenizer):
    node = _node(upstreams, tokenizer)
    node.hang_after = 2  # SIGSTOP-like: two tokens, then silence
    cfg = make_config(resilience={"stall_timeout_s": 0.3, "midstream_failover": False})
    async with make_client(cfg) as (client, app):
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=dict(COMP, stream=True, max_tokens=20))
        elapsed = time.monotonic() - t0
        for _ in range(100):
            if gate_of(app).busy_count == 0:
                break
            await asyncio.sleep(0.01)
        assert gate_of(app).busy_count == 0
        metrics = (await client.get("/metrics")).text
    assert elapsed < 2.0  # seconds, not decode_s + kv_wait_s
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]" and "stalled" in events[-2]["error"]["message"]
    assert _text(events[:-2]) == tokenizer.decode(node.answer[:2])
    for _ in range(100):
        if node.cancelled:
            break
        await asyncio.sleep(0.01)
    assert node.cancelled == node.reserved
    assert 'expresslane_router_midstream_failovers_total{outcome="disabled",pool="express"} 1.0' in metrics
    assert 'type="stall"' in metrics


async def test_truncated_express_stream_without_failover_is_an_error_event(make_client, upstreams, tokenizer):
    node = _node(upstreams, tokenizer)
    node.die_after = 3
    cfg = make_config(resilience={"midstream_failover_aliases": {"tiny-x": False}})
    async with make_client(cfg) as (client, _):
        r = await client.post("/v1/completions", json=dict(COMP, stream=True, max_tokens=20))
        r2 = await client.post("/v1/completions", json=dict(COMP, max_tokens=20))
    events = parse_sse(r.text)
    assert "without a done line" in events[-2]["error"]["message"]
    assert r2.status_code == 502 and "without a done line" in r2.json()["error"]["message"]  # never a partial 200


async def test_midstream_failover_stitches_one_unbroken_stream(make_client, upstreams, tokenizer):
    node = _node(upstreams, tokenizer)
    node.die_after = 3  # the node dies after three tokens reached the client
    native = NativeTokens(upstreams, node)
    n = len(node.answer)
    async with make_client() as (client, app):
        r = await client.post("/v1/completions", json=dict(COMP, stream=True, max_tokens=n, top_k=1,
                                                           stop=["zzz"]))
        for _ in range(100):
            if gate_of(app).busy_count == 0:
                break
            await asyncio.sleep(0.01)
        assert gate_of(app).busy_count == 0
        metrics = (await client.get("/metrics")).text
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert all(e["object"] == "text_completion" and e["id"] == "cmpl-abc123-0-1a2b3c4d" for e in events[:-1])
    assert _text(events[:-1]) == tokenizer.decode(node.answer) == TEXT  # exact, one stream
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    (body,) = native.bodies
    assert body["prompt"] == PROMPT_IDS + node.answer[:3]  # the token history as a token-id prompt
    assert body["max_tokens"] == n - 3 and body["return_token_ids"] is True and body["stream"] is True
    assert (body["temperature"], body["seed"], body["top_k"]) == (0, 3, 1)  # the same sampling
    assert "stop" not in body  # stop strings stay with the router's assembler
    assert body["kv_transfer_params"] == {"remote_engine_id": "e", "remote_block_ids": [1]}
    assert 'expresslane_router_midstream_failovers_total{outcome="ok",pool="express"} 1.0' in metrics
    assert node.cancelled == node.reserved


@pytest.mark.parametrize("failure, reason", [(httpx.ConnectTimeout, "timeout"), (httpx.ConnectError, "connect")])
async def test_midstream_failover_retries_a_native_node_that_fails_before_its_first_byte(
        make_client, upstreams, tokenizer, failure, reason):
    """The continuation decodes by the native lane's own retry rule: a native node that does not answer the first
    try (CI once saw a connect time out there) is tried again, and the stream still ends exact."""
    node = _node(upstreams, tokenizer)
    node.die_after = 3
    native = NativeTokens(upstreams, node)
    calls = []

    def first_try_fails(request, body):
        calls.append(body)
        if len(calls) == 1:
            raise failure("no answer")
        return native.completions(request, body)

    upstreams.on(NATIVE, "/v1/completions", first_try_fails)
    n = len(node.answer)
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json=dict(COMP, stream=True, max_tokens=n, top_k=1))
        metrics = (await client.get("/metrics")).text
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-2:]
    assert _text(events[:-1]) == TEXT
    assert len(calls) == 2 and calls[0]["prompt"] == calls[1]["prompt"] == PROMPT_IDS + node.answer[:3]
    assert f'expresslane_router_retries_total{{lane="native",pool="native",reason="{reason}"}} 1.0' in metrics
    assert 'expresslane_router_midstream_failovers_total{outcome="ok",pool="express"} 1.0' in metrics


async def test_midstream_failover_for_a_non_stream_chat_request(make_client, upstreams, tokenizer):
    node = _node(upstreams, tokenizer)
    node.die_after = 2
    NativeTokens(upstreams, node)
    async with make_client() as (client, _):
        r = await client.post("/v1/chat/completions", json={"model": "tiny-x", "max_tokens": 50, "min_tokens": 4,
                                                            "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == TEXT
    cont = upstreams.bodies(NATIVE, "/v1/completions")[0]
    assert cont["min_tokens"] == 2 and cont["prompt"] == PROMPT_IDS + node.answer[:2]


async def test_midstream_failover_that_fails_too_is_an_error_event(make_client, upstreams, tokenizer):
    node = _node(upstreams, tokenizer)
    node.die_after = 2
    upstreams.routes[(PREFILL, "/v1/completions")] = _prefill_with_kvp(node)
    upstreams.on(NATIVE, "/v1/completions", lambda rq, b: httpx.Response(200, content=sse_bytes(
        {"choices": [{"index": 0, "text": "x", "token_ids": [node.answer[2]]}]})))  # no [DONE]
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json=dict(COMP, stream=True, max_tokens=20))
        metrics = (await client.get("/metrics")).text
    events = parse_sse(r.text)
    assert "failover" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    assert 'expresslane_router_midstream_failovers_total{outcome="failed",pool="express"} 1.0' in metrics


# ---- native lane -------------------------------------------------------------------------------------

def _native_cfg(**res):
    d = config_dict(resilience=res)
    d["pools"]["native"]["nodes"] = [NATIVE, NATIVE2]
    return parse_config(d)


def _prefill_native(upstreams, counter):
    def prefill(request, body):
        counter.append(body)
        return httpx.Response(200, json={"id": "p", "choices": [{"text": "x"}], "usage": {"prompt_tokens": 3},
                                         "kv_transfer_params": {"remote_engine_id": "e", "n": len(counter)}})
    upstreams.on(PREFILL, "/v1/completions", prefill)


def _native_stream(*events):
    return lambda request, body: httpx.Response(200, content=sse_bytes(*events))


CHUNK = {"id": "cmpl-d", "object": "text_completion", "model": "served",
         "choices": [{"index": 0, "text": "hi", "finish_reason": None}]}


async def test_native_stream_without_done_is_an_error_event(make_client, upstreams):
    _prefill_native(upstreams, [])
    upstreams.on(NATIVE, "/v1/completions", _native_stream(CHUNK))
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True})
        metrics = (await client.get("/metrics")).text
    events = parse_sse(r.text)
    assert events[0]["choices"][0]["text"] == "hi"
    assert "without [DONE]" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    assert 'expresslane_router_requests_total{alias="tiny",lane="native",status="502"} 1.0' in metrics


async def test_native_connect_error_is_retried_on_another_node_with_the_same_kv(make_client, upstreams):
    prefills = []
    _prefill_native(upstreams, prefills)

    def refused(request, body):
        raise httpx.ConnectError("refused")

    upstreams.on(NATIVE, "/v1/completions", refused)
    upstreams.on(NATIVE2, "/v1/completions", _native_stream(CHUNK, "[DONE]"))
    cfg = _native_cfg()
    cfg = cfg.model_copy(update={"outlier": cfg.outlier.model_copy(update=ONE_FAILURE)})
    async with make_client(cfg) as (client, app):
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True})
        r2 = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True})
        metrics = (await client.get("/metrics")).text
        assert not app.state.lanes.ctx.available("native", NATIVE)  # one of two nodes: it may go
    assert parse_sse(r.text)[-1] == "[DONE]" and r.status_code == 200
    assert len(prefills) == 2  # one per request: after a connect error the KV was untouched
    assert len(upstreams.bodies(NATIVE, "/v1/completions")) == 1  # ejected: the second request skips it
    assert ('expresslane_router_outlier_decisions_total{decision="eject",node="native:8100",pool="native",'
            'reason="consecutive_gateway_failure"} 1.0') in metrics
    assert 'expresslane_router_retries_total{lane="native",pool="native",reason="connect"} 1.0' in metrics


async def test_native_node_that_dies_before_its_first_event_is_retried_after_a_new_prefill(make_client, upstreams):
    prefills = []
    _prefill_native(upstreams, prefills)
    upstreams.on(NATIVE, "/v1/completions", _native_stream())  # 200, then nothing
    upstreams.on(NATIVE2, "/v1/completions", _native_stream(CHUNK, "[DONE]"))
    async with make_client(_native_cfg()) as (client, _):
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True})
    assert r.status_code == 200 and parse_sse(r.text)[-1] == "[DONE]"
    assert len(prefills) == 2  # the first node may have pulled the KV: prefill again
    assert upstreams.bodies(NATIVE2, "/v1/completions")[0]["kv_transfer_params"]["n"] == 2


async def test_native_stall_mid_stream_is_bounded(make_client, upstreams):
    _prefill_native(upstreams, [])

    async def stalling(request, body):
        async def gen():
            yield sse_bytes(CHUNK)
            await asyncio.Event().wait()
        return httpx.Response(200, content=gen())

    upstreams.on(NATIVE, "/v1/completions", stalling)
    async with make_client(make_config(resilience={"stall_timeout_s": 0.3})) as (client, app):
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True})
        assert time.monotonic() - t0 < 2.0
        assert app.state.lanes.ctx.available("native", NATIVE)  # one stall of the pool's only node ejects nothing
    assert "stalled" in parse_sse(r.text)[-2]["error"]["message"]


def _silent_for(seconds: float):
    """A native stream: one chunk, `seconds` of silence (a busy server), one more chunk, [DONE]."""
    async def handler(request, body):
        async def gen():
            yield sse_bytes(CHUNK)
            await asyncio.sleep(seconds)
            yield sse_bytes(CHUNK, "[DONE]")
        return httpx.Response(200, content=gen())
    return handler


def _probing_config():
    return make_config(resilience={"stall_timeout_s": 0.3}, health={"enabled": True, "interval_s": 0.05,
                                                                     "timeout_s": 0.2})


async def test_a_silent_stream_from_a_node_that_answers_its_probes_is_busy_not_stalled(make_client, upstreams):
    """A stream silent past the stall timeout goes on while the node's health probes answer (a vLLM decode
    server under a burst on 2 CPUs went silent for > 10 s on streams that then completed): the client gets the
    whole answer, nothing is ejected."""
    _prefill_native(upstreams, [])
    for base in (PREFILL, NATIVE, EXPRESS):
        upstreams.on(base, "/health", lambda request, body: httpx.Response(200))
    upstreams.on(NATIVE, "/v1/completions", _silent_for(1.0))
    async with make_client(_probing_config()) as (client, app):
        await asyncio.sleep(0.2)  # the first probe rounds
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True})
        assert app.state.lanes.ctx.available("native", NATIVE)
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1] if isinstance(e, dict)), events
    assert len(events) == 3


async def test_a_silent_stream_from_a_node_that_stops_answering_its_probes_is_cut_as_stalled(make_client,
                                                                                              upstreams):
    """The same silence from a node whose probes stop answering (SIGSTOP, a partition) is a stall: cut within
    two windows of the stall timeout after the probes stop, long before the silence ends."""
    _prefill_native(upstreams, [])
    stopped = asyncio.Event()

    async def health(request, body):
        if stopped.is_set():
            await asyncio.sleep(1.0)  # a stopped process: the probe times out
        return httpx.Response(200)

    for base in (PREFILL, EXPRESS):
        upstreams.on(base, "/health", lambda request, body: httpx.Response(200))
    upstreams.on(NATIVE, "/health", health)

    async def stops(request, body):
        async def gen():
            yield sse_bytes(CHUNK)
            stopped.set()
            await asyncio.sleep(5.0)
            yield sse_bytes(CHUNK, "[DONE]")
        return httpx.Response(200, content=gen())

    upstreams.on(NATIVE, "/v1/completions", stops)
    async with make_client(_probing_config()) as (client, app):
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True})
        elapsed = time.monotonic() - t0
    assert elapsed < 2.0, elapsed
    assert "stalled" in parse_sse(r.text)[-2]["error"]["message"]


async def test_request_deadline_bounds_a_slow_non_stream_native_request(make_client, upstreams):
    _prefill_native(upstreams, [])

    async def slow(request, body):
        await asyncio.sleep(30)

    upstreams.on(NATIVE, "/v1/completions", slow)
    async with make_client(make_config(resilience={"request_deadline_s": 0.4})) as (client, app):
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert time.monotonic() - t0 < 2.0
        assert app.state.lanes.ctx.healthy(NATIVE)  # the request's deadline is not the node's fault
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
    assert "deadline" in r.json()["error"]["message"]


async def test_no_healthy_native_node_is_a_fast_503_without_prefill(make_client, upstreams):
    """Without panic routing (healthy_panic_threshold 0; with it, the pool's only node would be tried:
    test_router_health.py), an unhealthy pool is a typed 503 before any prefill."""
    from expresslane.router.fleet.health import ProbeResult

    prefills = []
    _prefill_native(upstreams, prefills)
    for base in (PREFILL, NATIVE, EXPRESS):
        upstreams.on(base, "/health", lambda r, b: httpx.Response(200))
    cfg = make_config(health={"enabled": True, "interval_s": 3600, "unhealthy_threshold": 1,
                              "healthy_panic_threshold": 0})
    async with make_client(cfg) as (client, app):
        monitor = app.state.health
        for _ in range(100):  # the first (and only) probe round passed
            if len([c for c in upstreams.calls if c[1] == "/health"]) >= 3:
                break
            await asyncio.sleep(0.01)
        monitor.probe_outcome(monitor.upstreams[NATIVE], ProbeResult.FAILED, "probe_connect")  # the probes say it is down
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "2" and prefills == []
    assert json.loads(r.text)["error"]["type"] == "service_unavailable"


# ---- first token at once (issue 14 item 6) ---------------------------------------------------------------

async def test_first_token_reaches_the_client_before_the_node_answers(make_client, upstreams, tokenizer):
    from .test_router_express_lane import asgi_post

    node = _node(upstreams, tokenizer)
    release = asyncio.Event()
    plain = node.decode
    first_text: list[bytes] = []

    async def slow_decode(request, body):
        await release.wait()  # the handoff / injection still runs: the node has sent nothing yet
        return await plain(request, body)

    def on_send(message):
        if message["type"] == "http.response.body" and b'"text"' in message.get("body", b"") and not release.is_set():
            first_text.append(message["body"])
            release.set()  # only now may the node answer

    upstreams.on(EXPRESS, "/pd/decode", slow_decode)
    async with make_client() as (client, app):
        sent = await asyncio.wait_for(asgi_post(app, "/v1/completions", dict(COMP, stream=True, max_tokens=6),
                                                asyncio.Event(), on_send), 5)
        assert gate_of(app).busy_count == 0
    assert first_text and json.loads(first_text[0][len(b"data: "):])["choices"][0]["text"] == \
        tokenizer.decode(node.answer[:1])
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    events = parse_sse(body)
    assert _text(events[:-1]) == tokenizer.decode(node.answer[:6]) and events[-1] == "[DONE]"
    assert node.cancelled == []  # the node finished on its own


async def test_first_token_at_once_then_node_down_continues_on_native(make_client, upstreams, tokenizer):
    node = _node(upstreams, tokenizer)
    node.decode_statuses = [503]  # the node fails its handoff after the first token was sent
    native = NativeTokens(upstreams, node)
    async with make_client() as (client, app):
        r = await client.post("/v1/completions", json=dict(COMP, stream=True, max_tokens=len(node.answer)))
        assert gate_of(app).busy_count == 0
    events = parse_sse(r.text)
    assert _text(events[:-1]) == TEXT and not any("error" in e for e in events[:-1])
    assert native.bodies[0]["prompt"] == PROMPT_IDS + node.answer[:1]


async def test_first_token_that_ends_the_answer_never_waits_for_the_node(make_client, upstreams, tokenizer):
    node = _node(upstreams, tokenizer)
    node.hang_non_stream = True
    async with make_client() as (client, app):
        r = await client.post("/v1/completions", json=dict(COMP, stream=True, max_tokens=1))
        assert gate_of(app).busy_count == 0
    events = parse_sse(r.text)
    assert _text(events[:-1]) == tokenizer.decode(node.answer[:1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert upstreams.bodies(EXPRESS, "/pd/decode") == [] and node.cancelled == node.reserved


def test_continuation_body_is_a_token_id_completion_with_the_remaining_budget():
    from expresslane.router.lanes.continuation import continuation_body
    from expresslane.router.openai.request import options_of

    chat = {"model": "tiny-x", "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 10,
            "temperature": 0, "top_p": 0.9, "seed": 7, "stop": ["\n"], "min_tokens": 5, "ignore_eos": True,
            "stop_token_ids": [3], "stream_options": {"include_usage": True}, "logit_bias": None}
    opts = options_of(chat, chat=True)
    body = continuation_body(chat, opts, "served", [1, 2, 3, 9, 9], max_tokens_left=8, generated=2)
    assert body == {"model": "served", "prompt": [1, 2, 3, 9, 9], "max_tokens": 8, "stream": True,
                    "return_token_ids": True, "temperature": 0, "top_p": 0.9, "seed": 7, "min_tokens": 3,
                    "ignore_eos": True, "stop_token_ids": [3]}
    assert "min_tokens" not in continuation_body(chat, opts, "served", [1], max_tokens_left=8, generated=5)
    # the typed request's reading, not the raw body's: a min_tokens the client sent as null counts as 0
    assert "min_tokens" not in continuation_body(dict(chat, min_tokens=None), options_of(dict(chat, min_tokens=None),
                                                 chat=True), "served", [1], max_tokens_left=8, generated=0)


async def test_kv_transfer_failed_spills_at_once_with_the_node_reason(make_client, upstreams, tokenizer):
    node = _node(upstreams, tokenizer)
    upstreams.on(EXPRESS, "/pd/decode", lambda rq, b: httpx.Response(502, json={
        "error": "kv_transfer_failed", "reason": "aborted:no_staging_slot", "message": "x", "detail": "x"}))
    upstreams.on(NATIVE, "/v1/completions", _native_stream(CHUNK, "[DONE]"))
    upstreams.routes[(PREFILL, "/v1/completions")] = _prefill_with_kvp(node)
    async with make_client(make_config(resilience={"first_token_at_once": False})) as (client, app):
        r = await client.post("/v1/completions", json=dict(COMP, model="tiny-xs", stream=True))
        metrics = (await client.get("/metrics")).text
        assert app.state.lanes.ctx.healthy(EXPRESS)  # the transfer failed, not the node
    assert r.status_code == 200 and parse_sse(r.text)[0]["choices"][0]["text"] == "hi"  # spilled before any byte
    assert 'reason="kv_transfer_failed",to_lane="native"} 1.0' in metrics
    assert node.cancelled == node.reserved


async def test_node_process_dying_mid_stream_is_reported_and_fails_over(make_client, upstreams, tokenizer):
    """SIGKILL mid-stream looks like this to httpx: the peer closes the chunked body (RemoteProtocolError)."""
    node = _node(upstreams, tokenizer)
    NativeTokens(upstreams, node)

    async def dying(request, body):
        async def lines():
            yield json.dumps({"t": node.answer[:2]}).encode() + b"\n"
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
        return httpx.Response(200, content=lines())

    upstreams.on(EXPRESS, "/pd/decode", dying)
    async with make_client() as (client, app):
        r = await client.post("/v1/completions", json=dict(COMP, stream=True, max_tokens=len(node.answer)))
        metrics = (await client.get("/metrics")).text
    assert _text(parse_sse(r.text)[:-1]) == TEXT
    assert 'stage="express_decode",type="transport"' in metrics and 'outcome="ok",pool="express"} 1.0' in metrics


async def test_a_stop_string_met_after_the_failover_ends_the_stream_and_counts_ok(make_client, upstreams, tokenizer):
    node = _node(upstreams, tokenizer)
    node.die_after = 1
    NativeTokens(upstreams, node)
    async with make_client() as (client, _):
        r = await client.post("/v1/completions", json=dict(COMP, stream=True, max_tokens=50, stop=[","]))
        metrics = (await client.get("/metrics")).text
    events = parse_sse(r.text)
    assert _text(events[:-1]) == " hello world" and events[-2]["choices"][0]["stop_reason"] == ","
    assert 'expresslane_router_midstream_failovers_total{outcome="ok",pool="express"} 1.0' in metrics
    assert 'expresslane_router_midstream_failovers_total{outcome="client_gone",pool="express"} 0.0' in metrics
