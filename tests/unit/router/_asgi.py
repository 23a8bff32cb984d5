"""Small pieces the router's server-level tests share: a free loopback port, the ASGI lifespan handshake, and a
uvicorn-style server run on a thread."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn

from ._aiohttp_server import free_port

__all__ = ["Serving", "free_port", "serve_lifespan"]


class Serving:
    """A uvicorn.Server (or RouterServer) serving on its own thread: started and up on construction (30 s bound),
    stopped as uvicorn's SIGTERM handler would stop it (no signal handlers off the main thread)."""

    def __init__(self, server: uvicorn.Server) -> None:
        self.server = server
        self.thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.started

    def stop(self, timeout_s: float = 30) -> None:
        self.server.handle_exit(15, None)
        self.thread.join(timeout_s)


async def serve_lifespan(receive, send) -> None:
    """Answer an ASGI lifespan scope's startup and shutdown until shutdown."""
    while True:
        msg = await receive()
        await send({"type": msg["type"] + ".complete"})
        if msg["type"] == "lifespan.shutdown":
            return
