"""The router's HTTP/1.1 server protocol: uvicorn's httptools protocol, with each reply of a known length written
to the socket in ONE write (status line, headers and body together).

Why: uvicorn writes a reply's status line and headers in one `transport.write` and its body in another. On
loopback TCP each write is a syscall that delivers the bytes to the client in the router's own context and wakes
the client, which then often takes the router's core before the second write
(docs/bench/2026-12-02-router-one-write/: the header write was ~9 % of the router's samples per request, as much
as the whole upstream leg's write). The bytes on the wire are exactly uvicorn's; only how they are cut into
writes changes.

Everything else is uvicorn's `HttpToolsProtocol` and its request/response cycle, unchanged: keep-alive,
pipelining, 100-continue, HEAD, HTTP/1.0, chunked request bodies, limits, timeouts, graceful shutdown,
disconnect detection. Each request's cycle gets a `ReplyTransport` in front of the connection's transport
(`_start_asgi_task`, the one place uvicorn starts a cycle, pipelined or not). Its states, per reply:

- PASS (before the reply starts): writes go straight through (e.g. the `100 Continue` interim reply);
- HELD: the status line and headers of a reply with a Content-Length and a body to come (not HEAD, not
  chunked, not an empty body) are kept, and the next write (the body's first bytes) carries them;
- SENT: the reply's head is on its way; writes go straight through (a streamed, chunked reply's head is never
  held: its first chunk may be a model's time away).

What this relies on in uvicorn (0.54, pinned in images/router/requirements.txt; router/pyproject.toml asks for
>= 0.54): `HttpToolsProtocol._start_asgi_task(cycle, app)` starts every cycle, and a cycle's `response_started`,
`chunked_encoding`, `expected_content_length` and `disconnected`; tests/unit/router/test_router_http_protocol.py
fails if any of it changes (bytes against stock uvicorn, writes counted).

A held head is never lost: `close()` (uvicorn closes after a failed or unfinished reply, or for
`Connection: close`) writes it first, so a broken reply breaks exactly where it did before.

Each cycle also gets a `ClientWatch` in its scope (`scope["extensions"]["expresslane.client_watch"]`): the
connection's loss, told to one subscriber by a plain call from `connection_lost`, under exactly the condition
uvicorn marks the cycle disconnected (and so when its `receive()` would answer `http.disconnect`). The handler
(app.run_until_disconnect) subscribes instead of running a watcher task that waits on `receive()`: one task
fewer per request (its creation, first step and cancellation).

Measured 2026-12-04 (docs/bench/2026-12-04-one-client, confounded: see 2026-12-07): this module and fastpath.py together save about 0.3 ms of
router CPU per non-streaming request (1.63 ms with them, 1.94 ms with Starlette's routing and stock uvicorn: +19 %,
per round +8 to +31 %; streams: no difference). Fair re-run 2026-12-07 (docs/bench/2026-12-07-one-client: the
tick removal and gc.freeze in both variants, c = 1 / 32): without them +18 % / +22 % router CPU per one-shot request,
+17 % / +9 % per streamed one, 0.6-0.9x the throughput: kept at about the 20 % bar; a run where the gain falls
clearly below it deletes them.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from typing import Any

from starlette.types import Scope

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

__all__ = ["CLIENT_WATCH", "ClientWatch", "ReplyState", "ReplyTransport", "RouterHttpProtocol", "client_watch"]

CLIENT_WATCH = "expresslane.client_watch"  # the scope extension's name


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


class ClientWatch:
    """Whether a request's client connection is gone, and one callback to call when it goes."""

    __slots__ = ("gone", "_callback")

    def __init__(self) -> None:
        self.gone = False
        self._callback: Callable[[], None] | None = None

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call `callback` when the connection is lost (now, if it already is). One subscriber at a time."""
        if self.gone:
            callback()
        else:
            self._callback = callback

    def unsubscribe(self) -> None:
        self._callback = None

    def lost(self) -> None:
        if not self.gone:
            self.gone = True
            callback, self._callback = self._callback, None
            if callback is not None:
                callback()


def client_watch(scope: Scope) -> ClientWatch | None:
    """The request's ClientWatch when RouterHttpProtocol serves it, else None (another server, a test client)."""
    ext = scope.get("extensions")
    return ext.get(CLIENT_WATCH) if ext else None


class RouterHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose request cycles write through a `ReplyTransport` and carry a
    `ClientWatch` (module docstring)."""

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        cycle.transport = ReplyTransport(self.transport, cycle)
        watch = ClientWatch()
        cycle.client_watch = watch  # type: ignore[attr-defined]  (read back in connection_lost)
        cycle.scope.setdefault("extensions", {})[CLIENT_WATCH] = watch  # type: ignore[typeddict-item]
        super()._start_asgi_task(cycle, app)

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:  # uvicorn's own condition (its receive() now says so)
            watch = getattr(cycle, "client_watch", None)
            if watch is not None:
                watch.lost()
