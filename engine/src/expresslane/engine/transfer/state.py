"""The receive side's state: one pure table of receive slots and requests (no sockets, no NIXL, no clock).

Every method takes ``now`` (monotonic seconds) and returns what happened; the receiver (receiver.py)
does the I/O and wakes waiters from the returned outcomes. Unit tests drive the table directly.

Requests::

    EXPECTED --admit--> WRITING --all ranks landed+verified--> ARRIVED --claim--> CLAIMED --release--> (gone)
       |                  |                                      |
       +--cancel--------> CANCELLED        (kept as tombstones so late KV is refused at admit;
       +--ttl-----------> EXPIRED           dropped from the table after tombstone_ttl_s)
                          FAILED  <--abort / sender vanished / checksum / no notification

Slots::

    FREE --expect--> HELD --request ends, no write in flight--> FREE
                      +----request ends, a write may still land--> FENCING --every such write final--> FREE

A slot is taken at ``expect`` (the node reserved the rid), so a slot is held only by a request the node
serves or is about to serve, and an expected rid can never be refused for want of a slot. "Write final"
is transfer state, never a timer: the write's NIXL notification arrived (delivered after its data), the
sender's ``abort{write_final: true}`` said so, or the sender's control connection closed (the sender
holds it open while any WRITE handle of it is in flight, so a close means the process or the write is
gone; a connection THIS node closed, on a deadline or a protocol error, is no such signal: those writes
stay fenced until their notification comes).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ReqState(enum.Enum):
    EXPECTED = "expected"
    WRITING = "writing"
    ARRIVED = "arrived"
    CLAIMED = "claimed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    EXPIRED = "expired"


class SlotState(enum.Enum):
    FREE = "free"
    HELD = "held"
    FENCING = "fencing"


LIVE = frozenset({ReqState.EXPECTED, ReqState.WRITING, ReqState.ARRIVED, ReqState.CLAIMED})


class Refused(Exception):
    """expect() cannot hold a slot for the rid. ``reason``: no_slot | cancelled | duplicate."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class Slot:
    index: int
    offset: int
    nbytes: int
    state: SlotState = SlotState.FREE
    rid: str | None = None
    last_rid: str | None = None  # the rid whose writes a FENCING slot waits out (its notifications clear it)
    # writes that may still land in this slot: (conn_id, generation, rank)
    in_flight: set[tuple[int, int, int]] = field(default_factory=set)


@dataclass
class Request:
    rid: str
    slot: Slot
    deadline: float
    state: ReqState = ReqState.EXPECTED
    generation: int = 0
    world_size: int = 0
    num_tokens: int = 0
    ranks: dict[int, tuple[int, int]] = field(default_factory=dict)  # rank -> (head_start, num_heads)
    ranks_landed: set[int] = field(default_factory=set)
    conns: dict[int, int] = field(default_factory=dict)  # rank -> conn_id that admitted it
    reason: str = ""      # why FAILED / CANCELLED / EXPIRED
    t_accept: float = 0.0
    t_arrived: float = 0.0
    ended_at: float = 0.0


@dataclass(frozen=True)
class Admitted:
    generation: int
    dest_offset: int


@dataclass(frozen=True)
class Rejected:
    reason: str
    detail: str


@dataclass(frozen=True)
class Outcome:
    """A waiter-visible change: ``state`` ARRIVED (claim it) or a terminal state with ``reason``."""

    rid: str
    state: ReqState
    reason: str = ""


class ReceiveTable:
    def __init__(self, num_slots: int, slot_nbytes: int, max_seq_len: int, num_kv_heads: int, *,
                 unclaimed_ttl_s: float = 60.0, tombstone_ttl_s: float = 300.0, max_ttl_s: float = 3600.0) -> None:
        if num_slots < 1:
            raise ValueError("a receiver needs at least one slot")
        self.slots = [Slot(i, i * slot_nbytes, slot_nbytes) for i in range(num_slots)]
        self.max_seq_len = max_seq_len
        self.num_kv_heads = num_kv_heads
        self.unclaimed_ttl_s = unclaimed_ttl_s
        self.tombstone_ttl_s = tombstone_ttl_s
        self.max_ttl_s = max_ttl_s
        self.requests: dict[str, Request] = {}
        self._generation = 0

    # ------------------------------------------------------------------ queries

    def slots_in_use(self) -> int:
        return sum(s.state is not SlotState.FREE for s in self.slots)

    def slots_fencing(self) -> int:
        return sum(s.state is SlotState.FENCING for s in self.slots)

    def writes_in_flight(self) -> bool:
        return any(s.in_flight for s in self.slots)

    def state_of(self, rid: str) -> ReqState | None:
        req = self.requests.get(rid)
        return None if req is None else req.state

    # ------------------------------------------------------------------ node side

    def expect(self, rid: str, ttl_s: float, now: float) -> None:
        """Hold a slot for rid until ``now + ttl_s`` (capped); extends a live reservation. Raises Refused."""
        ttl_s = min(max(float(ttl_s), 0.0), self.max_ttl_s)
        req = self.requests.get(rid)
        if req is not None:
            if req.state in LIVE:
                req.deadline = max(req.deadline, now + ttl_s)
                return
            if req.state is ReqState.CANCELLED:
                raise Refused("cancelled", f"rid {rid} was cancelled on this node")
            # FAILED / EXPIRED are final: keep the tombstone so the waiting /pd/decode learns the outcome at
            # once (wait_for raises KVTransferFailed with its reason). Re-reserving here would forget an abort
            # that reached the node before /pd/decode took the reservation over, and the request would then
            # wait out its whole timeout. The router uses a fresh rid for every attempt.
            return
        slot = next((s for s in self.slots if s.state is SlotState.FREE), None)
        if slot is None:
            held = [s.rid for s in self.slots if s.state is SlotState.HELD]
            raise Refused("no_slot", f"all {len(self.slots)} receive slots taken (held by {len(held)} "
                          f"request(s), {self.slots_fencing()} fencing an abandoned write)")
        slot.state, slot.rid = SlotState.HELD, rid
        self.requests[rid] = Request(rid=rid, slot=slot, deadline=now + ttl_s)

    def cancel(self, rid: str, now: float, reason: str = "cancelled") -> Outcome | None:
        req = self.requests.get(rid)
        if req is None:
            req = Request(rid=rid, slot=None, deadline=now)  # type: ignore[arg-type]  # tombstone only
            req.state, req.reason, req.ended_at = ReqState.CANCELLED, reason, now
            self.requests[rid] = req
            return None
        if req.state not in LIVE:
            return None
        self._end(req, ReqState.CANCELLED, reason, now)
        return Outcome(rid, ReqState.CANCELLED, reason)

    def claim(self, rid: str) -> Request | None:
        req = self.requests.get(rid)
        if req is None or req.state is not ReqState.ARRIVED:
            return None
        req.state = ReqState.CLAIMED
        return req

    def release(self, rid: str, now: float) -> None:
        """The decode engine copied the claimed KV: the slot is free (nothing can be writing into it)."""
        req = self.requests.get(rid)
        if req is not None and req.state is ReqState.CLAIMED:
            self._free_slot(req)
            del self.requests[rid]

    def tick(self, now: float) -> list[Outcome]:
        """Expire reservations and unclaimed KV past their deadline; forget old tombstones."""
        out = []
        for req in list(self.requests.values()):
            if req.state is ReqState.EXPECTED and now > req.deadline:
                self._end(req, ReqState.EXPIRED, "reservation ttl passed before any KV came", now)
                out.append(Outcome(req.rid, ReqState.EXPIRED, req.reason))
            elif req.state is ReqState.ARRIVED and now > max(req.deadline, req.t_arrived + self.unclaimed_ttl_s):
                self._end(req, ReqState.EXPIRED, "arrived KV was never claimed", now)
                out.append(Outcome(req.rid, ReqState.EXPIRED, req.reason))
            elif req.state not in LIVE and now - req.ended_at > self.tombstone_ttl_s:
                del self.requests[req.rid]
        return out

    # ------------------------------------------------------------------ sender side (control plane)

    def admit(self, rid: str, *, rank: int, world_size: int, head_start: int, num_heads: int,
              num_tokens: int, conn_id: int, now: float) -> Admitted | Rejected:
        if not (0 <= rank < world_size and num_heads * world_size == self.num_kv_heads
                and head_start + num_heads <= self.num_kv_heads and num_tokens > 0):
            return Rejected("bad_request", f"rank {rank}/{world_size} heads {head_start}+{num_heads} of "
                            f"{self.num_kv_heads}, {num_tokens} tokens")
        if num_tokens > self.max_seq_len:
            return Rejected("too_long", f"{num_tokens} tokens > max_seq_len {self.max_seq_len}")
        req = self.requests.get(rid)
        if req is None:
            return Rejected("unknown_rid", "this node holds no reservation for the rid (/pd/reserve first)")
        if req.state in (ReqState.CANCELLED, ReqState.EXPIRED, ReqState.FAILED):
            return Rejected(req.state.value, f"rid is {req.state.value}: {req.reason}")
        if req.state is ReqState.EXPECTED:
            if req.slot.state is not SlotState.HELD or req.slot.in_flight:
                return Rejected("busy", "the reserved slot is still fencing")
            self._generation += 1
            req.state, req.generation, req.t_accept = ReqState.WRITING, self._generation, now
            req.world_size, req.num_tokens = world_size, num_tokens
        elif req.state is not ReqState.WRITING or rank in req.ranks or req.world_size != world_size \
                or req.num_tokens != num_tokens:
            return Rejected("duplicate", f"rid already {req.state.value} (rank {rank})")
        req.ranks[rank] = (head_start, num_heads)
        req.conns[rank] = conn_id
        req.slot.in_flight.add((conn_id, req.generation, rank))
        seg = req.slot.nbytes // world_size
        return Admitted(req.generation, req.slot.offset + rank * seg)

    def write_final(self, conn_id: int, generation: int, rank: int, now: float) -> None:
        """No more bytes of this write can land (its notification arrived, or the sender said so)."""
        for slot in self.slots:
            if (conn_id, generation, rank) in slot.in_flight:
                slot.in_flight.discard((conn_id, generation, rank))
                self._maybe_unfence(slot)

    def landed(self, rid: str, generation: int, rank: int, conn_id: int, now: float,
               error: str = "") -> Outcome | None:
        """A ``done`` was checked: the write's notification arrived (``error`` ""), or it failed with
        ``error`` (no_notification, checksum_mismatch, bad_nbytes). The write is final either way except
        for no_notification (its bytes may still come: the slot stays fenced until the connection ends)."""
        if error != "no_notification":
            self.write_final(conn_id, generation, rank, now)
        req = self.requests.get(rid)
        if req is None or req.generation != generation or req.conns.get(rank) != conn_id:
            return None
        if req.state is not ReqState.WRITING:
            return None
        if error:
            self._end(req, ReqState.FAILED, error, now)
            return Outcome(rid, ReqState.FAILED, error)
        req.ranks_landed.add(rank)
        if len(req.ranks_landed) == req.world_size:
            req.state, req.t_arrived = ReqState.ARRIVED, now
            return Outcome(rid, ReqState.ARRIVED)
        return None

    def abort(self, rid: str, reason: str, conn_id: int, write_final: bool, now: float) -> Outcome | None:
        """The sender gave up on rid. Any write of this connection into the slot is final if it says so."""
        req = self.requests.get(rid)
        if write_final and req is not None:
            for rank, cid in req.conns.items():
                if cid == conn_id:
                    self.write_final(conn_id, req.generation, rank, now)
        if req is None or req.state not in (ReqState.EXPECTED, ReqState.WRITING):
            return None
        self._end(req, ReqState.FAILED, f"aborted:{reason}", now)
        return Outcome(rid, ReqState.FAILED, req.reason)

    def fenced_writes(self) -> list[tuple[str, int, int, int]]:
        """(rid, conn_id, generation, rank) of every write a FENCING slot still waits out."""
        return [(s.last_rid or "", c, g, r) for s in self.slots if s.state is SlotState.FENCING
                for (c, g, r) in s.in_flight]

    def connection_closed(self, conn_id: int, now: float, *, peer_closed: bool = True) -> list[Outcome]:
        """The sender's control connection ended: its unfinished transfers failed. If the PEER closed it, its
        writes are final too; if this node closed it (deadline, protocol error) a live sender may still be
        writing, so those slots stay FENCING until each write's notification arrives."""
        out = []
        for req in list(self.requests.values()):
            ranks = [r for r, cid in req.conns.items() if cid == conn_id]
            if not ranks:
                continue
            if req.state is ReqState.WRITING and any(r not in req.ranks_landed for r in ranks):
                self._end(req, ReqState.FAILED, "sender_vanished", now)
                out.append(Outcome(req.rid, ReqState.FAILED, "sender_vanished"))
        if peer_closed:
            for slot in self.slots:
                for item in [i for i in slot.in_flight if i[0] == conn_id]:
                    slot.in_flight.discard(item)
                self._maybe_unfence(slot)
        return out

    # ------------------------------------------------------------------ internals

    def _end(self, req: Request, state: ReqState, reason: str, now: float) -> None:
        req.state, req.reason, req.ended_at = state, reason, now
        self._free_slot(req)

    def _free_slot(self, req: Request) -> None:
        slot = req.slot
        if slot is None or slot.rid != req.rid:
            return
        slot.rid, slot.last_rid = None, req.rid
        slot.state = SlotState.FENCING if slot.in_flight else SlotState.FREE

    def _maybe_unfence(self, slot: Slot) -> None:
        if slot.state is SlotState.FENCING and not slot.in_flight:
            slot.state = SlotState.FREE
