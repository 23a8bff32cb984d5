"""The router's HTTP/1.1 server protocol: uvicorn's httptools protocol, with each reply of a known length written
to the socket in ONE write (status line, headers and body together).

Why: uvicorn writes a reply's status line and headers in one `transport.write` and its body in another. On
loopback TCP each write is a syscall that delivers the bytes to the client in the router's own context and wakes
the client, which then often takes the router's core before the second write (docs/performance.md, "Router hot
path (session 6)": the header write was ~9 % of the router's samples per request, as much as the whole upstream
leg's write). The bytes on the wire are exactly uvicorn's; only how they are cut into writes changes.

Everything else is uvicorn's `HttpToolsProtocol` and its request/response cycle, unchanged: keep-alive,
pipelining, 100-continue, HEAD, HTTP/1.0, chunked request bodies, limits, timeouts, graceful shutdown,
disconnect detection. Each request's cycle gets a `ReplyTransport` in front of the connection's transport
(`_start_asgi_task`, the one place uvicorn starts a cycle, pipelined or not). Its states, per reply:

- PASS (before the reply starts): writes go straight through (e.g. the `100 Continue` interim reply);
- HELD: the status line and headers of a reply with a Content-Length and a body to come (not HEAD, not
  chunked, not an empty body) are kept, and the next write (the body's first bytes) carries them;
- SENT: the reply's head is on its way; writes go straight through (a streamed, chunked reply's head is never
  held: its first chunk may be a model's time away).

A held head is never lost: `close()` (uvicorn closes after a failed or unfinished reply, or for
`Connection: close`) writes it first, so a broken reply breaks exactly where it did before.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

__all__ = ["ReplyState", "ReplyTransport", "RouterHttpProtocol"]


class ReplyState(enum.Enum):
    PASS = "pass"
    HELD = "held"
    SENT = "sent"


class ReplyTransport:
    """The connection's transport as one request's cycle sees it (module docstring)."""

    __slots__ = ("transport", "cycle", "state", "head")

    def __init__(self, transport: asyncio.Transport, cycle: RequestResponseCycle) -> None:
        self.transport = transport
        self.cycle = cycle
        self.state = ReplyState.PASS
        self.head = b""

    def write(self, data: bytes) -> None:
        state = self.state
        if state is ReplyState.HELD:
            self.state, head, self.head = ReplyState.SENT, self.head, b""
            self.transport.write(head + data)
            return
        if state is ReplyState.PASS and self.cycle.response_started:
            # uvicorn marks the reply started before it renders the head: this write is the head
            self.state = ReplyState.SENT
            cycle = self.cycle
            if (cycle.chunked_encoding is False and cycle.expected_content_length > 0
                    and cycle.scope["method"] != "HEAD"):
                self.state, self.head = ReplyState.HELD, data
                return
        self.transport.write(data)

    def close(self) -> None:
        if self.state is ReplyState.HELD:
            self.state, head, self.head = ReplyState.SENT, self.head, b""
            self.transport.write(head)
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def __getattr__(self, name: str) -> Any:  # anything else a cycle may ask of its transport
        return getattr(self.transport, name)


class RouterHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose request cycles write through a `ReplyTransport`."""

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        cycle.transport = ReplyTransport(self.transport, cycle)
        super()._start_asgi_task(cycle, app)
