"""The node's one request slot as an explicit state machine (pure: no I/O, no threads, clock passed in).

    IDLE --reserve(rid, ttl)--> RESERVED(rid, deadline) --take(rid)--> WAITING_KV --> INJECTING --> DECODING
      ^                             |  cancel(rid) / expire(now)                                       |
      +-----------------------------+                                                                  |
      +<---------------- release() <-- FINISHING <-- finish() (from WAITING_KV, INJECTING or DECODING) -+

- `reserve` of the rid that already holds the reservation refreshes its deadline (the router may retry);
  any other rid while the slot is held -> SlotBusy.
- `take` turns a live reservation into the request /pd/decode serves; an unreserved, cancelled or expired rid
  -> NotReserved (409). A reservation whose deadline has passed is expired on the spot, whoever asks.
- FINISHING: the handler is done but the engine thread may still touch the engine (a cancelled decode step);
  the slot is free only after `release()`, so the next request's inject can never race the previous decode.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SlotState(enum.Enum):
    IDLE = "idle"
    RESERVED = "reserved"
    WAITING_KV = "waiting_kv"
    INJECTING = "injecting"
    DECODING = "decoding"
    FINISHING = "finishing"


ACTIVE_STATES = (SlotState.WAITING_KV, SlotState.INJECTING, SlotState.DECODING)
_NEXT_PHASE = {SlotState.WAITING_KV: SlotState.INJECTING, SlotState.INJECTING: SlotState.DECODING}


class SlotError(Exception):
    """A transition the current state does not allow."""


class SlotBusy(SlotError):
    """The slot is held by another rid (reserved or serving)."""


class NotReserved(SlotError):
    """/pd/decode for a rid that holds no live reservation."""


@dataclass(frozen=True)
class SlotView:
    state: SlotState
    rid: str | None = None
    deadline: float | None = None  # RESERVED only: when the reservation expires (the caller's clock)


class RequestSlot:
    def __init__(self) -> None:
        self._view = SlotView(SlotState.IDLE)

    @property
    def view(self) -> SlotView:
        return self._view

    @property
    def state(self) -> SlotState:
        return self._view.state

    @property
    def rid(self) -> str | None:
        return self._view.rid

    def reserve(self, rid: str, ttl_s: float, now: float) -> bool:
        """Hold the slot for rid until now + ttl_s. True for a new reservation, False for a refresh."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.expire(now)
        v = self._view
        if v.state is SlotState.RESERVED and v.rid == rid:
            self._view = SlotView(SlotState.RESERVED, rid, now + ttl_s)
            return False
        if v.state is not SlotState.IDLE:
            raise SlotBusy(f"the node's slot is {v.state.value}")
        self._view = SlotView(SlotState.RESERVED, rid, now + ttl_s)
        return True

    def take(self, rid: str, now: float) -> None:
        """RESERVED(rid) -> WAITING_KV."""
        self.expire(now)
        v = self._view
        if v.state is not SlotState.RESERVED or v.rid != rid:
            if v.rid == rid and v.state is not SlotState.IDLE:
                raise SlotBusy(f"rid is already {v.state.value}")
            raise NotReserved("this rid holds no reservation on this node (never reserved, cancelled or expired)")
        self._view = SlotView(SlotState.WAITING_KV, rid)

    def advance(self, rid: str, to: SlotState) -> None:
        """WAITING_KV -> INJECTING -> DECODING, in that order only."""
        v = self._view
        if v.rid != rid or _NEXT_PHASE.get(v.state) is not to:
            raise SlotError(f"cannot go from {v.state.value} to {to.value} for this rid")
        self._view = SlotView(to, rid)

    def finish(self, rid: str) -> None:
        """The handler is done with rid: WAITING_KV / INJECTING / DECODING -> FINISHING."""
        v = self._view
        if v.rid != rid or v.state not in ACTIVE_STATES:
            raise SlotError(f"cannot finish from {v.state.value} for this rid")
        self._view = SlotView(SlotState.FINISHING, rid)

    def release(self, rid: str) -> None:
        """FINISHING -> IDLE, once the engine thread has stopped touching the engine."""
        v = self._view
        if v.rid != rid or v.state is not SlotState.FINISHING:
            raise SlotError(f"cannot release from {v.state.value} for this rid")
        self._view = SlotView(SlotState.IDLE)

    def cancel_reservation(self, rid: str) -> bool:
        """RESERVED(rid) -> IDLE. True when rid held the reservation."""
        v = self._view
        if v.state is SlotState.RESERVED and v.rid == rid:
            self._view = SlotView(SlotState.IDLE)
            return True
        return False

    def expire(self, now: float) -> str | None:
        """RESERVED past its deadline -> IDLE; the expired rid, else None."""
        v = self._view
        if v.state is SlotState.RESERVED and v.deadline is not None and now >= v.deadline:
            self._view = SlotView(SlotState.IDLE)
            return v.rid
        return None
