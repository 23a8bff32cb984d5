"""The decode node's control-plane server: asyncio, in its own thread, with a connection cap and deadlines.

Why asyncio in one thread (not a thread per connection, not a pool): a connection costs a few KiB and
no thread, so 1,000 idle or hostile connections cost 1,000 file descriptors up to ``max_connections``
(the rest are closed at accept) and one thread; every read has its own deadline (``io_timeout_s``, the
whole handshake ``handshake_timeout_s``) and size cap (4 KiB before authentication, 64 KiB after) without a
blocked thread per peer; the only blocking work (the
CRC of a landed slot) goes to a small executor. Waiting for a NIXL notification is a poll of the
endpoint's notification set (collected by its progress thread), so it blocks nothing either.

Per connection: challenge -> (auth -> auth_ok when a peer secret is set) -> hello -> admit/done/abort
frames until the peer closes. Before authentication a peer gets nothing but the challenge; any framing,
validation or MAC error ends the connection (logged, counted) and fails that connection's transfers.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import logging
import ssl
from typing import Protocol

from expresslane.engine.protocol import auth as a
from expresslane.engine.protocol import messages as m
from expresslane.engine.protocol.errors import AuthError, ConnectionClosed, ProtocolError, ProtocolMismatch


class ReceiverSide(Protocol):
    """What the control server uses of the receiver it feeds (transfer/receiver.py's KVReceiver): its state-table
    handlers, its hello and its counters. A protocol, so this module imports nothing that imports it."""

    write_deadline_s: float

    def _hello(self) -> m.Hello: ...

    def _on_admit(self, msg: m.Admit, conn_id: int, peer: str) -> m.Message: ...

    async def _on_done(self, msg: m.Done, conn_id: int) -> m.Ack: ...

    def _on_abort(self, msg: m.Abort, conn_id: int, peer: str) -> None: ...

    def _connection_closed(self, conn_id: int, peer_closed: bool = True) -> None: ...

    def _write_deadline(self, conn_id: int) -> float | None: ...

    def _count(self, key: str) -> int: ...

    def _set_gauge(self, key: str, value: int) -> None: ...

logger = logging.getLogger(__name__)

# What a prefill ever sends is small (auth, admit, done, abort): cap what one peer can make the node buffer
# (64 connections x 64 KiB), far below the protocol's 16 MiB frame cap (the node's own hello is large).
HANDSHAKE_FRAME_BYTES = 4096
PREFILL_FRAME_BYTES = 64 * 1024


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn_id: int,
                 session: a.Session) -> None:
        self.reader, self.writer, self.id, self.session = reader, writer, conn_id, session
        peer = writer.get_extra_info("peername") or ("?", 0)
        self.peer = f"prefill {peer[0]}:{peer[1]}"

    async def read(self, timeout_s: float, max_bytes: int) -> m.Message:
        async def one() -> dict:
            try:
                header = await self.reader.readexactly(m.HEADER_BYTES)
            except asyncio.IncompleteReadError as e:
                raise ConnectionClosed("peer closed the control connection" if not e.partial else
                                       "peer closed the control connection mid-header") from None
            n = m.frame_length(header, max_bytes)
            try:
                return m.decode_object(await self.reader.readexactly(n))
            except asyncio.IncompleteReadError:
                raise ConnectionClosed("peer closed the control connection mid-frame") from None

        try:
            obj = await asyncio.wait_for(one(), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no complete frame from {self.peer} within {timeout_s}s") from None
        return m.parse(self.session.unseal(obj))

    async def send(self, msg: m.Message) -> None:
        self.writer.write(m.frame(m.encode_body(self.session.seal(msg.to_wire()))))
        await self.writer.drain()


class ControlServer:
    def __init__(self, receiver: ReceiverSide, *, host: str, port: int, peer_secret: bytes | None,
                 max_connections: int, io_timeout_s: float, handshake_timeout_s: float,
                 ssl_context: ssl.SSLContext | None) -> None:
        self.rx = receiver
        self.host, self.port = host, port
        self.secret = peer_secret
        self.max_connections = max_connections
        self.io_timeout_s = io_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.ssl_context = ssl_context
        self.open_connections = 0
        self._ids = itertools.count(1)
        self._server: asyncio.base_events.Server | None = None
        self._handlers: set[asyncio.Task] = set()  # one per open connection (close() ends them)

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, self.host, self.port, ssl=self.ssl_context, backlog=128,
            ssl_handshake_timeout=self.handshake_timeout_s if self.ssl_context else None)

    def serving(self) -> bool:
        return self._server is not None and self._server.is_serving()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, then end every open connection (as a deadline would: their unfinished transfers
        fail, their writes stay fenced) and wait for each handler's cleanup, within timeout_s. asyncio's
        Server.close() leaves open connections alone (Python 3.11), and a handler the loop's close found
        still running was torn down without its cleanup."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        handlers = [t for t in self._handlers if not t.done()]
        for t in handlers:
            t.cancel()
        if handlers:
            await asyncio.wait(handlers, timeout=timeout_s)
        if server is not None:
            await asyncio.wait_for(server.wait_closed(), timeout_s)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open_connections >= self.max_connections:
            n = self.rx._count("connections_refused")
            if n == 1 or n % 100 == 0:
                logger.warning("expresslane: control connection refused: %d open = max_connections (%d refused "
                               "so far)", self.open_connections, n)
            writer.transport.abort()
            return
        self.open_connections += 1
        self.rx._set_gauge("connections_open", self.open_connections)
        conn_id = next(self._ids)
        conn = _Conn(reader, writer, conn_id, a.Session.open(side="decode"))
        peer_closed = False
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
        try:
            if await self._handshake(conn):
                peer_closed = await self._serve(conn)
        finally:
            self.open_connections -= 1
            self.rx._set_gauge("connections_open", self.open_connections)
            self.rx._connection_closed(conn_id, peer_closed=peer_closed)
            writer.close()
            self._handlers.discard(handler)

    async def _handshake(self, conn: _Conn) -> bool:
        nonce_d = a.new_nonce()
        try:
            await conn.send(m.Challenge(magic=m.MAGIC, protocol_version=m.PROTOCOL_VERSION,
                                        auth=a.AUTH_HMAC if self.secret else a.AUTH_NONE, nonce=nonce_d))
            if self.secret is not None:
                msg = await conn.read(self.handshake_timeout_s, HANDSHAKE_FRAME_BYTES)
                if not isinstance(msg, m.Auth):
                    raise AuthError(f"expected auth, got {msg.TYPE}")
                nonce_p = a.check_nonce(msg.nonce)
                if not a.verify(a.prefill_proof(self.secret, nonce_d, nonce_p), msg.proof):
                    raise AuthError("wrong peer secret (auth proof does not verify)")
                await conn.send(m.AuthOk(proof=a.decode_proof(self.secret, nonce_d, nonce_p)))
                conn.session = a.Session.derive(self.secret, nonce_d, nonce_p, side="decode")
            await conn.send(self.rx._hello())
            return True
        except (ProtocolError, TimeoutError, OSError) as e:
            if self.secret is not None:
                self.rx._count("auth_failures")
            level = logging.INFO if isinstance(e, ConnectionClosed) else logging.WARNING
            logger.log(level, "expresslane: control peer %s not authenticated: %s", conn.peer, e)
            return False

    async def _serve(self, conn: _Conn) -> bool:
        """Frames until the connection ends. True when the peer closed it (EOF), False when this node did."""
        try:
            while True:
                # An admitted write must be done by its deadline however many other frames come (a peer
                # cannot hold a slot by chatting); otherwise each frame has io_timeout_s.
                deadline = self.rx._write_deadline(conn.id)
                timeout = self.io_timeout_s if deadline is None else deadline - time.monotonic()
                try:
                    if timeout <= 0:
                        raise TimeoutError
                    msg = await conn.read(min(timeout, self.io_timeout_s), PREFILL_FRAME_BYTES)
                except TimeoutError as e:
                    if deadline is not None and time.monotonic() >= deadline - 0.01:
                        raise TimeoutError(f"no done from {conn.peer} within the write deadline "
                                           f"({self.rx.write_deadline_s}s after accept)") from None
                    raise e
                if isinstance(msg, m.Admit):
                    await conn.send(self.rx._on_admit(msg, conn.id, conn.peer))
                elif isinstance(msg, m.Done):
                    await conn.send(await self.rx._on_done(msg, conn.id))
                elif isinstance(msg, m.Abort):
                    self.rx._on_abort(msg, conn.id, conn.peer)
                else:
                    raise ProtocolError(f"unexpected {msg.TYPE} from {conn.peer}")
        except (ConnectionClosed, ConnectionResetError, BrokenPipeError):
            return True  # the peer's socket is gone (closed, or reset by its kernel when the process died)
        except AuthError as e:
            self.rx._count("auth_failures")
            logger.warning("expresslane: control connection from %s: %s; closing", conn.peer, e)
        except (ProtocolError, TimeoutError, OSError) as e:
            logger.warning("expresslane: control connection from %s ended: %s", conn.peer, e)
            if not isinstance(e, (OSError, ProtocolMismatch)) or isinstance(e, TimeoutError):
                try:
                    await conn.send(m.Error(code="protocol", detail=str(e)[:1000]))
                except (OSError, ProtocolError):
                    pass
        return False
