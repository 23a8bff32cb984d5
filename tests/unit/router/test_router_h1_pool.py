"""H1Pool (h1_pool.py), the router's keep-alive HTTP/1.1 client for one-shot calls, against raw local TCP servers
that send exactly the bytes each case needs: keep-alive reuse, Connection: close, chunked bodies, a body that ends
with the connection, HTTP/1.0, a reset in the middle of the body, a malformed reply, a server that closes without
a reply, a reply that never comes, idle expiry, the pool's bound. Every failure must be typed as on the aiohttp
path (test_router_upstream_json.py runs the common cases on all paths)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
import struct

import httpx
import pytest

from expresslane.router.errors import RouterSaturated, UpstreamError, UpstreamTimeout, UpstreamUnavailable
from expresslane.router.upstream.h1_pool import H1Pool
from expresslane.router.server.requestlog import _request_id

T = httpx.Timeout(5, connect=2)


def reply(body: bytes, *, status: str = "200 OK", headers: str = "Content-Type: application/json\r\n",
          length: bool = True, version: str = "HTTP/1.1") -> bytes:
    cl = f"Content-Length: {len(body)}\r\n" if length else ""
    return f"{version} {status}\r\n{headers}{cl}\r\n".encode() + body


class RawServer:
    """A TCP server on 127.0.0.1 that reads one HTTP request (head + Content-Length body) at a time and answers
    with `respond(request_bytes, conn_index) -> (bytes to send, then: "keep" | "close" | "reset" | "hang")`."""

    def __init__(self, respond):
        self.respond = respond
        self.connections = 0
        self.requests: list[bytes] = []
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for w in self._writers:
            w.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        idx = self.connections
        self.connections += 1
        self._writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        n = int(line.split(b":", 1)[1])
                req = head + (await reader.readexactly(n) if n else b"")
                self.requests.append(req)
                data, then = self.respond(req, idx)
                writer.write(data)
                await writer.drain()
                if then == "close":
                    writer.close()
                    return
                if then == "reset":  # RST instead of FIN
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                if then == "hang":
                    await asyncio.sleep(3600)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass


async def _err(pool: H1Pool, url: str, timeout: httpx.Timeout = T) -> UpstreamError:
    with pytest.raises(UpstreamError) as e:
        await pool.post_json(url, {"x": 1}, stage="prefill", timeout=timeout)
    return e.value


async def test_keep_alive_one_connection_for_sequential_calls_and_exact_request_bytes():
    srv = RawServer(lambda req, i: (reply(json.dumps({"n": len(srv.requests)}).encode()), "keep"))
    async with srv as url:
        pool = H1Pool()
        token = _request_id.set("rid-7")
        try:
            for i in range(1, 6):
                assert await pool.post_json(url + "/v1/completions?a=b", {"p": [1, 2], "s": "é"}, stage="prefill",
                                            timeout=T, headers={"Authorization": "Bearer k"}) == {"n": i}
            assert await pool.get_status(url + "/health", timeout=T) == 200
        finally:
            _request_id.reset(token)
            await pool.aclose()
    assert srv.connections == 1
    body = json.dumps({"p": [1, 2], "s": "é"}, ensure_ascii=False, separators=(",", ":")).encode()
    host = url.split("://")[1]
    assert srv.requests[0] == (f"POST /v1/completions?a=b HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                               f"\r\nContent-Length: {len(body)}\r\nAuthorization: Bearer k\r\nX-Request-Id: rid-7"
                               f"\r\n\r\n").encode() + body
    assert srv.requests[-1] == f"GET /health HTTP/1.1\r\nHost: {host}\r\nX-Request-Id: rid-7\r\n\r\n".encode()


@pytest.mark.parametrize("how", ["connection-close-header", "http10", "server-closes-idle"])
async def test_a_closed_connection_is_never_reused(how):
    def respond(req, i):
        if how == "connection-close-header":
            return reply(b'{"ok": 1}', headers="Content-Type: application/json\r\nConnection: close\r\n"), "keep"
        if how == "http10":
            return reply(b'{"ok": 1}', version="HTTP/1.0"), "keep"
        return reply(b'{"ok": 1}'), "close"  # keep-alive promised, closed right after

    srv = RawServer(respond)
    async with srv as url:
        pool = H1Pool()
        try:
            for _ in range(3):
                assert await pool.post_json(url + "/x", {}, stage="decode", timeout=T) == {"ok": 1}
                await asyncio.sleep(0.2)  # the server's FIN arrives (generous: CI is slower)
        finally:
            await pool.aclose()
    assert srv.connections == 3


@pytest.mark.parametrize("kind", ["chunked", "until-eof", "gzip-chunked"])
async def test_bodies_chunked_and_until_close_and_gzip(kind):
    doc = json.dumps({"text": "x" * 5000, "k": kind}).encode()

    def respond(req, i):
        if kind == "until-eof":
            return reply(doc, length=False), "close"
        data = gzip.compress(doc) if kind == "gzip-chunked" else doc
        enc = "Content-Encoding: gzip\r\n" if kind == "gzip-chunked" else ""
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(data[j:j + 700]), data[j:j + 700]) for j in range(0, len(data), 700))
        return reply(chunks + b"0\r\n\r\n", length=False,
                     headers=f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n{enc}"), "keep"

    srv = RawServer(respond)
    async with srv as url:
        pool = H1Pool()
        try:
            for _ in range(2):
                assert await pool.post_json(url + "/x", {}, stage="decode", timeout=T) == json.loads(doc)
        finally:
            await pool.aclose()
    assert srv.connections == (2 if kind == "until-eof" else 1)


async def test_every_broken_reply_is_a_typed_transport_error_and_the_pool_recovers():
    cases = {
        "/reset": (reply(b'{"a": "' + b"x" * 2000, length=False,
                         headers="Content-Type: application/json\r\nContent-Length: 9000\r\n"), "reset"),
        "/short": (b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"a": 1', "close"),
        "/garbage": (b"SMTP ready\r\n\r\n", "keep"),
        "/bad-chunk": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nxx\r\n", "keep"),
        "/nothing": (b"", "close"),
        "/bad-gzip": (reply(b"not gzip", headers="Content-Type: application/json\r\nContent-Encoding: gzip\r\n"),
                      "keep"),
    }

    def respond(req, i):
        path = req.split(b" ")[1].decode()
        return cases.get(path, (reply(b'{"ok": 1}'), "keep"))

    async with RawServer(respond) as url:
        pool = H1Pool()
        try:
            for path in cases:
                e = await _err(pool, url + path)
                assert type(e) is UpstreamError and e.kind == "transport" and e.status == 502, (path, e.message)
                assert url + path in e.message
                assert await pool.post_json(url + "/ok", {}, stage="prefill", timeout=T) == {"ok": 1}
        finally:
            await pool.aclose()
        assert not pool._open - {c for dq in pool._idle.values() for c in dq}  # nothing leaked as busy


async def test_timeouts_connect_refused_and_the_pool_bound():
    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    srv = RawServer(lambda req, i: (b"", "hang") if b"/hang" in req else (reply(b'{"ok": 1}'), "keep"))
    async with srv as url:
        pool = H1Pool(max_connections=1)
        try:
            e = await _err(pool, url + "/hang", httpx.Timeout(5, read=0.3, connect=2))
            assert isinstance(e, UpstreamTimeout) and e.kind == "timeout" and "within 0.3s" in e.message
            with pytest.raises(httpx.TimeoutException):
                await pool.get_status(url + "/hang", timeout=httpx.Timeout(5, read=0.3, connect=2))
            refused = await _err(pool, f"http://127.0.0.1:{free_port()}/x")
            assert isinstance(refused, UpstreamUnavailable) and refused.kind == "connect"
            with pytest.raises(httpx.ConnectError):
                await pool.get_status(f"http://127.0.0.1:{free_port()}/health", timeout=T)
            # the one slot is taken by a call that hangs: the next waits for it within its connect timeout, then is
            # refused by the router itself (its own saturation, never the node's timeout)
            hung = asyncio.ensure_future(pool.post_json(url + "/hang", {}, stage="decode", timeout=T))
            await asyncio.sleep(0.1)
            busy = await _err(pool, url + "/ok", httpx.Timeout(5, connect=0.2))
            assert isinstance(busy, RouterSaturated) and busy.kind == "router_saturated" and busy.status == 503
            assert busy.headers["retry-after"] == "1"
            hung.cancel()
            with pytest.raises(asyncio.CancelledError):
                await hung
            assert await pool.post_json(url + "/ok", {}, stage="decode", timeout=T) == {"ok": 1}
        finally:
            await pool.aclose()


async def test_connect_timeout_is_a_timeout():
    """A listener whose backlog is full never completes the handshake: the connect timeout bounds the wait."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(0)
    port = lst.getsockname()[1]
    fillers = []
    with contextlib.ExitStack() as stack:
        stack.callback(lst.close)
        for _ in range(4):  # fill the accept queue (nobody accepts)
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            fillers.append(s)
            stack.callback(s.close)
        pool = H1Pool()
        try:
            with pytest.raises(UpstreamError) as e:
                await pool.post_json(f"http://127.0.0.1:{port}/x", {}, stage="prefill",
                                     timeout=httpx.Timeout(5, connect=0.3))
        finally:
            await pool.aclose()
    assert e.value.kind in ("timeout", "connect")  # a SYN dropped (timeout) or refused, never a hang


async def test_idle_connections_expire():
    srv = RawServer(lambda req, i: (reply(b'{"ok": 1}'), "keep"))
    async with srv as url:
        pool = H1Pool(keepalive_expiry_s=0.2)
        try:
            await pool.post_json(url + "/x", {}, stage="decode", timeout=T)
            await pool.post_json(url + "/x", {}, stage="decode", timeout=T)
            assert srv.connections == 1
            await asyncio.sleep(0.3)
            await pool.post_json(url + "/x", {}, stage="decode", timeout=T)
            assert srv.connections == 2
            assert len(pool._open) == 1  # the expired one was closed, not kept
        finally:
            await pool.aclose()
