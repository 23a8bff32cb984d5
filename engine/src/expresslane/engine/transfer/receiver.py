"""Decode side of the data plane: NIXL-registered receive buffer + control server + the state table.

The receive buffer (DRAM on CPU, VRAM on GPU) is cut into ``num_slots`` slots, each big enough for one
``max_seq_len`` request of the whole model. Prefill ranks WRITE the dense wire layout straight into a
slot; with one sending rank the K and V handed out are zero-copy views of the slot. Which rid may use
which slot, and when a slot may be reused, is decided by the pure ``ReceiveTable`` (state.py); the
control server (control_server.py) feeds it; this module owns the buffer, the NIXL endpoint and the
waiters of ``wait_for``. Two slots by default: request N+1's KV lands while N decodes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field

import torch

from expresslane.engine.protocol import messages as m
from expresslane.engine.protocol.errors import ProtocolMismatch
from expresslane.engine.protocol.layout import KVLayoutSpec
from expresslane.engine.transfer.checksum import ALGORITHMS, algorithm_of, checksum, warm_wsum16
from expresslane.engine.transfer.control_server import ControlServer
from expresslane.engine.transfer.errors import KVCancelled, KVRefused, KVTimeout, KVTransferFailed
from expresslane.engine.transfer.nixl_transport import NixlEndpoint
from expresslane.engine.transfer.state import Outcome, ReceiveTable, Refused, Rejected, ReqState, Request

logger = logging.getLogger(__name__)


@dataclass
class ReceivedKV:
    """KV of one request, dense ``[num_layers, num_tokens, num_kv_heads, head_dim]`` on the engine device.

    ``k``/``v`` may be views of the receive buffer: copy them (e.g. into the static cache), then call
    ``release()``; after release the buffer is reused and the views must not be read.
    """

    rid: str
    num_tokens: int
    k: torch.Tensor
    v: torch.Tensor
    nbytes: int
    wire_wait_s: float  # time wait_for() waited for the KV (0 when it had already arrived)
    transfer_s: float   # first accept -> last done, as seen by the receiver
    convert_s: float    # time to turn the received bytes into k/v
    _release: object = field(default=None, repr=False)

    def release(self) -> None:
        fn, self._release = self._release, None
        if fn is not None:
            fn()


WAIT_GRACE_S = 1.0

_STAT_KEYS = ("accepted", "rejected", "arrived", "claimed", "expired", "cancelled", "failed", "bytes",
              "auth_failures", "refused_unknown_rid", "connections_refused", "checksum_failures", "aborted",
              "slots_in_use", "slots_fencing", "connections_open")


class KVReceiver:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str,
        device: torch.device | str,
        max_seq_len: int,
        host: str = "0.0.0.0",
        advertise_host: str | None = None,
        ctrl_port: int = 5556,
        *,
        num_slots: int = 2,
        unclaimed_ttl_s: float = 60.0,
        cancelled_ttl_s: float = 300.0,
        io_timeout_s: float = 30.0,
        handshake_timeout_s: float = 5.0,
        write_deadline_s: float = 60.0,
        notif_timeout_s: float = 5.0,
        max_expect_ttl_s: float = 3600.0,
        nixl_backends: tuple[str, ...] = ("UCX",),
        peer_secret: bytes | None = None,
        max_connections: int = 64,
        verify_checksum: bool = True,
        model_fingerprint: str = "",
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.layout = KVLayoutSpec(num_layers, num_kv_heads, head_dim, dtype if isinstance(dtype, str) else
                                   str(dtype), max_seq_len)
        self.dtype = self.layout.torch_dtype
        self.device = torch.device(device)
        self.host = host
        self.advertise_host = advertise_host or host
        self.ctrl_port = ctrl_port
        self.notif_timeout_s = notif_timeout_s
        self.write_deadline_s = write_deadline_s
        self.verify_checksum = verify_checksum
        self.model_fingerprint = model_fingerprint
        self.node_id = f"{socket.gethostname()}:{ctrl_port}"

        slot_nbytes = self.layout.request_nbytes(max_seq_len)
        self._buffer = torch.empty(num_slots * slot_nbytes, dtype=torch.uint8, device=self.device)
        self.table = ReceiveTable(num_slots, slot_nbytes, max_seq_len, num_kv_heads,
                                  unclaimed_ttl_s=unclaimed_ttl_s, tombstone_ttl_s=cancelled_ttl_s,
                                  max_ttl_s=max_expect_ttl_s)
        self._endpoint = NixlEndpoint(f"expresslane-recv-{ctrl_port}", nixl_backends)
        self._region = self._endpoint.register(self._buffer)
        if verify_checksum and self.device.type == "cuda":
            warm_wsum16(self.device)  # the first request does not pay the kernel's JIT (~0.6 s on an H200)
        self._transport = {
            "name": "nixl", "backends": list(nixl_backends), "agent_name": self._endpoint.name,
            "agent_metadata": self._endpoint.metadata_b64(), "region": self._region.to_wire(),
            # done.checksum algorithms this node verifies (checksum.py); a sender that sees none uses crc32
            "checksums": list(ALGORITHMS),
        }
        self._server = ControlServer(self, host=host, port=ctrl_port, peer_secret=peer_secret,
                                     max_connections=max_connections, io_timeout_s=io_timeout_s,
                                     handshake_timeout_s=handshake_timeout_s, ssl_context=ssl_context)
        self._lock = threading.RLock()  # guards the table, stats and waiters (app loop + control thread)
        self._busy = False
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Counters and gauges, for the decode server's metrics and for tests.
        self.stats: dict[str, int] = {k: 0 for k in _STAT_KEYS}
        if peer_secret is None:
            logger.warning("expresslane: EXPRESSLANE_PEER_SECRET is not set: the KV control port %d accepts "
                           "any peer (set it on the prefill and every express node)", ctrl_port)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is not None:
            return
        started: list[BaseException | None] = []
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._server.start())
            except BaseException as e:  # bind errors surface in start()
                started.append(e)
                ready.set()
                loop.close()
                return
            started.append(None)
            ready.set()
            reaper = loop.create_task(self._reap_forever())
            try:
                loop.run_forever()
            finally:
                reaper.cancel()
                loop.run_until_complete(self._server.close())
                loop.run_until_complete(asyncio.sleep(0))
                loop.close()

        self._stopping = False
        self._thread = threading.Thread(target=run, name="expresslane-kv-control", daemon=True)
        self._thread.start()
        ready.wait(10.0)
        if not started or started[0] is not None:
            self._thread = None
            raise started[0] if started else RuntimeError("control server did not start within 10 s")
        self._endpoint.start_progress(self._writes_in_flight)
        logger.info("expresslane KV receiver on %s:%d (advertised %s), %d slot(s) of %d B on %s, auth %s",
                    self.host, self.ctrl_port, self.advertise_host, len(self.table.slots),
                    self.table.slots[0].nbytes, self.device, "on" if self._server.secret else "OFF")

    def stop(self) -> None:
        self._stopping = True
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
        self._thread = None
        self._endpoint.stop_progress()
        with self._lock:
            for rid in list(self._waiters):
                self._wake(rid, KVTransferFailed("the KV receiver stopped", reason="stopped"))

    def health(self) -> dict[str, str]:
        cp = "ok"
        if self._thread is None or not self._thread.is_alive():
            cp = "control server thread not running"
        elif not self._server.serving():
            cp = f"not accepting on port {self.ctrl_port}"
        nixl = "ok" if self._endpoint.progress_alive() else "NIXL progress thread not running"
        return {"control_plane": cp, "nixl": nixl}

    def set_busy(self, busy: bool) -> None:
        self._busy = bool(busy)  # advertised in hello; admission is governed by expect()

    # ------------------------------------------------------------------ node API

    def expect(self, rid: str, ttl_s: float) -> None:
        with self._lock:
            try:
                self.table.expect(rid, ttl_s, time.monotonic())
            except Refused as e:
                raise KVRefused(str(e), reason=e.reason) from None
            finally:
                self._refresh()

    def cancel(self, rid: str) -> None:
        with self._lock:
            self.table.cancel(rid, time.monotonic())
            self.stats["cancelled"] += 1
            self._refresh()
            self._wake(rid, KVCancelled(f"rid {rid} was cancelled"))

    async def wait_for(self, rid: str, timeout_s: float) -> ReceivedKV:
        """The rid's KV (reserving it for the wait if nobody did), or KVTimeout / KVCancelled /
        KVTransferFailed(reason) / KVRefused as soon as that outcome is known."""
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while True:
            with self._lock:
                self._expect_for_wait(rid, timeout_s)
                received = self._try_claim(rid, wire_wait_s=time.monotonic() - t0)
                if received is not None:
                    return received
                fut = loop.create_future()
                self._waiters.setdefault(rid, []).append((loop, fut))
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                with self._lock:
                    self._remove_waiter(rid, fut)
                    received = self._try_claim(rid, wire_wait_s=time.monotonic() - t0)
                if received is not None:
                    return received
                raise KVTimeout(f"KV for rid {rid} did not arrive within {timeout_s}s") from None
            except BaseException:
                with self._lock:
                    self._remove_waiter(rid, fut)
                raise

    # ------------------------------------------------------------------ internals (lock held)

    def _expect_for_wait(self, rid: str, timeout_s: float) -> None:
        state = self.table.state_of(rid)
        if state is None or state in (ReqState.EXPECTED, ReqState.WRITING, ReqState.ARRIVED):
            try:  # held a little past the wait, so a wait that runs out reports KVTimeout, not "expired"
                self.table.expect(rid, timeout_s + WAIT_GRACE_S, time.monotonic())
            except Refused as e:
                raise KVRefused(str(e), reason=e.reason) from None
            self._refresh()
            return
        self._raise_terminal(self.table.requests[rid])

    @staticmethod
    def _raise_terminal(req: Request) -> None:
        if req.state is ReqState.CANCELLED:
            raise KVCancelled(f"rid {req.rid} was cancelled")
        if req.state is ReqState.FAILED:
            raise KVTransferFailed(f"KV transfer for rid {req.rid} failed: {req.reason}", reason=req.reason)
        if req.state is ReqState.EXPIRED:
            raise KVTransferFailed(f"rid {req.rid} expired: {req.reason}", reason="expired")

    def _try_claim(self, rid: str, wire_wait_s: float) -> ReceivedKV | None:
        req = self.table.claim(rid)
        if req is None:
            return None
        t0 = time.monotonic()
        k, v = self._dense(req)
        self.stats["claimed"] += 1
        return ReceivedKV(
            rid=rid, num_tokens=req.num_tokens, k=k, v=v, nbytes=self.layout.request_nbytes(req.num_tokens),
            wire_wait_s=wire_wait_s, transfer_s=req.t_arrived - req.t_accept, convert_s=time.monotonic() - t0,
            _release=lambda: self._release_claimed(rid))

    def _segment(self, req: Request, rank: int) -> torch.Tensor:
        _, heads = req.ranks[rank]
        seg = req.slot.nbytes // req.world_size
        return self._buffer[req.slot.offset + rank * seg:][: self.layout.request_nbytes(req.num_tokens, heads)]

    def _dense(self, req: Request) -> tuple[torch.Tensor, torch.Tensor]:
        L, T, D = self.layout.num_layers, req.num_tokens, self.layout.head_dim
        parts = []
        for rank in range(req.world_size):
            head_start, heads = req.ranks[rank]
            raw = self._segment(req, rank)
            half = raw.numel() // 2
            parts.append((head_start, raw[:half].view(self.dtype).view(L, T, heads, D),
                          raw[half:].view(self.dtype).view(L, T, heads, D)))
        if req.world_size == 1:
            return parts[0][1], parts[0][2]  # zero-copy views of the receive slot
        parts.sort(key=lambda p: p[0])
        return torch.cat([p[1] for p in parts], dim=2), torch.cat([p[2] for p in parts], dim=2)

    def _release_claimed(self, rid: str) -> None:
        with self._lock:
            self.table.release(rid, time.monotonic())
            self._refresh()

    def _apply(self, outcome: Outcome | None) -> None:
        if outcome is None:
            return
        if outcome.state is ReqState.ARRIVED:
            self._wake(outcome.rid)
            return
        key = {ReqState.FAILED: "failed", ReqState.EXPIRED: "expired"}.get(outcome.state)
        if key:
            self.stats[key] += 1
        if outcome.state is ReqState.FAILED:
            logger.error("expresslane: KV transfer for rid=%s failed: %s", outcome.rid, outcome.reason)
        self._raise_into_waiters(outcome)

    def _raise_into_waiters(self, outcome: Outcome) -> None:
        req = self.table.requests.get(outcome.rid)
        try:
            if req is not None:
                self._raise_terminal(req)
        except Exception as e:  # noqa: BLE001 - handed to the waiters
            self._wake(outcome.rid, e)

    def _wake(self, rid: str, exc: BaseException | None = None) -> None:
        for loop, fut in self._waiters.pop(rid, []):
            def _set(fut: asyncio.Future = fut) -> None:
                if not fut.done():
                    if exc is None:
                        fut.set_result(None)
                    else:
                        fut.set_exception(exc)
            try:
                loop.call_soon_threadsafe(_set)
            except RuntimeError:  # that loop is closed
                pass

    def _remove_waiter(self, rid: str, fut: asyncio.Future) -> None:
        waiters = [w for w in self._waiters.get(rid, []) if w[1] is not fut]
        if waiters:
            self._waiters[rid] = waiters
        else:
            self._waiters.pop(rid, None)

    def _refresh(self) -> None:
        self.stats["slots_in_use"] = self.table.slots_in_use()
        self.stats["slots_fencing"] = self.table.slots_fencing()

    # ------------------------------------------------------------------ called by the control server

    def _count(self, key: str) -> int:
        with self._lock:
            self.stats[key] += 1
            return self.stats[key]

    def _set_gauge(self, key: str, value: int) -> None:
        self.stats[key] = value

    def _writes_in_flight(self) -> bool:
        return self.table.writes_in_flight()

    def _write_deadline(self, conn_id: int) -> float | None:
        """Earliest accept + write_deadline_s of the transfers this connection has admitted and not finished."""
        with self._lock:
            starts = [req.t_accept for req in self.table.requests.values()
                      if req.state is ReqState.WRITING and conn_id in req.conns.values()
                      and any(cid == conn_id and r not in req.ranks_landed for r, cid in req.conns.items())]
        return min(starts) + self.write_deadline_s if starts else None

    def _hello(self) -> m.Hello:
        return m.hello(self.layout, self._transport, self._busy, self.node_id, self.model_fingerprint)

    def _connection_closed(self, conn_id: int, peer_closed: bool = True) -> None:
        with self._lock:
            for outcome in self.table.connection_closed(conn_id, time.monotonic(), peer_closed=peer_closed):
                self._apply(outcome)
            self._refresh()

    def _on_admit(self, msg: m.Admit, conn_id: int, peer: str) -> m.Message:
        try:
            m.check_compat(msg, self.layout, peer=peer, local_fingerprint=self.model_fingerprint)
        except ProtocolMismatch as e:
            logger.error("expresslane: refusing admit for rid=%s: %s", msg.rid, e)
            return self._reject(msg.rid, m.REJECT_INCOMPATIBLE, str(e))
        nbytes = self.layout.request_nbytes(msg.num_tokens, msg.num_heads)
        if msg.nbytes != nbytes and msg.num_tokens <= self.layout.max_seq_len:
            return self._reject(msg.rid, m.REJECT_BAD_REQUEST, f"nbytes {msg.nbytes} != expected {nbytes}")
        with self._lock:
            result = self.table.admit(msg.rid, rank=msg.rank, world_size=msg.world_size,
                                      head_start=msg.head_start, num_heads=msg.num_heads,
                                      num_tokens=msg.num_tokens, conn_id=conn_id, now=time.monotonic())
            self._refresh()
            if isinstance(result, Rejected):
                if result.reason in (m.REJECT_UNKNOWN, m.REJECT_CANCELLED, m.REJECT_EXPIRED):
                    self.stats["refused_unknown_rid"] += 1
                    logger.warning("expresslane: refusing KV for rid=%s from %s: %s", msg.rid, peer, result.reason)
                return self._reject(msg.rid, result.reason, result.detail)
            self.stats["accepted"] += 1
        self._endpoint.poke()
        return m.Accept(rid=msg.rid, rank=msg.rank, generation=result.generation, dest_offset=result.dest_offset,
                        nbytes=nbytes, notif=f"{msg.rid}|{result.generation}|{msg.rank}")

    def _reject(self, rid: str, reason: str, detail: str) -> m.Reject:
        with self._lock:
            self.stats["rejected"] += 1
        return m.reject(rid=rid, reason=reason, detail=detail)

    async def _on_done(self, msg: m.Done, conn_id: int) -> m.Ack:
        rid, gen, rank = msg.rid, msg.generation, msg.rank
        with self._lock:
            req = self.table.requests.get(rid)
            if req is None or req.generation != gen or req.conns.get(rank) != conn_id \
                    or req.state is not ReqState.WRITING:
                return m.Ack(rid=rid, generation=gen, ok=False, error="unknown_generation")
            segment = self._segment(req, rank)
        error = ""
        notif = f"{rid}|{gen}|{rank}".encode()
        deadline = time.monotonic() + self.notif_timeout_s
        while not self._endpoint.take_notif(notif):  # the NIXL notification is delivered after the data
            if time.monotonic() > deadline:
                error = "no_notification"
                break
            await asyncio.sleep(0.0005)
        if not error and msg.nbytes != segment.numel():
            error = "bad_nbytes"
        if not error and self.verify_checksum:
            if not msg.checksum:
                error = "checksum_missing"
            elif (algorithm := algorithm_of(msg.checksum)) is None:
                error = "checksum_mismatch"
                self._count("checksum_failures")
                logger.error("expresslane: rid=%s rank %d: checksum %r names no algorithm this node knows (%s)",
                             rid, rank, msg.checksum[:64], ", ".join(ALGORITHMS))
            else:
                got = await asyncio.get_running_loop().run_in_executor(None, checksum, segment, algorithm)
                if got != msg.checksum:
                    error = "checksum_mismatch"
                    self._count("checksum_failures")
                    logger.error("expresslane: checksum mismatch for rid=%s rank %d: sender %s, landed %s",
                                 rid, rank, msg.checksum, got)
        with self._lock:
            outcome = self.table.landed(rid, gen, rank, conn_id, time.monotonic(), error=error)
            if outcome is not None and outcome.state is ReqState.ARRIVED:
                self.stats["arrived"] += 1
                self.stats["bytes"] += self.layout.request_nbytes(req.num_tokens)
            self._apply(outcome)
            self._refresh()
            state = self.table.state_of(rid)
        if error:
            return m.Ack(rid=rid, generation=gen, ok=False, error=error)
        if state not in (ReqState.WRITING, ReqState.ARRIVED):
            return m.Ack(rid=rid, generation=gen, ok=False, error=state.value if state else "unknown_generation")
        return m.Ack(rid=rid, generation=gen, ok=True)

    def _on_abort(self, msg: m.Abort, conn_id: int, peer: str) -> None:
        logger.warning("expresslane: %s aborted rid=%s: %s %s", peer, msg.rid, msg.reason, msg.detail[:500])
        with self._lock:
            outcome = self.table.abort(msg.rid, msg.reason, conn_id, msg.write_final, time.monotonic())
            if outcome is not None:
                self.stats["aborted"] += 1
            self._apply(outcome)
            self._refresh()

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            with self._lock:
                now = time.monotonic()
                for outcome in self.table.tick(now):
                    self._apply(outcome)
                for rid, conn_id, gen, rank in self.table.fenced_writes():  # a late write completed
                    if self._endpoint.take_notif(f"{rid}|{gen}|{rank}".encode()):
                        self.table.write_final(conn_id, gen, rank, now)
                self._refresh()
