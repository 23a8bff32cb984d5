"""The node's request seats as explicit state machines (pure: no I/O, no threads, clock passed in).

A node decodes up to S requests at once, one per seat of its engine (decode/batch.py). Each seat runs the same
machine:

    IDLE --reserve(rid, ttl)--> RESERVED(rid, deadline) --take(rid)--> WAITING_KV --> INJECTING --> DECODING
      ^                             |  cancel(rid) / expire(now)                                       |
      +-----------------------------+                                                                  |
      +<---------------- release() <-- FINISHING <-- finish() (from WAITING_KV, INJECTING or DECODING) -+

`SeatTable` holds S of them and the rid -> seat map:
- `reserve` of a rid that already holds a reservation refreshes its deadline (the router may retry); a new rid
  takes the lowest free seat; none free -> SeatsBusy (429). A rid that is already being served -> SeatsBusy too
  (a second request under the same rid is never admitted).
- `take` turns a live reservation into the request /pd/decode serves; an unreserved, cancelled or expired rid ->
  NotReserved (409). A reservation whose deadline has passed is expired on the spot, whoever asks.
- FINISHING: the handler is done but the engine thread may still touch the seat (a step in flight); the seat is
  free only after `release()`, so the next request's inject into that seat can never race the previous decode.
A seat is never held by two rids, and a rid never holds two seats (tests/unit/engine/test_server_seats.py checks
both over random operation sequences).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SeatState(enum.Enum):
    IDLE = "idle"
    RESERVED = "reserved"
    WAITING_KV = "waiting_kv"
    INJECTING = "injecting"
    DECODING = "decoding"
    FINISHING = "finishing"


ACTIVE_STATES = (SeatState.WAITING_KV, SeatState.INJECTING, SeatState.DECODING)
_NEXT_PHASE = {SeatState.WAITING_KV: SeatState.INJECTING, SeatState.INJECTING: SeatState.DECODING}


class SeatError(Exception):
    """A transition the seat's current state does not allow."""


class SeatsBusy(SeatError):
    """No seat is free (or the rid is already being served)."""


class NotReserved(SeatError):
    """/pd/decode for a rid that holds no live reservation."""


@dataclass(frozen=True)
class SeatView:
    index: int
    state: SeatState
    rid: str | None = None
    deadline: float | None = None  # RESERVED only: when the reservation expires (the caller's clock)


class SeatTable:
    def __init__(self, seats: int) -> None:
        if seats < 1:
            raise ValueError(f"seats must be >= 1, got {seats}")
        self._views = [SeatView(i, SeatState.IDLE) for i in range(seats)]
        self._by_rid: dict[str, int] = {}

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self._views)

    @property
    def views(self) -> tuple[SeatView, ...]:
        return tuple(self._views)

    def seat_of(self, rid: str) -> int | None:
        return self._by_rid.get(rid)

    def view_of(self, rid: str) -> SeatView | None:
        i = self._by_rid.get(rid)
        return None if i is None else self._views[i]

    @property
    def busy(self) -> int:
        """Seats not IDLE."""
        return sum(v.state is not SeatState.IDLE for v in self._views)

    @property
    def free(self) -> int:
        return len(self._views) - self.busy

    def next_deadline(self) -> float | None:
        """The earliest reservation deadline (when an expiry check is next due), or None."""
        ds = [v.deadline for v in self._views if v.state is SeatState.RESERVED and v.deadline is not None]
        return min(ds) if ds else None

    # ------------------------------------------------------------------ transitions
    def _set(self, i: int, view: SeatView) -> None:
        old = self._views[i]
        if old.rid is not None and old.rid != view.rid:
            del self._by_rid[old.rid]
        if view.rid is not None:
            self._by_rid[view.rid] = i
        self._views[i] = view

    def reserve(self, rid: str, ttl_s: float, now: float) -> tuple[int, bool]:
        """Hold a seat for rid until now + ttl_s: (its seat, True for a new reservation / False for a refresh)."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.expire(now)
        v = self.view_of(rid)
        if v is not None:
            if v.state is SeatState.RESERVED:
                self._set(v.index, SeatView(v.index, SeatState.RESERVED, rid, now + ttl_s))
                return v.index, False
            raise SeatsBusy(f"rid is already {v.state.value} on this node")
        for i, seat in enumerate(self._views):
            if seat.state is SeatState.IDLE:
                self._set(i, SeatView(i, SeatState.RESERVED, rid, now + ttl_s))
                return i, True
        raise SeatsBusy(f"all {len(self._views)} seats of this node are held")

    def take(self, rid: str, now: float) -> int:
        """RESERVED(rid) -> WAITING_KV; its seat."""
        self.expire(now)
        v = self.view_of(rid)
        if v is None or v.state is not SeatState.RESERVED:
            if v is not None:
                raise SeatsBusy(f"rid is already {v.state.value}")
            raise NotReserved("this rid holds no reservation on this node (never reserved, cancelled or expired)")
        self._set(v.index, SeatView(v.index, SeatState.WAITING_KV, rid))
        return v.index

    def advance(self, rid: str, to: SeatState) -> None:
        """WAITING_KV -> INJECTING -> DECODING, in that order only."""
        v = self.view_of(rid)
        if v is None or _NEXT_PHASE.get(v.state) is not to:
            raise SeatError(f"cannot go from {v.state.value if v else 'no seat'} to {to.value} for this rid")
        self._set(v.index, SeatView(v.index, to, rid))

    def finish(self, rid: str) -> None:
        """The handler is done with rid: WAITING_KV / INJECTING / DECODING -> FINISHING."""
        v = self.view_of(rid)
        if v is None or v.state not in ACTIVE_STATES:
            raise SeatError(f"cannot finish from {v.state.value if v else 'no seat'} for this rid")
        self._set(v.index, SeatView(v.index, SeatState.FINISHING, rid))

    def release(self, rid: str) -> None:
        """FINISHING -> IDLE, once the engine thread has stopped touching the seat."""
        v = self.view_of(rid)
        if v is None or v.state is not SeatState.FINISHING:
            raise SeatError(f"cannot release from {v.state.value if v else 'no seat'} for this rid")
        self._set(v.index, SeatView(v.index, SeatState.IDLE))

    def cancel_reservation(self, rid: str) -> bool:
        """RESERVED(rid) -> IDLE. True when rid held a reservation."""
        v = self.view_of(rid)
        if v is not None and v.state is SeatState.RESERVED:
            self._set(v.index, SeatView(v.index, SeatState.IDLE))
            return True
        return False

    def expire(self, now: float) -> list[str]:
        """Every RESERVED seat past its deadline -> IDLE; the expired rids."""
        out = []
        for v in list(self._views):
            if v.state is SeatState.RESERVED and v.deadline is not None and now >= v.deadline:
                self._set(v.index, SeatView(v.index, SeatState.IDLE))
                out.append(v.rid)
        return out
