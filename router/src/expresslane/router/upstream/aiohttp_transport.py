"""The router's streaming upstream pool: one aiohttp ClientSession as an httpx transport (`handle_async_request`)
under the router's httpx.AsyncClient, for everything but the one-shot calls (streams, the express node's control
calls, the endpoints beside completions). The one-shot calls (prefill legs, the native lane's non-streaming decode
leg, health probes) have their own client, h1_pool.H1Pool (docs/bench/2026-12-01-router-h1pool/).

aiohttp's errors become the httpx exceptions of the same meaning (`httpx_error`), which
`errors.map_transport_error` maps. Timeouts: httpx's connect (aiohttp's includes the wait for a pool slot) and
read (per socket read); no redirects, no cookies, no proxies from the environment.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import httpx

__all__ = ["AiohttpTransport"]


def httpx_error(exc: BaseException, request: httpx.Request | None = None, *, reading: bool = False) -> httpx.HTTPError:
    """aiohttp's failure as the httpx exception of the same meaning (reading: while the reply body came in)."""
    msg = str(exc)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(msg or "connect timed out", request=request)
    if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return httpx.ReadTimeout(msg or "read timed out", request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(msg, request=request)
    if reading:
        return httpx.ReadError(msg or type(exc).__name__, request=request)
    return httpx.RemoteProtocolError(msg or type(exc).__name__, request=request)


def _client_timeout(connect: float | None, read: float | None, pool: float | None = None) -> aiohttp.ClientTimeout:
    """httpx's timeouts as aiohttp's. aiohttp's `connect` covers the wait for a pool slot AND the TCP
    connect, so it is httpx's connect timeout alone: adding httpx's pool timeout (the client default, decode_s)
    would let a connect to a dead host wait minutes instead of connect_s."""
    return aiohttp.ClientTimeout(total=None, connect=connect if connect is not None else pool, sock_read=read)


class _AiohttpBody(httpx.AsyncByteStream):
    """A reply body read from aiohttp, chunk by chunk; aiohttp's errors as httpx's."""

    def __init__(self, resp: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._resp, self._request = resp, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            raise httpx_error(e, self._request, reading=True) from e

    async def aclose(self) -> None:
        self._resp.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One aiohttp ClientSession (made on first use, inside the running loop); closed by the httpx client."""

    def __init__(self, *, max_connections: int = 512, keepalive_expiry_s: float = 2.0) -> None:
        self._max_connections = max_connections
        self._keepalive_s = keepalive_expiry_s
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=self._keepalive_s),
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False, trust_env=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))
        return self._session

    # ---- as an httpx transport ----------------------------------------------------------------------
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        t = request.extensions.get("timeout") or {}
        body = await request.aread()
        try:
            resp = await self._get_session().request(
                request.method, str(request.url),
                headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw],
                data=body or None, timeout=_client_timeout(t.get("connect"), t.get("read"), t.get("pool")),
                allow_redirects=False, compress=None)
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            raise httpx_error(e, request) from e
        return httpx.Response(resp.status, headers=list(resp.raw_headers), stream=_AiohttpBody(resp, request),
                              request=request, extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
