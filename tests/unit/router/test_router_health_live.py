"""Health and outlier detection with the router's real upstream clients (H1Pool for the one-shot legs and the probes,
aiohttp under httpx for the streams) against real local servers: what an httpx.MockTransport cannot show.

- Busy is not dead, for streams too: a native decode node whose first event comes after first_token_timeout_s while
  its probes pass is waited on (aiohttp's per-read timeout was set from first_token_timeout_s and cut the wait as
  the node's `timeout`).
- The router's own pool saturation is its own typed error (503 router_saturated, its own metric) and never counts
  against a node; the probes have their own connection budget and keep passing while traffic fills the pool (512
  slow requests once starved them: every node went unhealthy and everything got 503).
"""

from __future__ import annotations

import asyncio
import json

import httpx
from aiohttp import web
from prometheus_client import CollectorRegistry

from expresslane.router.app import create_app
from expresslane.router.config import parse_config

from ._aiohttp_server import serving


def _config(prefill: str, native: str, **over) -> dict:
    d = {"prefill": {"url": prefill, "model": "served"},
         "timeouts": {"connect_s": 1, "prefill_s": 10, "decode_s": 10},
         "health": {"enabled": True, "interval_s": 0.1, "timeout_s": 0.5, "unhealthy_threshold": 1},
         "pools": {"native": {"kind": "native", "nodes": [native]}},
         "aliases": {"tiny": {"pool": "native"}}}
    d.update(over)
    return d


def _prefill_routes(hits: list[str]) -> list[web.RouteDef]:
    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    async def completions(request: web.Request) -> web.Response:
        hits.append("prefill")
        return web.json_response({"id": "p", "choices": [{"text": "x"}], "usage": {"prompt_tokens": 3},
                                  "kv_transfer_params": {"remote_engine_id": "e"}})
    return [web.get("/health", health), web.post("/v1/completions", completions)]


CHUNK = {"id": "cmpl-d", "object": "text_completion", "model": "served",
         "choices": [{"index": 0, "text": "hi", "finish_reason": None}]}


async def _client(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router", timeout=30)


async def test_a_busy_native_node_whose_first_event_is_late_is_waited_on_through_aiohttp():
    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(1.5)  # 3x first_token_timeout_s, the node's probes passing all along
        for data in (json.dumps(CHUNK), json.dumps(CHUNK), "[DONE]"):
            await resp.write(f"data: {data}\n\n".encode())
        return resp

    hits: list[str] = []
    async with serving(_prefill_routes(hits)) as prefill, serving(
            [web.get("/health", health), web.post("/v1/completions", completions)]) as native:
        cfg = parse_config(_config(prefill, native, resilience={"first_token_timeout_s": 0.5,
                                                                "stall_timeout_s": 0.5, "native_retries": 0}))
        app = create_app(cfg, registry=CollectorRegistry())
        async with app.router.lifespan_context(app):
            async with await _client(app) as c:
                await asyncio.sleep(0.3)  # the first probe rounds passed
                r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True})
                metrics = (await c.get("/metrics")).text
    assert r.status_code == 200 and r.text.count("data: ") == 3 and r.text.endswith("data: [DONE]\n\n"), r.text
    assert '"error"' not in r.text
    assert 'expresslane_router_upstream_errors_total{lane="native"' not in metrics  # no timeout, no stall
    assert hits == ["prefill"]  # served at the first try


async def test_a_full_pool_is_the_routers_own_503_and_the_probes_keep_their_budget():
    release = asyncio.Event()
    decode_calls = 0

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    async def completions(request: web.Request) -> web.Response:  # a non-streamed decode leg that takes a while
        nonlocal decode_calls
        decode_calls += 1
        await release.wait()
        return web.json_response({"id": "d", "object": "text_completion", "choices": [
            {"index": 0, "text": "ok", "finish_reason": "length"}], "usage": {"prompt_tokens": 3,
                                                                              "completion_tokens": 1}})

    hits: list[str] = []
    async with serving(_prefill_routes(hits)) as prefill, serving(
            [web.get("/health", health), web.post("/v1/completions", completions)]) as native:
        cfg = parse_config(_config(prefill, native, upstream={"max_connections": 2},
                                   timeouts={"connect_s": 0.3, "prefill_s": 10, "decode_s": 10},
                                   outlier={"consecutive_gateway_failure": 1, "consecutive_5xx": 1}))
        reg = CollectorRegistry()
        app = create_app(cfg, registry=reg)
        async with app.router.lifespan_context(app):
            async with await _client(app) as c:
                body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
                holding = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(2)]
                for _ in range(100):  # both decode legs hold the pool's two connections
                    if decode_calls == 2:
                        break
                    await asyncio.sleep(0.02)
                probes_before = reg.get_sample_value("expresslane_router_health_probes_total",
                                                     {"lane": "native", "node": native.split("://")[1],
                                                      "result": "passed"})
                refused = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(3)))
                await asyncio.sleep(0.5)  # several probe rounds while the pool is full
                probes_after = reg.get_sample_value("expresslane_router_health_probes_total",
                                                    {"lane": "native", "node": native.split("://")[1],
                                                     "result": "passed"})
                health = app.state.health
                healthy = health.routable("native", native) and health.routable("prefill", prefill)
                release.set()
                held = await asyncio.gather(*holding)
                saturated = reg.get_sample_value("expresslane_router_upstream_pool_saturated_total",
                                                 {"client": "oneshot"})
                decisions = [s for m in reg.collect() if m.name == "expresslane_router_outlier_decisions"
                             for s in m.samples if s.name.endswith("_total")]
    for r in refused:
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        err = r.json()["error"]
        assert err["code"] == "router_saturated" and "127.0.0.1" not in err["message"]
    assert [r.status_code for r in held] == [200, 200]
    assert saturated == 3
    assert probes_after > probes_before and healthy  # the probes were never starved
    assert decisions == []  # nothing counted against any node
