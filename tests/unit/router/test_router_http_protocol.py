"""http_protocol.RouterHttpProtocol: the same bytes as uvicorn's own httptools protocol for every kind of reply, and
a reply of a known length in one write.

Two real servers on real ports serve one ASGI app: `RouterServer` (our protocol) and a stock `uvicorn.Server`
(uvicorn's `HttpToolsProtocol`). Each case is raw HTTP/1.1 bytes sent on a fresh connection to both; what comes
back until the server closes (or a quiet period) must be equal but the Date header. The cases cover what the
held head could break: JSON replies, an empty body, HEAD, 204, `Expect: 100-continue`, a streamed chunked reply,
an app that fails after its head (uvicorn closes: the head must still go out), one that returns mid-body,
pipelined and keep-alive requests, `Connection: close`, HTTP/1.0. A counting transport under our protocol then
checks the number of writes: one per reply with a body of a known length, the stream's head on its own.
"""

from __future__ import annotations

import asyncio
import re
import socket

import pytest
import uvicorn

from expresslane.router.server.http_protocol import ReplyState, ReplyTransport, RouterHttpProtocol
from expresslane.router.server.serving import RouterServer

from ._asgi import Serving, free_port, serve_lifespan


async def _app(scope, receive, send):
    if scope["type"] == "lifespan":
        return await serve_lifespan(receive, send)
    path = scope["path"]
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if path == "/json":
        out = b'{"echo":%d}' % len(body)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(out))]})
        await send({"type": "http.response.body", "body": out})
    elif path == "/empty":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
    elif path == "/nocontent":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    elif path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for i in range(3):
            await asyncio.sleep(0.01)
            await send({"type": "http.response.body", "body": b"chunk %d\n" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    elif path == "/parts":  # a known length sent in two body messages
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10")]})
        await send({"type": "http.response.body", "body": b"hello", "more_body": True})
        await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"world"})
    elif path == "/fail-after-head":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
        raise RuntimeError("the app broke after its head")
    elif path == "/return-mid-body":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10")]})
        await send({"type": "http.response.body", "body": b"hello", "more_body": True})
    elif path == "/close":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": b"ok"})
    else:
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"9")]})
        await send({"type": "http.response.body", "body": b"not found"})


class _Writes:
    """The real transport, counting what is written through it."""

    def __init__(self, transport, log: list[bytes]) -> None:
        self._transport, self._log = transport, log

    def write(self, data: bytes) -> None:
        self._log.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name):
        return getattr(self._transport, name)


WRITES: list[bytes] = []


class _CountingProtocol(RouterHttpProtocol):
    def connection_made(self, transport) -> None:
        super().connection_made(_Writes(transport, WRITES))


def _config(port: int) -> uvicorn.Config:
    return uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="critical", log_config=None,
                          http="httptools", loop="uvloop")


@pytest.fixture(scope="module")
def servers():
    ours_port, stock_port, counted_port = free_port(), free_port(), free_port()
    ours = Serving(RouterServer(_config(ours_port)))
    stock = Serving(uvicorn.Server(_config(stock_port)))
    counted_server = RouterServer(_config(counted_port))
    counted_server.config.http = _CountingProtocol
    counted = Serving(counted_server)
    yield {"ours": ours_port, "stock": stock_port, "counted": counted_port}
    for s in (ours, stock, counted):
        s.stop()


def _exchange(port: int, raw: bytes, *, quiet_s: float = 0.3) -> bytes:
    """Send raw bytes; read until the server closes or nothing comes for `quiet_s`."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(raw)
        s.settimeout(quiet_s)
        out = b""
        while True:
            try:
                data = s.recv(65536)
            except TimeoutError:
                return out
            if not data:
                return out
            out += data


_DATE = re.compile(rb"\r\ndate: [^\r]*", re.I)


def _req(path: str, *, method: str = "GET", body: bytes = b"", extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    length = b"Content-Length: %d\r\n" % len(body) if body or method == "POST" else b""
    return (b"%s %s HTTP/%s\r\nHost: x\r\n%s%s\r\n" % (method.encode(), path.encode(), version, length, extra)) + body


CASES = {
    "json": _req("/json", method="POST", body=b'{"a": 1}'),
    "json-keep-alive-twice": _req("/json") + b"",  # sent twice below
    "empty-body": _req("/empty"),
    "head": _req("/json", method="HEAD"),
    "no-content-204": _req("/nocontent"),
    "not-found": _req("/nope"),
    "100-continue": _req("/json", method="POST", body=b"12345", extra=b"Expect: 100-continue\r\n"),
    "chunked-request": (b"POST /json HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"),
    "stream": _req("/stream"),
    "known-length-in-parts": _req("/parts"),
    "fail-after-head": _req("/fail-after-head"),
    "return-mid-body": _req("/return-mid-body"),
    "connection-close-by-app": _req("/close"),
    "connection-close-by-client": _req("/json", extra=b"Connection: close\r\n"),
    "http-1.0": _req("/json", version=b"1.0"),
    "pipelined-three": _req("/json") + _req("/stream") + _req("/json", method="POST", body=b"xy"),
    "bad-request": b"GET /json HTTP/1.1\r\nHost x\r\n\r\n",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_our_protocol_sends_uvicorns_bytes(servers, name):
    raw = CASES[name] * (2 if name == "json-keep-alive-twice" else 1)
    ours = _exchange(servers["ours"], raw)
    stock = _exchange(servers["stock"], raw)
    assert stock  # every case gets an answer of some kind
    assert _DATE.sub(b"", ours) == _DATE.sub(b"", stock), (ours, stock)


def test_a_reply_of_known_length_is_one_write_and_a_stream_head_is_not_held(servers):
    port = servers["counted"]
    WRITES.clear()
    reply = _exchange(port, _req("/json", method="POST", body=b'{"a": 1}'))
    assert len(WRITES) == 1 and WRITES[0] == reply  # head and body together
    WRITES.clear()
    reply = _exchange(port, _req("/stream"))
    assert len(WRITES) == 5 and WRITES[0].endswith(b"\r\n\r\n") and b"chunk 0" not in WRITES[0]  # head, 3 chunks, end
    WRITES.clear()
    reply = _exchange(port, _req("/json", method="POST", body=b"12345", extra=b"Expect: 100-continue\r\n"))
    assert WRITES[0] == b"HTTP/1.1 100 Continue\r\n\r\n" and len(WRITES) == 2  # the interim reply, then one write
    WRITES.clear()
    reply = _exchange(port, _req("/parts"))
    assert len(WRITES) == 2 and WRITES[0].endswith(b"\r\n\r\nhello") and WRITES[1] == b"world"
    WRITES.clear()
    reply = _exchange(port, _req("/fail-after-head"))
    assert len(WRITES) == 1 and WRITES[0] == reply and reply.endswith(b"\r\n\r\n")  # the head, written at close
    WRITES.clear()
    reply = _exchange(port, _req("/json", method="HEAD") + _req("/empty"))
    sent = [w for w in WRITES if w]  # (uvicorn writes the empty body as b"")
    assert len(sent) == 2 and b"".join(sent) == reply  # nothing held without a body to come


def test_the_reply_transport_states():
    class _T:
        def __init__(self):
            self.out, self.closed = [], False

        def write(self, data):
            self.out.append(data)

        def close(self):
            self.closed = True

    class _Cycle:
        response_started, chunked_encoding, expected_content_length, scope = False, None, 0, {"method": "POST"}

    t, c = _T(), _Cycle()
    rt = ReplyTransport(t, c)
    rt.write(b"interim")  # before the reply starts: straight through
    assert t.out == [b"interim"] and rt.state is ReplyState.PASS
    c.response_started, c.chunked_encoding, c.expected_content_length = True, False, 4
    rt.write(b"head")
    assert t.out == [b"interim"] and rt.state is ReplyState.HELD
    rt.close()  # a held head goes out before the close
    assert t.out == [b"interim", b"head"] and t.closed and rt.state is ReplyState.SENT
