"""Decode side of the data plane: control server + NIXL-registered receive buffer (docs/protocol.md).

The receive buffer (DRAM on CPU, VRAM on GPU) is cut into ``num_slots`` slots, each big enough for one
``max_seq_len`` request of the whole model. Prefill ranks WRITE the dense wire layout straight into a
slot; with one sending rank the K and V handed out are zero-copy views of the slot.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from expresslane.engine.protocol import messages as m
from expresslane.engine.protocol.errors import ConnectionClosed, ProtocolError, ProtocolMismatch
from expresslane.engine.protocol.layout import KVLayoutSpec
from expresslane.engine.transfer.errors import KVCancelled, KVTimeout, KVTransferFailed
from expresslane.engine.transfer.nixl_transport import NixlEndpoint

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


@dataclass
class _Slot:
    index: int
    offset: int
    nbytes: int
    busy: bool = False


@dataclass
class _Entry:
    rid: str
    generation: int
    slot: _Slot
    world_size: int
    num_tokens: int
    state: str = "writing"  # writing | arrived | cancelling | claimed
    ranks: dict[int, tuple[int, int]] = field(default_factory=dict)  # rank -> (head_start, num_heads)
    ranks_done: set[int] = field(default_factory=set)
    ranks_open: set[int] = field(default_factory=set)  # admitted on a live connection, no done yet
    t_accept: float = 0.0
    t_arrived: float = 0.0


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
        num_slots: int = 1,
        unclaimed_ttl_s: float = 60.0,
        cancelled_ttl_s: float = 300.0,
        io_timeout_s: float = 30.0,
        notif_timeout_s: float = 5.0,
        nixl_backends: tuple[str, ...] = ("UCX",),
    ) -> None:
        self.layout = KVLayoutSpec(num_layers, num_kv_heads, head_dim, dtype if isinstance(dtype, str) else
                                   str(dtype), max_seq_len)
        self.dtype = self.layout.torch_dtype
        self.device = torch.device(device)
        self.host = host
        self.advertise_host = advertise_host or host
        self.ctrl_port = ctrl_port
        self.unclaimed_ttl_s = unclaimed_ttl_s
        self.cancelled_ttl_s = cancelled_ttl_s
        self.io_timeout_s = io_timeout_s
        self.notif_timeout_s = notif_timeout_s
        self.node_id = f"{socket.gethostname()}:{ctrl_port}"

        slot_nbytes = self.layout.request_nbytes(max_seq_len)
        self._buffer = torch.empty(num_slots * slot_nbytes, dtype=torch.uint8, device=self.device)
        self._slots = [_Slot(i, i * slot_nbytes, slot_nbytes) for i in range(num_slots)]
        self._endpoint = NixlEndpoint(f"expresslane-recv-{ctrl_port}", nixl_backends)
        self._region = self._endpoint.register(self._buffer)
        self._transport = {
            "name": "nixl",
            "backends": list(nixl_backends),
            "agent_name": self._endpoint.name,
            "agent_metadata": self._endpoint.metadata_b64(),
            "region": self._region.to_wire(),
        }

        self._lock = threading.Lock()
        self._busy = False
        self._generation = 0
        self._entries: dict[str, _Entry] = {}
        self._cancelled: dict[str, float] = {}  # rid -> expiry (monotonic)
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._server: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Plain counters, for the decode server's metrics and for tests.
        self.stats: dict[str, int] = {k: 0 for k in (
            "accepted", "rejected", "arrived", "claimed", "expired", "cancelled", "failed", "bytes")}

    # ------------------------------------------------------------------ public API

    def start(self) -> None:
        if self._thread is not None:
            return
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((self.host, self.ctrl_port))
        srv.listen(16)
        srv.settimeout(0.2)
        self._server = srv
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, name="expresslane-kv-receiver", daemon=True)
        self._thread.start()
        self._endpoint.start_progress(self._writes_in_flight)
        logger.info("expresslane KV receiver on %s:%d (advertised %s), %d slot(s) of %d B on %s",
                    self.host, self.ctrl_port, self.advertise_host, len(self._slots), self._slots[0].nbytes,
                    self.device)

    def stop(self) -> None:
        self._stop.set()
        self._endpoint.stop_progress()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        if self._server is not None:
            self._server.close()
            self._server = None

    def set_busy(self, busy: bool) -> None:
        self._busy = bool(busy)

    def cancel(self, rid: str) -> None:
        with self._lock:
            self._cancelled[rid] = time.monotonic() + self.cancelled_ttl_s
            entry = self._entries.get(rid)
            if entry is not None:
                if entry.state == "writing":
                    entry.state = "cancelling"  # the slot is freed once every admitted rank is done/gone
                    self._maybe_finish_cancel(entry)
                elif entry.state == "arrived":
                    self._drop(entry)
            self.stats["cancelled"] += 1
            self._wake(rid, KVCancelled(f"rid {rid} was cancelled"))

    async def wait_for(self, rid: str, timeout_s: float) -> ReceivedKV:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while True:
            with self._lock:
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

    def _writes_in_flight(self) -> bool:
        """True while a sender may be writing into a slot (the NIXL agent must then progress promptly)."""
        return any(e.ranks_open for e in list(self._entries.values()))

    # ------------------------------------------------------------------ state (call with self._lock held)

    def _try_claim(self, rid: str, wire_wait_s: float) -> ReceivedKV | None:
        if rid in self._cancelled:
            raise KVCancelled(f"rid {rid} was cancelled")
        entry = self._entries.get(rid)
        if entry is None or entry.state != "arrived":
            return None
        entry.state = "claimed"
        t0 = time.monotonic()
        k, v = self._dense(entry)
        convert_s = time.monotonic() - t0
        self.stats["claimed"] += 1
        return ReceivedKV(
            rid=rid, num_tokens=entry.num_tokens, k=k, v=v,
            nbytes=self.layout.request_nbytes(entry.num_tokens), wire_wait_s=wire_wait_s,
            transfer_s=entry.t_arrived - entry.t_accept, convert_s=convert_s,
            _release=lambda: self._release_claimed(entry),
        )

    def _dense(self, entry: _Entry) -> tuple[torch.Tensor, torch.Tensor]:
        L, T, D = self.layout.num_layers, entry.num_tokens, self.layout.head_dim
        seg = entry.slot.nbytes // entry.world_size
        parts = []
        for rank in range(entry.world_size):
            head_start, heads = entry.ranks[rank]
            half = L * T * heads * D * self.layout.element_size
            raw = self._buffer[entry.slot.offset + rank * seg:][: 2 * half]
            k = raw[:half].view(self.dtype).view(L, T, heads, D)
            v = raw[half:].view(self.dtype).view(L, T, heads, D)
            parts.append((head_start, k, v))
        if entry.world_size == 1:
            return parts[0][1], parts[0][2]  # zero-copy views of the receive slot
        parts.sort(key=lambda p: p[0])
        return torch.cat([p[1] for p in parts], dim=2), torch.cat([p[2] for p in parts], dim=2)

    def _release_claimed(self, entry: _Entry) -> None:
        with self._lock:
            if self._entries.get(entry.rid) is entry:
                del self._entries[entry.rid]
            entry.slot.busy = False

    def _drop(self, entry: _Entry) -> None:
        if self._entries.get(entry.rid) is entry:
            del self._entries[entry.rid]
        entry.slot.busy = False

    def _maybe_finish_cancel(self, entry: _Entry) -> None:
        if entry.state == "cancelling" and not entry.ranks_open:
            self._drop(entry)

    def _wake(self, rid: str, exc: BaseException | None = None) -> None:
        for loop, fut in self._waiters.pop(rid, []):
            def _set(fut=fut):
                if not fut.done():
                    if exc is None:
                        fut.set_result(None)
                    else:
                        fut.set_exception(exc)
            loop.call_soon_threadsafe(_set)

    def _remove_waiter(self, rid: str, fut: asyncio.Future) -> None:
        waiters = [w for w in self._waiters.get(rid, []) if w[1] is not fut]
        if waiters:
            self._waiters[rid] = waiters
        else:
            self._waiters.pop(rid, None)

    def _reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            for rid in [r for r, exp in self._cancelled.items() if exp < now]:
                del self._cancelled[rid]
            for entry in list(self._entries.values()):
                if entry.state == "arrived" and now - entry.t_arrived > self.unclaimed_ttl_s:
                    logger.warning("expresslane: dropping unclaimed KV of rid=%s after %.0fs", entry.rid,
                                   self.unclaimed_ttl_s)
                    self.stats["expired"] += 1
                    self._drop(entry)

    # ------------------------------------------------------------------ control server

    def _serve(self) -> None:
        assert self._server is not None
        last_reap = time.monotonic()
        while not self._stop.is_set():
            try:
                conn, addr = self._server.accept()
            except TimeoutError:
                conn = None
            except OSError:
                if self._stop.is_set():
                    return
                raise
            if conn is not None:
                threading.Thread(target=self._handle, args=(conn, addr), daemon=True,
                                 name=f"expresslane-kv-conn-{addr[0]}:{addr[1]}").start()
            if time.monotonic() - last_reap > 0.5:
                self._reap()
                last_reap = time.monotonic()

    def _handle(self, conn: socket.socket, addr) -> None:
        peer = f"prefill {addr[0]}:{addr[1]}"
        open_here: set[tuple[str, int, int]] = set()  # (rid, generation, rank) admitted on this connection
        with conn:
            conn.settimeout(self.io_timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                m.send_msg(conn, m.hello(self.layout, self._transport, self._busy, self.node_id))
                while not self._stop.is_set():
                    msg = m.recv_msg(conn)
                    if msg["type"] == m.ADMIT:
                        reply = self._on_admit(msg, peer)
                        if reply["type"] == m.ACCEPT:
                            open_here.add((reply["rid"], reply["generation"], reply["rank"]))
                    elif msg["type"] == m.DONE:
                        reply = self._on_done(msg)
                        open_here.discard((msg.get("rid"), msg.get("generation"), msg.get("rank")))
                    else:
                        raise ProtocolError(f"unexpected {msg['type']} from {peer}")
                    m.send_msg(conn, reply)
            except ConnectionClosed:
                pass
            except (ProtocolError, TimeoutError, OSError, KeyError, ValueError, TypeError) as e:
                logger.warning("expresslane: control connection from %s ended: %s", peer, e)
                try:
                    m.send_msg(conn, m.error("protocol", str(e)))
                except OSError:
                    pass
            finally:
                if open_here:
                    self._abandon(open_here, peer)

    def _abandon(self, open_here: set[tuple[str, int, int]], peer: str) -> None:
        """A connection closed with admitted-but-not-done ranks: that transfer failed."""
        with self._lock:
            for rid, generation, rank in open_here:
                entry = self._entries.get(rid)
                if entry is None or entry.generation != generation:
                    continue
                entry.ranks_open.discard(rank)
                if entry.state == "cancelling":
                    self._maybe_finish_cancel(entry)
                elif entry.state == "writing":
                    logger.error("expresslane: %s dropped rid=%s (rank %d) mid-transfer", peer, rid, rank)
                    entry.state = "cancelling"
                    self.stats["failed"] += 1
                    self._maybe_finish_cancel(entry)
                    self._wake(rid, KVTransferFailed(f"sender of rid {rid} vanished mid-transfer"))

    def _on_admit(self, msg: dict, peer: str) -> dict:
        rid = str(msg.get("rid"))
        try:
            m.check_compat(msg, self.layout, peer=peer)
        except ProtocolMismatch as e:
            logger.error("expresslane: refusing admit for rid=%s: %s", rid, e)
            return self._reject(rid, m.REJECT_INCOMPATIBLE, str(e))
        rank, world = int(msg["rank"]), int(msg["world_size"])
        head_start, heads, T = int(msg["head_start"]), int(msg["num_heads"]), int(msg["num_tokens"])
        if not (0 <= rank < world and heads * world == self.layout.num_kv_heads
                and 0 <= head_start and head_start + heads <= self.layout.num_kv_heads and T > 0):
            return self._reject(rid, m.REJECT_BAD_REQUEST, f"rank {rank}/{world} heads {head_start}+{heads} "
                                f"of {self.layout.num_kv_heads}, {T} tokens")
        if T > self.layout.max_seq_len:
            return self._reject(rid, m.REJECT_TOO_LONG, f"{T} tokens > max_seq_len {self.layout.max_seq_len}")
        nbytes = self.layout.request_nbytes(T, heads)
        if int(msg["nbytes"]) != nbytes:
            return self._reject(rid, m.REJECT_BAD_REQUEST, f"nbytes {msg['nbytes']} != expected {nbytes}")
        with self._lock:
            if rid in self._cancelled:
                return self._reject(rid, m.REJECT_CANCELLED, "rid was cancelled on this node")
            entry = self._entries.get(rid)
            if entry is not None:
                if entry.state != "writing" or rank in entry.ranks or entry.world_size != world \
                        or entry.num_tokens != T:
                    return self._reject(rid, m.REJECT_DUPLICATE, f"rid already {entry.state} (rank {rank})")
            else:
                if self._busy:
                    return self._reject(rid, m.REJECT_BUSY, "decode node is busy")
                slot = next((s for s in self._slots if not s.busy), None)
                if slot is None:
                    draining = any(e.state == "cancelling" for e in self._entries.values())
                    return self._reject(rid, m.REJECT_CANCELLING if draining else m.REJECT_BUSY,
                                        "no free receive slot")
                slot.busy = True
                self._generation += 1
                entry = _Entry(rid=rid, generation=self._generation, slot=slot, world_size=world, num_tokens=T,
                               t_accept=time.monotonic())
                self._entries[rid] = entry
            entry.ranks[rank] = (head_start, heads)
            entry.ranks_open.add(rank)
            self.stats["accepted"] += 1
            self._endpoint.poke()
            seg = entry.slot.nbytes // world
            return m.accept(rid=rid, rank=rank, generation=entry.generation,
                            dest_offset=entry.slot.offset + rank * seg, nbytes=nbytes,
                            notif=f"{rid}|{entry.generation}|{rank}")

    def _reject(self, rid: str, reason: str, detail: str) -> dict:
        self.stats["rejected"] += 1
        return m.reject(rid=rid, reason=reason, detail=detail)

    def _on_done(self, msg: dict) -> dict:
        rid, generation, rank = str(msg["rid"]), int(msg["generation"]), int(msg["rank"])
        notif = f"{rid}|{generation}|{rank}".encode()
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None or entry.generation != generation or rank not in entry.ranks_open:
                return m.ack(rid=rid, generation=generation, ok=False, error="unknown_generation")
        # The sender saw its WRITE complete; the NIXL notification (delivered after the data) confirms it
        # landed here. Wait outside the lock.
        landed = self._endpoint.wait_notif(notif, self.notif_timeout_s)
        with self._lock:
            entry.ranks_open.discard(rank)
            if entry.state == "cancelling":
                self._maybe_finish_cancel(entry)
                return m.ack(rid=rid, generation=generation, ok=False, error="cancelled")
            if self._entries.get(rid) is not entry:
                return m.ack(rid=rid, generation=generation, ok=False, error="unknown_generation")
            if not landed:
                entry.state = "cancelling"
                self.stats["failed"] += 1
                self._maybe_finish_cancel(entry)
                self._wake(rid, KVTransferFailed(f"no NIXL notification for rid {rid} rank {rank}"))
                return m.ack(rid=rid, generation=generation, ok=False, error="no_notification")
            entry.ranks_done.add(rank)
            if len(entry.ranks_done) == entry.world_size:
                entry.state = "arrived"
                entry.t_arrived = time.monotonic()
                self.stats["arrived"] += 1
                self.stats["bytes"] += self.layout.request_nbytes(entry.num_tokens)
                self._wake(rid)
            return m.ack(rid=rid, generation=generation, ok=True)
