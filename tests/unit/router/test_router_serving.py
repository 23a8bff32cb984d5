"""serving.RouterServer: uvicorn's server with a slow housekeeping tick must still stop at once on an exit
request (the signal wakes the loop; no tick stands in for it), and serve requests meanwhile."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time

import httpx
import uvicorn

from expresslane.router.serving import RouterServer


async def _app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_exit_request_stops_the_server_without_waiting_for_its_tick():
    port = _free_port()
    server = RouterServer(uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning", log_config=None),
                          tick_s=3600.0)  # a tick would only come in an hour
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)  # no signal handlers off main
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    r = httpx.get(f"http://127.0.0.1:{port}/", trust_env=False, timeout=10)
    assert r.status_code == 200 and r.text == "ok" and "date" in r.headers
    server.handle_exit(signal.SIGTERM, None)  # what uvicorn's SIGTERM handler calls
    thread.join(timeout=30)  # generous (CI is slower); without the wake-up this waits for the hour-long tick
    assert not thread.is_alive()
