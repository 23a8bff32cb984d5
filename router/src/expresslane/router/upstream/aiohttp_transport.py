"""The router's streaming upstream pool: one aiohttp ClientSession as an httpx transport (`handle_async_request`)
under the router's httpx.AsyncClient, for everything but the one-shot calls (streams, the express node's control
calls, the endpoints beside completions). The one-shot calls (prefill legs, the native lane's non-streaming decode
leg, health probes) have their own client, h1_pool.H1Pool (docs/bench/2026-12-01-router-h1pool/).

Why aiohttp under httpx (docs/bench/2026-12-07-one-client): against httpx's own transport it saves 36-59 % of a
streamed request's router CPU; plain aiohttp without httpx on top would save a further 16-19 %, under the project's
20 % bar for a second way of calling upstreams, so httpx stays the one API.

aiohttp's errors become the httpx exceptions of the same meaning (`httpx_error`), which
`errors.map_transport_error` maps. Timeouts: httpx's connect and read (per socket read); no redirects, no cookies,
no proxies from the environment. At most `max_connections` requests are open at once (each holds its slot until its
reply is closed); a request that finds none free within its connect timeout raises httpx.PoolTimeout (the router's
own saturation, `RouterSaturated`: never the node's fault). The slots are this transport's, not aiohttp's connector
limit, whose wait aiohttp counts into its connect timeout (a full pool then read as the node's timeout).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

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
    """A reply body read from aiohttp, chunk by chunk; aiohttp's errors as httpx's. Closing it frees the slot."""

    def __init__(self, resp: aiohttp.ClientResponse, request: httpx.Request, slot: "_Slot") -> None:
        self._resp, self._request, self._slot = resp, request, slot

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            raise httpx_error(e, self._request, reading=True) from e

    async def aclose(self) -> None:
        self._resp.release()
        self._slot.release()


class _Slot:
    """One of the transport's request slots, released once."""

    __slots__ = ("_sem",)

    def __init__(self, sem: asyncio.Semaphore) -> None:
        self._sem: asyncio.Semaphore | None = sem

    def release(self) -> None:
        if self._sem is not None:
            self._sem.release()
            self._sem = None


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One aiohttp ClientSession (made on first use, inside the running loop); closed by the httpx client."""

    def __init__(self, *, max_connections: int = 512, keepalive_expiry_s: float = 2.0,
                 on_saturated: Callable[[], None] | None = None) -> None:
        self._slots = asyncio.Semaphore(max_connections)
        self._keepalive_s = keepalive_expiry_s
        self._on_saturated = on_saturated or (lambda: None)
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self._keepalive_s),  # (our slots bound it)
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False, trust_env=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))
        return self._session

    # ---- as an httpx transport ----------------------------------------------------------------------
    async def _slot(self, connect_s: float | None) -> _Slot:
        if self._slots.locked():
            try:
                async with asyncio.timeout(connect_s):
                    await self._slots.acquire()
            except TimeoutError:
                self._on_saturated()
                raise httpx.PoolTimeout(f"no free connection in {connect_s:g}s: the router's upstream streams are "
                                        "all in use") from None
        else:
            await self._slots.acquire()
        return _Slot(self._slots)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        t = request.extensions.get("timeout") or {}
        body = await request.aread()
        slot = await self._slot(t.get("connect"))
        try:
            resp = await self._get_session().request(
                request.method, str(request.url),
                headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw],
                data=body or None, timeout=_client_timeout(t.get("connect"), t.get("read"), t.get("pool")),
                allow_redirects=False, compress=None)
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            slot.release()
            raise httpx_error(e, request) from e
        except BaseException:
            slot.release()
            raise
        return httpx.Response(resp.status, headers=list(resp.raw_headers), stream=_AiohttpBody(resp, request, slot),
                              request=request, extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
