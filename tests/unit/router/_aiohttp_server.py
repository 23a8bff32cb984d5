"""A real local aiohttp server for the router's upstream-client tests: a free port, the app's lifetime, and
the handlers both upstream test modules share (echo with the request seen, gzip, slow)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
from collections.abc import AsyncIterator

from aiohttp import web


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def echo(seen: list[dict]):
    """Replies {"echo": body, "choices": [...]} and records the body and headers it got."""
    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append({"body": body, "headers": request.headers.copy()})
        return web.json_response({"echo": body, "choices": [{"text": "ok"}]})
    return handler


async def gz(request: web.Request) -> web.Response:
    return web.Response(body=gzip.compress(json.dumps({"z": 1}).encode()),
                        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})


async def slow(request: web.Request) -> web.Response:
    await asyncio.sleep(2)
    return web.json_response({})


@contextlib.asynccontextmanager
async def serving(routes: list[web.RouteDef]) -> AsyncIterator[str]:
    """Serve `routes` on 127.0.0.1 for the block; yields the base URL."""
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
