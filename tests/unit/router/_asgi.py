"""Small pieces the router's server-level tests share: a free loopback port and the ASGI lifespan handshake."""

from __future__ import annotations

from ._aiohttp_server import free_port

__all__ = ["free_port", "serve_lifespan"]


async def serve_lifespan(receive, send) -> None:
    """Answer an ASGI lifespan scope's startup and shutdown until shutdown."""
    while True:
        msg = await receive()
        await send({"type": msg["type"] + ".complete"})
        if msg["type"] == "lifespan.shutdown":
            return
