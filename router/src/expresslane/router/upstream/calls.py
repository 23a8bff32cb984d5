"""One-shot upstream calls, and streams opened through the router's httpx.AsyncClient.

One-shot calls (the prefill legs, the native lane's non-streaming decode leg, health probes) go through a `OneShotCalls`:
the router's own keep-alive HTTP/1.1 client (`h1_pool.H1Pool`, no httpx objects on that path) or, given another
httpx transport (tests: httpx.MockTransport), `HttpxOneShot` over the router's httpx.AsyncClient. Both raise the
same typed errors (errors.py: `status_error` and `json_object` are the one mapping of a reply).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx

from .errors import check_status, map_transport_error, read_json, total_timeout_error

__all__ = ["HttpxOneShot", "OneShotCalls", "open_stream", "post_json"]


class OneShotCalls(Protocol):
    async def post_json(self, url: str, body: dict, *, stage: str, timeout: httpx.Timeout,
                        headers: dict[str, str] | None = None) -> dict[str, Any]:
        """POST a JSON body, read the whole JSON-object reply, every failure typed (module docstring)."""

    async def get_status(self, url: str, *, timeout: httpx.Timeout, headers: dict[str, str] | None = None) -> int:
        """GET, read and drop the body, the status; failures as httpx's exceptions (health.py maps them)."""


class HttpxOneShot:
    """OneShotCalls over an httpx.AsyncClient (whatever its transport)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def post_json(self, url: str, body: dict, *, stage: str, timeout: httpx.Timeout,
                        headers: dict[str, str] | None = None) -> dict[str, Any]:
        return await post_json(self.client, url, body, stage=stage, timeout=timeout, headers=headers)

    async def get_status(self, url: str, *, timeout: httpx.Timeout, headers: dict[str, str] | None = None) -> int:
        return (await self.client.get(url, headers=headers, timeout=timeout)).status_code


async def post_json(client: httpx.AsyncClient, url: str, body: dict, *, stage: str,
                    timeout: httpx.Timeout, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """POST, read the whole JSON reply. The call as a whole is bounded by timeout.read too (httpx's read
    timeout is per read: a reply that trickles in would otherwise outlive the request's deadline)."""
    total = timeout.read
    try:
        async with asyncio.timeout(total):
            resp = await client.post(url, json=body, timeout=timeout, headers=headers)
            await check_status(resp, stage=stage)
    except httpx.HTTPError as e:
        raise map_transport_error(e, stage=stage, url=url) from None
    except TimeoutError:
        raise total_timeout_error(url, total, stage=stage) from None
    return read_json(resp, stage=stage)


@contextlib.asynccontextmanager
async def open_stream(client: httpx.AsyncClient, url: str, body: dict, *, stage: str,
                      timeout: httpx.Timeout, headers: dict[str, str] | None = None) -> AsyncIterator[httpx.Response]:
    """POST and yield the 2xx streaming reply (headers received, body unread); closes it on exit."""
    try:
        req = client.build_request("POST", url, json=body, timeout=timeout, headers=headers)
        resp = await client.send(req, stream=True)
    except httpx.HTTPError as e:
        raise map_transport_error(e, stage=stage, url=url) from None
    try:
        await check_status(resp, stage=stage)
        yield resp
    finally:
        await resp.aclose()
