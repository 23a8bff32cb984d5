"""The router's one-shot calls on a small keep-alive HTTP/1.1 client: asyncio protocols and httptools' parser.

`H1Pool` is the `calls.OneShotCalls` of a running router: the prefill legs, the native lane's non-streaming
decode leg (`post_json`) and the health probes (`get_status`). aiohttp's client was about 40 % of the router's
own CPU per request before it (docs/bench/2026-12-01-router-h1pool/: request/response objects, header
multidicts, timers per read, its connector's bookkeeping); here a call is one write of the request's bytes,
httptools' C parser over the reply, one timer, and the connection back in its pool. Streams and everything
else stay on httpx over aiohttp (aiohttp_transport.AiohttpTransport).

Failures are typed exactly as on the aiohttp path (tests/unit/router/test_router_upstream_json.py runs every
case on every path, with real sockets):
  connect refused / unreachable      httpx.ConnectError     -> UpstreamUnavailable "connect"
  connect too slow                   httpx.ConnectTimeout   -> UpstreamTimeout "timeout"
  no free pool slot within connect   httpx.PoolTimeout      -> RouterSaturated "router_saturated" (the router's
                                                               own limit: never counted against the node)
  whole reply later than timeout.read                       -> UpstreamTimeout "timeout" ("did not answer within")
  reset / closed mid-body, bad gzip  httpx.ReadError        -> UpstreamError "transport"
  closed before a reply, malformed   httpx.RemoteProtocolError -> UpstreamError "transport"
then the reply through `errors.status_error` and `errors.json_object`. `get_status` raises the httpx
exceptions themselves (health.py tells timeouts from the rest). A cancelled call is a cancellation (its
connection is closed, never reused).

Measured 2026-12-07 (docs/bench/2026-12-07-one-client: router CPU per one-shot request, equal server settings, c = 1
/ 32): 0.48 / 0.37 ms with this pool, +60 % / +77 % with plain aiohttp, +194 % / +232 % through httpx over aiohttp,
+339 % / +865 % through httpx's own transport: the gain that keeps it beside the one client library. Its keep-alive expiry is the router's
`timeouts.upstream_keepalive_s` (2 s), well under the upstreams' 5 s idle close (the bursts' transport errors:
docs/operations.md).

Pool: idle connections per (scheme, host, port), at most `max_connections` open in all (a call waits for a slot
within its connect timeout, as aiohttp's limit does), an idle connection unused for `keepalive_expiry_s` is
not reused but closed (the app passes timeouts.upstream_keepalive_s, 2 s: with 4 s, under vLLM's 5 s, a reuse
still raced the server's close when the router's loop lagged by a second; test_router_keepalive.py); a reply with `Connection: close` (or HTTP/1.0 without keep-alive) closes its connection. Chunked and
Content-Length bodies, and bodies that end with the connection; gzip / deflate decoded (aiohttp's
auto_decompress). Request headers: Host, Content-Type + Content-Length (POST), the caller's, X-Request-Id
(requestlog.current_request_id): what the aiohttp path sends. No redirects, cookies or proxies.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ssl
import zlib
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httptools
import httpx

from ..server.requestlog import current_request_id
from ..json_codec import dumps_compact
from .errors import json_object, map_transport_error, status_error, total_timeout_error

__all__ = ["H1Pool"]


class _Expired(Exception):
    """The call's whole budget (timeout.read) ran out."""


@functools.lru_cache(maxsize=512)
def _target(url: str) -> tuple[tuple[str, str, int], bytes, bytes]:
    """((scheme, host, port), request-target, Host header value) of an http(s) URL."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise httpx.UnsupportedProtocol(f"not an http(s) URL: {url!r}")
    port = u.port or (443 if u.scheme == "https" else 80)
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    return (u.scheme, u.hostname, port), path.encode("ascii"), u.netloc.rsplit("@", 1)[-1].encode("ascii")


def _header_bytes(headers: dict[str, str] | None) -> bytes:
    if not headers:
        return b""
    out = []
    for k, v in headers.items():
        if "\r" in v or "\n" in v or "\r" in k or "\n" in k or ":" in k:
            raise ValueError(f"header {k!r}: CR, LF or ':' in a header")
        out.append(f"{k}: {v}\r\n")
    return "".join(out).encode("latin-1")


class _Conn(asyncio.Protocol):
    """One HTTP/1.1 connection: one request at a time, the reply parsed by httptools as it arrives."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.content_type: str | None = None
        self.encoding: bytes | None = None
        self.body: list[bytes] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.length_known = False

    # ---- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self.complete:  # bytes nobody asked for: this connection is unusable
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("upstream tried to upgrade the connection"))
        except httptools.HttpParserError as e:
            self._fail(httpx.ReadError(f"malformed reply body: {e}") if self.headers_done
                       else httpx.RemoteProtocolError(f"malformed reply: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is None or self._waiter.done():
            return
        if self.headers_done and not self.length_known and not self.complete:
            self.complete = True  # a body that ends with the connection (no length, not chunked)
            self._waiter.set_result(None)
            return
        what = f" ({exc})" if exc else ""
        if self.headers_done:
            self._waiter.set_exception(httpx.ReadError(f"connection closed in the middle of the reply{what}"))
        else:
            self._waiter.set_exception(httpx.RemoteProtocolError(f"server disconnected without a reply{what}"))

    # ---- httptools callbacks ----------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-type":
            self.content_type = value.decode("latin-1")
        elif n == b"content-encoding":
            self.encoding = value.strip().lower()
        elif n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in value.lower()):
            self.length_known = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        self.headers_done = True
        if self.status in (204, 304) or 100 <= self.status < 200:
            self.length_known = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.complete:  # a second reply to one request: this connection is unusable
            self.closed = True
            return
        self.complete = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # ---- one exchange -----------------------------------------------------------------------------
    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        self.close()

    def start(self, request: bytes) -> asyncio.Future:
        self._reset()
        self._waiter = self.loop.create_future()
        self.transport.write(request)
        return self._waiter

    def finish(self) -> None:
        self._waiter = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def content(self) -> bytes:
        data = b"".join(self.body)
        if self.encoding in (None, b"", b"identity"):
            return data
        if self.encoding in (b"gzip", b"x-gzip", b"deflate"):
            try:
                d = zlib.decompressobj(wbits=47 if self.encoding != b"deflate" else 15)
                return d.decompress(data) + d.flush()
            except zlib.error:
                if self.encoding == b"deflate":  # raw deflate, as some servers send it
                    try:
                        return zlib.decompress(data, -15)
                    except zlib.error:
                        pass
                raise httpx.DecodingError(f"cannot decode the {self.encoding.decode()} reply body") from None
        raise httpx.DecodingError(f"unsupported Content-Encoding {self.encoding.decode('latin-1')!r}")


class H1Pool:
    """Keep-alive connections to the upstreams, bounded; made inside the running loop (the router's lifespan)."""

    def __init__(self, *, max_connections: int = 512, keepalive_expiry_s: float = 2.0,
                 on_saturated: Callable[[], None] | None = None) -> None:
        self._on_saturated = on_saturated or (lambda: None)
        self._idle: dict[tuple[str, str, int], collections.deque[_Conn]] = {}
        self._slots = asyncio.Semaphore(max_connections)
        self._keepalive_s = keepalive_expiry_s
        self._open: set[_Conn] = set()
        self._ssl: ssl.SSLContext | None = None

    # ---- the OneShotCalls interface ---------------------------------------------------------------
    async def post_json(self, url: str, body: dict, *, stage: str, timeout: httpx.Timeout,
                        headers: dict[str, str] | None = None) -> dict[str, Any]:
        data = dumps_compact(body).encode()
        try:
            status, content, ctype = await self._call(b"POST", url, data, headers, timeout)
        except httpx.HTTPError as e:
            raise map_transport_error(e, stage=stage, url=url) from None
        except _Expired:
            raise total_timeout_error(url, timeout.read, stage=stage) from None
        err = status_error(status, content, ctype, stage=stage)
        if err is not None:
            raise err
        return json_object(content, stage=stage)

    async def get_status(self, url: str, *, timeout: httpx.Timeout, headers: dict[str, str] | None = None) -> int:
        try:
            return (await self._call(b"GET", url, None, headers, timeout))[0]
        except _Expired:
            raise httpx.ReadTimeout(f"{url} did not answer within {timeout.read:g}s") from None

    async def aclose(self) -> None:
        for c in list(self._open):
            c.close()
        self._open.clear()
        self._idle.clear()

    # ---- one call ---------------------------------------------------------------------------------
    async def _call(self, method: bytes, url: str, data: bytes | None, headers: dict[str, str] | None,
                    timeout: httpx.Timeout) -> tuple[int, bytes, str | None]:
        key, target, host = _target(url)
        loop = asyncio.get_running_loop()
        total = timeout.read
        deadline = None if total is None else loop.time() + total
        head = [method, b" ", target, b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
        if data is not None:
            head.append(b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(data))
        head.append(_header_bytes(headers))
        rid = current_request_id()
        if rid is not None:
            head.append(_header_bytes({"X-Request-Id": rid}))
        head.append(b"\r\n")
        if data is not None:
            head.append(data)
        request = b"".join(head)
        conn = await self._checkout(key, loop, timeout.connect, deadline)
        done = False
        try:
            waiter = conn.start(request)
            if deadline is None:
                await waiter
            else:
                handle = loop.call_at(deadline, _expire, waiter)
                try:
                    await waiter
                finally:
                    handle.cancel()
            content = conn.content()
            done = True
            return conn.status, content, conn.content_type
        finally:
            conn.finish()
            if done and conn.keep_alive and not conn.closed:
                conn.idle_since = loop.time()
                self._idle.setdefault(key, collections.deque()).append(conn)
            else:
                conn.close()
                self._open.discard(conn)
            self._slots.release()

    async def _checkout(self, key: tuple[str, str, int], loop: asyncio.AbstractEventLoop,
                        connect_s: float | None, deadline: float | None) -> _Conn:
        """An idle live connection to `key`, or a new one; holds one of the pool's slots (released by _call)."""
        if self._slots.locked():
            try:
                async with asyncio.timeout(connect_s):
                    await self._slots.acquire()
            except TimeoutError:
                self._on_saturated()
                raise httpx.PoolTimeout(f"no free connection in {connect_s:g}s: all {len(self._open)} of the "
                                        "router's upstream connections are busy") from None
        else:
            await self._slots.acquire()
        try:
            idle = self._idle.get(key)
            if idle:
                now = loop.time()
                while idle and now - idle[0].idle_since >= self._keepalive_s:  # oldest first: past keep-alive
                    self._drop(idle.popleft())
                while idle:
                    conn = idle.pop()  # the most recently used
                    if not conn.closed:
                        return conn
                    self._drop(conn)
            return await self._connect(key, loop, connect_s, deadline)
        except BaseException:
            self._slots.release()
            raise

    def _drop(self, conn: _Conn) -> None:
        conn.close()
        self._open.discard(conn)

    async def _connect(self, key: tuple[str, str, int], loop: asyncio.AbstractEventLoop, connect_s: float | None,
                       deadline: float | None) -> _Conn:
        scheme, host, port = key
        if scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()
        budget, by_deadline = connect_s, False
        if deadline is not None:
            left = deadline - loop.time()
            if budget is None or left < budget:
                budget, by_deadline = left, True
        try:
            async with asyncio.timeout(budget):
                _, conn = await loop.create_connection(lambda: _Conn(loop), host, port,
                                                       ssl=self._ssl if scheme == "https" else None)
        except TimeoutError:
            if by_deadline:
                raise _Expired() from None
            raise httpx.ConnectTimeout(f"connect to {host}:{port} took more than {budget:g}s") from None
        except OSError as e:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {e.strerror or e}") from None
        self._open.add(conn)
        return conn


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(_Expired())

