"""The transport error of the bursts (issue: "ejected: transport" after one failed request), reproduced with a real
uvicorn upstream (what vLLM and the express node serve with) on its own thread.

uvicorn closes a connection idle for `timeout_keep_alive` (5 s in vLLM; 1 s here), counted from when it SENT the
reply. The router's pool counts idleness from when it READ the reply; on a busy router that is later. With the
router's expiry equal to the server's (as both clients had: aiohttp 5 s), a connection the router still calls
fresh is one the server is closing: when the router's loop is busy across that close, the next POST goes out on
it and fails with "Server disconnected" (no reply byte, the request never processed). The router's
`timeouts.upstream_keepalive_s` (2 s, against the servers' 5 s) keeps a margin of the same proportion here."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from expresslane.router.upstream.aiohttp_transport import AiohttpTransport
from expresslane.router.config import Timeouts
from expresslane.router.upstream.h1_pool import H1Pool

from ._aiohttp_server import free_port

SERVER_KEEPALIVE_S = 1.0  # the upstream's idle close (vLLM's is 5 s)
MARGIN = Timeouts().upstream_keepalive_s / 5.0  # the router's default, as a share of vLLM's 5 s


@pytest.fixture(scope="module")
def uvicorn_upstream():
    async def answer(request):
        await asyncio.sleep(0.1)
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/v1/completions", answer, methods=["POST"])])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=SERVER_KEEPALIVE_S))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(300):
        if server.started:
            break
        time.sleep(0.01)
    assert server.started, "uvicorn did not start within 3 s"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


async def _busy_router_reuse(call) -> str:
    """One call whose reply is read ~0.25 s late (the loop busy), then idle with the loop free, then the loop busy
    for 0.45 s across the server's close, then the next call: "ok" or the error it raised."""
    task = asyncio.ensure_future(call())
    await asyncio.sleep(0.05)  # the request is on the wire; the server answers at ~0.1 s
    time.sleep(0.3)  # the loop busy while the reply arrives: read ~0.25 s after it was sent
    await task
    await asyncio.sleep(0.5)
    time.sleep(0.45)  # busy across the server's close (its idle clock ~0.75 s -> 1.2 s; the router's 0.95 s)
    try:
        await call()
        return "ok"
    except Exception as e:  # noqa: BLE001  (the test reports what the client saw)
        return f"{type(e).__name__}: {e}"


def _calls(kind: str, url: str, expiry_s: float):
    if kind == "h1":
        pool = H1Pool(keepalive_expiry_s=expiry_s)

        async def call():
            await pool.post_json(url + "/v1/completions", {}, stage="decode", timeout=httpx.Timeout(5, connect=2))
        return call, pool.aclose
    client = httpx.AsyncClient(transport=AiohttpTransport(keepalive_expiry_s=expiry_s), trust_env=False,
                               timeout=httpx.Timeout(5, connect=2))

    async def call():
        (await client.post(url + "/v1/completions", json={})).raise_for_status()
    return call, client.aclose


@pytest.mark.parametrize("kind", ["aiohttp", "h1"])
async def test_an_expiry_equal_to_the_servers_reuses_a_closing_connection(uvicorn_upstream, kind):
    """The cause, shown: expiry == the server's keep-alive -> the second POST fails without a reply."""
    call, close = _calls(kind, uvicorn_upstream, SERVER_KEEPALIVE_S)
    try:
        got = await _busy_router_reuse(call)
    finally:
        await close()
    assert "disconnected" in got.lower(), got


@pytest.mark.parametrize("kind", ["aiohttp", "h1"])
async def test_the_routers_keepalive_margin_never_reuses_a_closing_connection(uvicorn_upstream, kind):
    call, close = _calls(kind, uvicorn_upstream, SERVER_KEEPALIVE_S * MARGIN)
    try:
        assert await _busy_router_reuse(call) == "ok"
    finally:
        await close()
