"""The node's request slot state machine, driven directly (pure: the clock is an argument)."""

from __future__ import annotations

import pytest

from expresslane.engine.server.slot import NotReserved, RequestSlot, SlotBusy, SlotError, SlotState


def serve(slot: RequestSlot, rid: str, now: float = 0.0) -> None:
    slot.reserve(rid, 5.0, now)
    slot.take(rid, now)
    slot.advance(rid, SlotState.INJECTING)
    slot.advance(rid, SlotState.DECODING)


def test_full_cycle_returns_to_idle() -> None:
    slot = RequestSlot()
    assert slot.state is SlotState.IDLE and slot.rid is None
    assert slot.reserve("a", 5.0, now=10.0) is True
    assert slot.view.state is SlotState.RESERVED and slot.view.deadline == 15.0
    slot.take("a", now=11.0)
    assert slot.state is SlotState.WAITING_KV and slot.view.deadline is None
    slot.advance("a", SlotState.INJECTING)
    slot.advance("a", SlotState.DECODING)
    slot.finish("a")
    assert slot.state is SlotState.FINISHING
    with pytest.raises(SlotBusy):  # still touching the engine: nobody else gets in
        slot.reserve("b", 5.0, now=12.0)
    slot.release("a")
    assert slot.state is SlotState.IDLE
    assert slot.reserve("b", 5.0, now=12.0) is True


def test_reserve_same_rid_refreshes_other_rid_is_busy() -> None:
    slot = RequestSlot()
    slot.reserve("a", 1.0, now=0.0)
    assert slot.reserve("a", 3.0, now=0.5) is False
    assert slot.view.deadline == 3.5
    with pytest.raises(SlotBusy):
        slot.reserve("b", 1.0, now=1.0)


def test_reservation_expires_at_its_deadline() -> None:
    slot = RequestSlot()
    slot.reserve("a", 1.0, now=0.0)
    assert slot.expire(0.99) is None and slot.state is SlotState.RESERVED
    assert slot.expire(1.0) == "a" and slot.state is SlotState.IDLE
    slot.reserve("a", 1.0, now=2.0)
    with pytest.raises(NotReserved):  # take after the deadline: expired on the spot
        slot.take("a", now=3.5)
    assert slot.state is SlotState.IDLE
    slot.reserve("x", 1.0, now=4.0)
    assert slot.reserve("y", 1.0, now=5.0) is True  # an expired holder does not block a new rid


def test_take_needs_a_live_reservation_of_that_rid() -> None:
    slot = RequestSlot()
    with pytest.raises(NotReserved):
        slot.take("a", now=0.0)
    slot.reserve("a", 5.0, now=0.0)
    with pytest.raises(NotReserved):
        slot.take("b", now=0.0)
    assert slot.cancel_reservation("b") is False
    assert slot.cancel_reservation("a") is True and slot.state is SlotState.IDLE
    with pytest.raises(NotReserved):
        slot.take("a", now=0.0)


def test_second_decode_of_a_serving_rid_is_busy_not_a_takeover() -> None:
    slot = RequestSlot()
    serve(slot, "a")
    with pytest.raises(SlotBusy):
        slot.take("a", now=0.0)
    assert slot.cancel_reservation("a") is False and slot.state is SlotState.DECODING


@pytest.mark.parametrize("bad", [
    lambda s: s.advance("a", SlotState.DECODING),  # skips INJECTING
    lambda s: s.advance("b", SlotState.INJECTING),  # other rid
    lambda s: s.release("a"),  # not finished
    lambda s: s.finish("b"),
])
def test_illegal_transitions_are_refused(bad) -> None:
    slot = RequestSlot()
    slot.reserve("a", 5.0, now=0.0)
    slot.take("a", now=0.0)
    with pytest.raises(SlotError):
        bad(slot)
    assert slot.state is SlotState.WAITING_KV


def test_finish_from_each_active_state() -> None:
    for stop_at in (SlotState.WAITING_KV, SlotState.INJECTING, SlotState.DECODING):
        slot = RequestSlot()
        slot.reserve("a", 5.0, now=0.0)
        slot.take("a", now=0.0)
        for phase in (SlotState.INJECTING, SlotState.DECODING):
            if slot.state is stop_at:
                break
            slot.advance("a", phase)
        slot.finish("a")
        slot.release("a")
        assert slot.state is SlotState.IDLE


def test_bad_ttl() -> None:
    with pytest.raises(ValueError):
        RequestSlot().reserve("a", 0.0, now=0.0)
