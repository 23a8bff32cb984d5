"""The router's client-facing keep-alive (issue 42, "Keep-alive"): a client with httpx's defaults (the openai SDK's
too: a pooled connection is reused for 5 s after its last reply) never races the router closing an idle connection.

The bursts' "server disconnected without sending a response": uvicorn's default `timeout_keep_alive` is 5 s, the
same as the clients' pool expiry, so a connection idle for ~5 s was reused by the client just as the server closed
it. The router's idle timeout (`listen.keepalive_timeout_s`) defaults to 75 s, longer than any client keeps an idle
connection (load balancers do the same: nginx 75 s, AWS ALB 60 s), and uvicorn arms it only while a connection is
idle, never with a request in flight.

The test sends after idle gaps around the clients' 5 s (4.8 to 5.2 s, twice each) and after 60 s, one pooled client
per gap, all clients at once: about a minute of wall time, nearly all of it asleep. The race itself needs a busy
loop to show (6 of 1,536 burst requests lost to it; 0 of 40 requests at 4.9-5.05 s gaps against uvicorn's 5 s on an
idle host): what fails for certain if the setting regresses is the first test, on the default itself."""

from __future__ import annotations

import asyncio

import httpx

from expresslane.router.config import Listen
from expresslane.router.server.serving import RouterServer, server_config

from ._asgi import Serving, free_port, serve_lifespan

GAPS_S = (4.8, 4.9, 5.0, 5.1, 5.2, 60.0)


async def _app(scope, receive, send):
    if scope["type"] == "lifespan":
        return await serve_lifespan(receive, send)
    if scope["path"] == "/slow":  # a request in flight for longer than a short keep-alive
        await asyncio.sleep(2.5)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _serving(keepalive_s: float) -> tuple[Serving, str]:
    port = free_port()
    cfg = server_config(_app, host="127.0.0.1", port=port, log_level="warning", keepalive_s=keepalive_s)
    return Serving(RouterServer(cfg)), f"http://127.0.0.1:{port}"


def test_the_default_idle_timeout_outlasts_every_clients_pool_expiry():
    assert Listen().keepalive_timeout_s >= 65
    assert httpx.Limits().keepalive_expiry == 5.0  # what the clients keep (httpx's default; the openai SDK's too)


async def test_a_client_with_httpx_defaults_never_sees_a_protocol_error_after_idle_gaps():
    serving, url = _serving(Listen().keepalive_timeout_s)
    errors: list[str] = []
    reused = 0

    async def one_client(gap_s: float) -> None:
        nonlocal reused
        async with httpx.AsyncClient(trust_env=False, timeout=10) as c:  # httpx's default pool and expiry
            for i in range(3 if gap_s < 10 else 2):
                if i:
                    await asyncio.sleep(gap_s)
                try:
                    r = await c.get(url + "/")
                    assert r.status_code == 200 and r.text == "ok"
                except httpx.HTTPError as e:  # RemoteProtocolError: "Server disconnected without sending a response"
                    errors.append(f"gap {gap_s}s: {type(e).__name__}: {e}")
            reused += 1

    try:
        await asyncio.gather(*(one_client(g) for g in GAPS_S))
    finally:
        serving.stop()
    assert errors == [] and reused == len(GAPS_S)


async def test_the_idle_timeout_never_closes_a_connection_with_a_request_in_flight():
    serving, url = _serving(1.0)  # far shorter than the request
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
            r = await c.get(url + "/slow")
            assert r.status_code == 200 and r.text == "ok"
            r = await c.get(url + "/")  # the same connection, reused within the second it stays open
            assert r.status_code == 200
    finally:
        serving.stop()
