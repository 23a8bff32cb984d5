"""The router's upstream connection pool: one aiohttp ClientSession, used two ways.

- `AiohttpTransport.post_json` / `get_status`: the hot path (prefill legs, the native lane's non-streaming decode
  leg) and the health probes (every 2 s per upstream: their CPU counts too). The body
  is encoded once, sent on aiohttp's pool, the reply read whole and parsed; no httpx Request/Response objects,
  cookies or URL parsing on the way (those were about half the router's CPU per request: docs/performance.md,
  "Router hot path (session 3)"). Failures are typed exactly as on the httpx path: aiohttp's errors become the
  httpx exceptions `upstream.map_transport_error` maps, the reply goes through `upstream.status_error` and
  `upstream.json_object`, and the call as a whole is bounded by the read timeout.
- as an httpx transport (`handle_async_request`) under the router's httpx.AsyncClient for everything else
  (streams, the express node's control calls, the endpoints beside completions).

The request id (requestlog.current_request_id) goes on every call, as the httpx client's request hook does.
Timeouts: httpx's connect (aiohttp's includes the wait for a pool slot) and read (per socket read); no
redirects, no cookies, no proxies from the environment.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx

from .requestlog import current_request_id
from .upstream import json_object, map_transport_error, status_error, total_timeout_error

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

    def __init__(self, *, max_connections: int = 512, keepalive_expiry_s: float = 5.0) -> None:
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

    # ---- the hot path: one JSON POST, no httpx objects ----------------------------------------------
    async def post_json(self, url: str, body: dict, *, stage: str, timeout: httpx.Timeout,
                        headers: dict[str, str] | None = None) -> dict[str, Any]:
        """upstream.OneShotCalls: POST `body`, the JSON-object reply; typed errors as upstream.post_json's."""
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        hdrs = {"Content-Type": "application/json", **headers} if headers else {"Content-Type": "application/json"}
        rid = current_request_id()
        if rid is not None:
            hdrs["X-Request-Id"] = rid
        total = timeout.read
        reading = False
        try:
            async with asyncio.timeout(total) as scope:
                async with self._get_session().post(url, data=data, headers=hdrs, allow_redirects=False,
                                                    timeout=_client_timeout(timeout.connect, total, timeout.pool),
                                                    compress=None, auto_decompress=True) as resp:
                    reading = True
                    content = await resp.read()
                    status, ctype = resp.status, resp.headers.get("Content-Type")
        except aiohttp.ClientError as e:
            raise map_transport_error(httpx_error(e, reading=reading), stage=stage, url=url) from None
        except TimeoutError as e:
            if scope.expired():
                raise total_timeout_error(url, total, stage=stage) from None
            raise map_transport_error(httpx_error(e, reading=reading), stage=stage, url=url) from None
        err = status_error(status, content, ctype, stage=stage)
        if err is not None:
            raise err
        return json_object(content, stage=stage)

    async def get_status(self, url: str, *, timeout: httpx.Timeout, headers: dict[str, str] | None = None) -> int:
        """upstream.OneShotCalls: GET (a health probe), the status; aiohttp's failures as httpx's exceptions."""
        hdrs = dict(headers) if headers else {}
        rid = current_request_id()
        if rid is not None:
            hdrs["X-Request-Id"] = rid
        reading = False
        try:
            async with self._get_session().get(url, headers=hdrs, allow_redirects=False, auto_decompress=True,
                                               timeout=_client_timeout(timeout.connect, timeout.read, timeout.pool)
                                               ) as resp:
                reading = True
                await resp.read()
                return resp.status
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            raise httpx_error(e, reading=reading) from None

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
