"""Calling upstreams (vLLM servers, express nodes) with one error mapping.

connect refused / DNS / pool exhausted -> UpstreamUnavailable (503)
read/write/connect timeout             -> UpstreamTimeout (504)
4xx                                    -> UpstreamRejected (relayed unchanged)
503                                    -> UpstreamUnavailable
other non-2xx, non-JSON 2xx, bad shape -> UpstreamError (502)

`AiohttpTransport` is an httpx transport on aiohttp's connection pool (give it to the router's
httpx.AsyncClient): the same client API, the lanes and tests unchanged, and about half the CPU per upstream call
(httpcore's pool and HTTP/1.1 state machine are most of httpx's cost; measured in the ops report of issue 15.7).
aiohttp's errors come back as the httpx exceptions map_transport_error knows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from .errors import UpstreamError, UpstreamRejected, UpstreamTimeout, UpstreamUnavailable
from .resilience import Deadline, DeadlineExceeded

__all__ = ["AiohttpTransport", "LineReader", "open_stream", "post_json", "map_transport_error", "check_status",
           "read_json"]


def map_transport_error(exc: httpx.HTTPError, *, stage: str, url: str) -> UpstreamError:
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.PoolTimeout):
        return UpstreamTimeout(f"{stage}: {url} did not answer in time ({type(exc).__name__})",
                               stage=stage, kind="timeout")
    if isinstance(exc, (httpx.ConnectError, httpx.PoolTimeout)):
        return UpstreamUnavailable(f"{stage}: cannot connect to {url} ({exc or type(exc).__name__})",
                                   stage=stage, kind="connect")
    return UpstreamError(f"{stage}: {url} failed: {type(exc).__name__}: {exc}", stage=stage, kind="transport")


async def check_status(resp: httpx.Response, *, stage: str) -> None:
    """Raise the mapped error for a non-2xx reply (reads the body of a streamed reply first)."""
    if resp.is_success:
        return
    content = await resp.aread()
    if 400 <= resp.status_code < 500:
        raise UpstreamRejected(resp.status_code, content, resp.headers.get("content-type"), stage=stage)
    detail = content[:300].decode("utf-8", "replace")
    cls = UpstreamUnavailable if resp.status_code == 503 else UpstreamError
    raise cls(f"{stage}: upstream answered {resp.status_code}: {detail}", stage=stage, kind=f"http_{resp.status_code}")


def read_json(resp: httpx.Response, *, stage: str) -> dict[str, Any]:
    try:
        data = resp.json()
    except (ValueError, UnicodeDecodeError):
        raise UpstreamError(f"{stage}: upstream reply is not JSON", stage=stage) from None
    if not isinstance(data, dict):
        raise UpstreamError(f"{stage}: upstream reply is not a JSON object", stage=stage)
    return data


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
        raise UpstreamTimeout(f"{stage}: {url} did not answer within {total:g}s", stage=stage,
                              kind="timeout") from None
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


async def iter_lines(resp: httpx.Response, *, stage: str, url: str) -> AsyncIterator[str]:
    try:
        async for line in resp.aiter_lines():
            yield line
    except httpx.HTTPError as e:
        raise map_transport_error(e, stage=stage, url=url) from None


class LineReader:
    """The lines of a streamed reply, every wait bounded: the first line by `first_s`, each later one by
    `next_s` (the stall timeout), all of them by the request's deadline. A wait that runs out raises
    UpstreamTimeout kind "stall" (or "deadline"); a broken connection the mapped transport error."""

    def __init__(self, resp: httpx.Response, *, stage: str, url: str, first_s: float, next_s: float,
                 deadline: Deadline):
        self._it = resp.aiter_lines().__aiter__()
        self.stage, self.url = stage, url
        self._first_s, self._next_s, self._deadline = first_s, next_s, deadline
        self.lines = 0

    async def next(self) -> str | None:
        """The next line, or None at the end of the stream."""
        want = self._first_s if self.lines == 0 else self._next_s
        try:
            budget = self._deadline.budget(want)
            async with asyncio.timeout(budget):
                line = await self._it.__anext__()
        except StopAsyncIteration:
            return None
        except DeadlineExceeded as e:
            raise UpstreamTimeout(f"{self.stage}: {e}", stage=self.stage, kind="deadline") from None
        except TimeoutError:
            if self._deadline.left() <= 0:
                raise UpstreamTimeout(f"{self.stage}: the request deadline ({self._deadline.total_s:g}s) passed",
                                      stage=self.stage, kind="deadline") from None
            raise UpstreamTimeout(f"{self.stage}: {self.url} sent nothing for {want:g}s (stalled)",
                                  stage=self.stage, kind="stall") from None
        except httpx.HTTPError as e:
            raise map_transport_error(e, stage=self.stage, url=self.url) from None
        self.lines += 1
        return line

    async def __aiter__(self) -> AsyncIterator[str]:
        while (line := await self.next()) is not None:
            yield line


def loads_line(line: str, *, stage: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except ValueError:
        raise UpstreamError(f"{stage}: bad line from upstream: {line[:200]!r}", stage=stage) from None
    if not isinstance(obj, dict):
        raise UpstreamError(f"{stage}: bad line from upstream: {line[:200]!r}", stage=stage)
    return obj


class _AiohttpBody(httpx.AsyncByteStream):
    """A reply body read from aiohttp, chunk by chunk; aiohttp's errors as httpx's."""

    def __init__(self, resp: Any, request: httpx.Request) -> None:
        self._resp, self._request = resp, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        import aiohttp

        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as e:
            raise httpx.ReadTimeout(str(e) or "read timed out", request=self._request) from e
        except aiohttp.ClientError as e:
            raise httpx.ReadError(str(e) or type(e).__name__, request=self._request) from e

    async def aclose(self) -> None:
        self._resp.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx requests sent through one aiohttp ClientSession (made on first use, inside the running loop).
    Timeouts: httpx's connect (aiohttp's includes the wait for a pool slot) and read (per socket read);
    no redirects, no cookies, no proxies from the environment, no decompression (httpx decodes)."""

    def __init__(self, *, max_connections: int = 512, keepalive_expiry_s: float = 5.0) -> None:
        self._max_connections = max_connections
        self._keepalive_s = keepalive_expiry_s
        self._session: Any = None

    def _get_session(self) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=self._keepalive_s),
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False, trust_env=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        import aiohttp

        timeout = _client_timeout(request.extensions.get("timeout") or {})
        body = await request.aread()
        try:
            resp = await self._get_session().request(
                request.method, str(request.url), headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw], data=body or None,
                timeout=timeout, allow_redirects=False, compress=None)
        except aiohttp.ConnectionTimeoutError as e:
            raise httpx.ConnectTimeout(str(e) or "connect timed out", request=request) from e
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as e:
            raise httpx.ReadTimeout(str(e) or "read timed out", request=request) from e
        except aiohttp.ClientConnectorError as e:
            raise httpx.ConnectError(str(e), request=request) from e
        except aiohttp.ClientError as e:
            raise httpx.RemoteProtocolError(str(e) or type(e).__name__, request=request) from e
        return httpx.Response(resp.status, headers=list(resp.raw_headers), stream=_AiohttpBody(resp, request),
                              request=request, extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _client_timeout(t: dict[str, float | None]) -> Any:
    """httpx's timeout dict as aiohttp's. aiohttp's `connect` covers the wait for a pool slot AND the TCP
    connect, so it is httpx's connect timeout alone: adding httpx's pool timeout (the client default, decode_s)
    would let a connect to a dead host wait minutes instead of connect_s."""
    import aiohttp

    connect = t.get("connect")
    return aiohttp.ClientTimeout(total=None, connect=connect if connect is not None else t.get("pool"),
                                 sock_read=t.get("read"))
