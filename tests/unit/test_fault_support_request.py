"""The integration tests' client (tests/integration/fault_support.py `request`): with `connect_retries` it tries a
connect that failed again (nothing was sent), as the openai SDK does, and records each failure; a failure after
the connect is never retried. Real sockets on loopback."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))

from fault_support import request  # noqa: E402

BODY = {"model": "m", "prompt": "hi", "max_tokens": 1}
_JSON = b'{"choices": [{"text": "x", "index": 0}]}'
REPLY = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
         b"content-length: %d\r\n\r\n%s" % (len(_JSON), _JSON))


def _unused_port() -> tuple[socket.socket, int]:
    """A bound socket that does not listen yet: a connect to its port is refused until it does."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s, s.getsockname()[1]


async def _serve(sock: socket.socket, reply: bytes | None) -> asyncio.AbstractServer:
    """Listen on `sock`; answer each request with `reply`, or close the connection unanswered (None)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if reply is not None:
            writer.write(reply)
            await writer.drain()
        writer.close()

    sock.listen()
    return await asyncio.start_server(handle, sock=sock)


def test_without_retries_a_refused_connect_is_the_outcome():
    sock, port = _unused_port()
    out = asyncio.run(request(f"http://127.0.0.1:{port}", "/v1/completions", BODY, bound_s=5))
    sock.close()
    assert out.error_type == "transport" and "ConnectError" in out.error
    assert out.connect_failures == []


def test_a_connect_refused_until_the_server_listens_is_retried_and_served():
    sock, port = _unused_port()

    async def run():
        task = asyncio.create_task(request(f"http://127.0.0.1:{port}", "/v1/completions", BODY, bound_s=10,
                                           connect_retries=2))
        await asyncio.sleep(0.3)  # the first connect is refused; the retry after 0.5 s finds the server
        server = await _serve(sock, REPLY)
        async with server:
            return await task

    out = asyncio.run(run())
    assert out.ok and out.text == "x", out.describe()
    assert len(out.connect_failures) == 1 and out.connect_failures[0].startswith("ConnectError"), out.connect_failures
    assert "connect retried after" in out.describe()


def test_retries_end_with_the_connect_error_when_no_server_comes():
    sock, port = _unused_port()
    out = asyncio.run(request(f"http://127.0.0.1:{port}", "/v1/completions", BODY, bound_s=10, connect_retries=2))
    sock.close()
    assert out.error_type == "transport" and "ConnectError" in out.error
    assert len(out.connect_failures) == 2
    assert 1.4 < out.elapsed_s < 5, out.elapsed_s  # backoff 0.5 s + 1 s, then the third connect fails


def test_a_failure_after_the_connect_is_not_retried():
    sock, port = _unused_port()

    async def run():
        server = await _serve(sock, None)  # reads the request, closes without an answer
        async with server:
            return await request(f"http://127.0.0.1:{port}", "/v1/completions", BODY, bound_s=5, connect_retries=2)

    out = asyncio.run(run())
    assert out.error_type == "transport" and "RemoteProtocolError" in out.error, out.describe()
    assert out.connect_failures == []
