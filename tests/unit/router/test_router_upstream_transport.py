"""upstream.AiohttpTransport under the router's httpx client, against a real local aiohttp server: the same
replies, streams and typed errors as httpx's own transport."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from expresslane.router.errors import UpstreamRejected, UpstreamTimeout, UpstreamUnavailable
from expresslane.router.resilience import Deadline
from expresslane.router.upstream.aiohttp_transport import AiohttpTransport
from expresslane.router.upstream.calls import open_stream, post_json
from expresslane.router.upstream.lines import LineReader

web = pytest.importorskip("aiohttp.web")
from ._aiohttp_server import echo, free_port, gz, serving, slow  # noqa: E402




@pytest.fixture()
async def server():
    seen: list[dict] = []

    async def rejected(request):
        return web.json_response({"error": "bad"}, status=400)

    async def stream(request):
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(json.dumps({"t": [i]}).encode() + b"\n")
            await asyncio.sleep(0.01)
        if request.query.get("stall"):
            await asyncio.sleep(3)
        await resp.write_eof()
        return resp

    async with serving([web.post("/v1/completions", echo(seen)), web.post("/rejected", rejected),
                        web.post("/gz", gz), web.post("/slow", slow), web.post("/stream", stream)]) as url:
        yield url, seen


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=AiohttpTransport(), trust_env=False, timeout=httpx.Timeout(5, connect=2))


T = httpx.Timeout(5, connect=2)


async def test_json_roundtrip_with_headers_and_many_calls_on_one_pool(server):
    url, seen = server
    async with _client() as c:
        for i in range(20):
            out = await post_json(c, url + "/v1/completions", {"i": i, "s": "é🦙"}, stage="prefill", timeout=T,
                                  headers={"Authorization": "Bearer k", "X-Request-Id": f"r{i}"})
            assert out["echo"] == {"i": i, "s": "é🦙"}
        gz = await post_json(c, url + "/gz", {}, stage="prefill", timeout=T)
    assert gz == {"z": 1}  # httpx decodes (aiohttp's decompression is off)
    assert seen[-1]["headers"]["Authorization"] == "Bearer k" and seen[-1]["headers"]["X-Request-Id"] == "r19"
    assert seen[-1]["headers"]["Content-Type"] == "application/json"


async def test_stream_lines_and_stall(server):
    url, _ = server
    async with _client() as c:
        async with open_stream(c, url + "/stream", {}, stage="decode", timeout=T) as resp:
            lines = [line async for line in LineReader(resp, stage="decode", url=url, first_s=2, next_s=2,
                                                       deadline=Deadline(time.monotonic, time.monotonic(), 10))]
        assert [json.loads(x)["t"] for x in lines] == [[0], [1], [2]]
        with pytest.raises(UpstreamTimeout) as e:
            async with open_stream(c, url + "/stream?stall=1", {}, stage="decode", timeout=T) as resp:
                async for _ in LineReader(resp, stage="decode", url=url, first_s=2, next_s=0.3,
                                          deadline=Deadline(time.monotonic, time.monotonic(), 10)):
                    pass
        assert e.value.kind == "stall"


async def test_typed_errors(server):
    url, _ = server
    async with _client() as c:
        with pytest.raises(UpstreamRejected) as rej:
            await post_json(c, url + "/rejected", {}, stage="prefill", timeout=T)
        assert rej.value.status == 400 and json.loads(rej.value.content) == {"error": "bad"}
        with pytest.raises(UpstreamTimeout) as slow:  # httpx's read timeout, through aiohttp's sock_read
            await post_json(c, url + "/slow", {}, stage="prefill", timeout=httpx.Timeout(5, read=0.3, connect=2))
        assert slow.value.kind == "timeout"
        with pytest.raises(UpstreamUnavailable) as refused:
            await post_json(c, f"http://127.0.0.1:{free_port()}/x", {}, stage="prefill", timeout=T)
        assert refused.value.kind == "connect"


async def test_the_router_sends_upstream_calls_through_aiohttp_by_default(model_text):
    """FAILS until app.py's lifespan wires it (issue 15.7, ops report): `transport=transport or
    AiohttpTransport()` in the httpx.AsyncClient of create_app's lifespan (tests still pass their own)."""
    from prometheus_client import CollectorRegistry

    from expresslane.router.app import create_app

    from ._kit import make_config

    app = create_app(make_config(), registry=CollectorRegistry(), model_text=model_text)
    async with app.router.lifespan_context(app):
        assert isinstance(app.state.lanes.ctx.client._transport, AiohttpTransport)


def test_connect_timeout_is_httpx_connect_alone_not_plus_the_pool_timeout():
    """The router's client has pool = decode_s (minutes): a connect to a dead host must still give up after
    connect_s (aiohttp's connect timeout already includes the wait for a pool slot)."""
    from expresslane.router.upstream.aiohttp_transport import _client_timeout

    t = httpx.Timeout(600.0, connect=2.0)
    ct = _client_timeout(t.connect, t.read, t.pool)
    assert ct.connect == 2.0 and ct.sock_read == 600.0 and ct.total is None
    assert _client_timeout(None, None, 3.0).connect == 3.0
