"""The one-shot JSON leg (prefill legs, the native non-streaming decode leg) on its three paths, against a real local
aiohttp server: H1Pool.post_json (the router's hot path: its own keep-alive HTTP/1.1 client, h1_pool.py), and
HttpxOneShot over an httpx client on AiohttpTransport or on httpx's own transport (the reference). Every reply and every failure must
come back the same: the same dict, the same typed error with the same kind, status and relayed bytes."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from expresslane.router.upstream.aiohttp_transport import AiohttpTransport
from expresslane.router.upstream.h1_pool import H1Pool
from expresslane.router.errors import RouterError, UpstreamError, UpstreamRejected, UpstreamTimeout, UpstreamUnavailable
from expresslane.router.server.requestlog import _request_id, upstream_request_id_hook
from expresslane.router.upstream.calls import HttpxOneShot

web = pytest.importorskip("aiohttp.web")
from ._aiohttp_server import echo, free_port, gz, serving, slow  # noqa: E402

T = httpx.Timeout(5, connect=2)
PATHS = ("h1-pool", "httpx-on-aiohttp", "httpx-reference")




@pytest.fixture()
async def server():
    seen: list[dict] = []

    def status(code: int, text: str, ctype: str = "application/json"):
        async def handler(request):
            return web.Response(status=code, text=text, content_type=ctype)
        return handler

    async def trickle(request):  # every read comes in time, the whole reply does not
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"a": "')
        for _ in range(30):
            await asyncio.sleep(0.1)
            await resp.write(b"x")
        await resp.write(b'"}')
        return resp

    async def dropped(request):  # promises 100 bytes, sends 10, closes
        resp = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "100"})
        await resp.prepare(request)
        await resp.write(b'{"a": "xxx')
        request.transport.close()
        return resp

    async with serving([
        web.post("/echo", echo(seen)), web.post("/gz", gz), web.post("/slow", slow), web.post("/trickle", trickle),
        web.post("/dropped", dropped), web.get("/slow-get", slow),
        web.post("/400", status(400, '{"error": {"message": "bad", "code": 400}}')),
        web.post("/503", status(503, "overloaded", "text/plain")),
        web.post("/500", status(500, "boom", "text/plain")),
        web.post("/notjson", status(200, "<html>", "text/html")),
        web.post("/list", status(200, "[1, 2]")),
    ]) as url:
        yield url, seen


class _Poster:
    """One of the three paths, opened and closed like the router's lifespan does."""

    def __init__(self, path: str):
        self.path = path

    async def __aenter__(self):
        if self.path == "h1-pool":
            self.pool = H1Pool()
            return self.pool
        kw = {"transport": AiohttpTransport()} if self.path == "httpx-on-aiohttp" else {}
        self.client = httpx.AsyncClient(trust_env=False, timeout=T, event_hooks={"request": [upstream_request_id_hook]},
                                        **kw)
        await self.client.__aenter__()
        return HttpxOneShot(self.client)

    async def __aexit__(self, *exc):
        if self.path == "h1-pool":
            await self.pool.aclose()
        else:
            await self.client.__aexit__(*exc)


@pytest.mark.parametrize("path", PATHS)
async def test_reply_headers_and_request_id(server, path):
    url, seen = server
    token = _request_id.set("rid-42")
    try:
        async with _Poster(path) as p:
            for i in range(5):
                out = await p.post_json(url + "/echo", {"i": i, "s": "é🦙"}, stage="prefill", timeout=T,
                                        headers={"Authorization": "Bearer k"})
                assert out == {"echo": {"i": i, "s": "é🦙"}, "choices": [{"text": "ok"}]}
            assert await p.post_json(url + "/gz", {}, stage="prefill", timeout=T) == {"z": 1}
    finally:
        _request_id.reset(token)
    h = seen[-1]["headers"]
    assert h["Authorization"] == "Bearer k" and h["X-Request-Id"] == "rid-42"
    assert h["Content-Type"] == "application/json"


async def _error(p, url: str, timeout: httpx.Timeout = T) -> RouterError:
    with pytest.raises(RouterError) as e:  # UpstreamRejected (a relayed 4xx) or an UpstreamError
        await p.post_json(url, {}, stage="decode", timeout=timeout)
    return e.value


@pytest.mark.parametrize("path", PATHS)
async def test_every_failure_is_typed_the_same(server, path):
    url, _ = server
    async with _Poster(path) as p:
        rej = await _error(p, url + "/400")
        assert isinstance(rej, UpstreamRejected) and rej.status == 400
        assert json.loads(rej.content) == {"error": {"message": "bad", "code": 400}}
        e503 = await _error(p, url + "/503")
        assert isinstance(e503, UpstreamUnavailable) and e503.kind == "http_503" and "overloaded" in e503.message
        e500 = await _error(p, url + "/500")
        assert type(e500) is UpstreamError and e500.kind == "http_500" and e500.status == 502 and "boom" in e500.message
        assert "not JSON" in (await _error(p, url + "/notjson")).message
        assert "not a JSON object" in (await _error(p, url + "/list")).message
        slow = await _error(p, url + "/slow", httpx.Timeout(5, read=0.3, connect=2))  # one read waits too long
        assert isinstance(slow, UpstreamTimeout) and slow.kind == "timeout"
        trickle = await _error(p, url + "/trickle", httpx.Timeout(5, read=0.5, connect=2))  # the whole reply does
        assert isinstance(trickle, UpstreamTimeout) and trickle.kind == "timeout" and "within 0.5s" in trickle.message
        dropped = await _error(p, url + "/dropped")
        assert type(dropped) is UpstreamError and dropped.kind == "transport"
        refused = await _error(p, f"http://127.0.0.1:{free_port()}/x")
        assert isinstance(refused, UpstreamUnavailable) and refused.kind == "connect"
        # the pool still serves after every failure
        assert (await p.post_json(url + "/echo", {"ok": 1}, stage="decode", timeout=T))["echo"] == {"ok": 1}


async def test_the_router_sends_one_shot_calls_on_its_own_pool(model_text):
    """create_app's lifespan gives the lanes (and the health probes) an H1Pool as their OneShotCalls, beside the
    httpx client on AiohttpTransport, and HttpxOneShot over the client when a test passes its own transport."""
    from prometheus_client import CollectorRegistry

    from expresslane.router.app import create_app

    from ._kit import make_config

    app = create_app(make_config(), registry=CollectorRegistry(), model_text=model_text)
    async with app.router.lifespan_context(app):
        ctx = app.state.lanes.ctx
        assert isinstance(ctx.calls, H1Pool) and isinstance(ctx.client._transport, AiohttpTransport)
    app = create_app(make_config(), registry=CollectorRegistry(), model_text=model_text,
                     transport=httpx.MockTransport(lambda r: httpx.Response(500)))
    async with app.router.lifespan_context(app):
        ctx = app.state.lanes.ctx
        assert isinstance(ctx.calls, HttpxOneShot) and ctx.calls.client is ctx.client


@pytest.mark.parametrize("path", PATHS)
async def test_health_probe_status_and_failures_are_the_same(server, path):
    """get_status (health.py's probe): the status of any reply; a timeout is an httpx.TimeoutException and a
    refused connect an httpx.HTTPError on every path (probe_timeout / probe_connect)."""
    url, _ = server
    async with _Poster(path) as p:
        assert await p.get_status(url + "/echo", timeout=T) == 405  # the route is POST only
        assert await p.get_status(url + "/nowhere", timeout=T) == 404
        with pytest.raises(httpx.TimeoutException):
            await p.get_status(url + "/slow-get", timeout=httpx.Timeout(5, read=0.3, connect=2))
        with pytest.raises(httpx.HTTPError) as refused:
            await p.get_status(f"http://127.0.0.1:{free_port()}/health", timeout=T)
        assert not isinstance(refused.value, httpx.TimeoutException)


@pytest.mark.parametrize("path", PATHS)
async def test_a_cancelled_call_is_cancelled_not_mapped_and_the_pool_still_serves(server, path):
    """A client that disconnects cancels the lane's task (app.run_until_disconnect): the leg must end as a
    cancellation (never turned into a typed timeout or transport error), and the pool must keep serving."""
    url, _ = server
    async with _Poster(path) as p:
        task = asyncio.ensure_future(p.post_json(url + "/slow", {}, stage="prefill", timeout=T))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await p.post_json(url + "/echo", {"after": 1}, stage="prefill", timeout=T))["echo"] == {"after": 1}
