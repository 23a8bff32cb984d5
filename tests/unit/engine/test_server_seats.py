"""The node's seats as state machines, driven directly (pure: the clock is an argument): each seat's lifecycle,
and over random operation sequences that no seat is ever held by two rids nor a rid by two seats."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from expresslane.engine.server.seats import (ACTIVE_STATES, NotReserved, SeatError, SeatsBusy, SeatState,
                                             SeatTable)


def serve(table: SeatTable, rid: str, now: float = 0.0) -> int:
    seat, _ = table.reserve(rid, 5.0, now)
    table.take(rid, now)
    table.advance(rid, SeatState.INJECTING)
    table.advance(rid, SeatState.DECODING)
    return seat


def test_full_cycle_returns_to_idle() -> None:
    table = SeatTable(1)
    assert table.views[0].state is SeatState.IDLE and table.seat_of("a") is None
    assert table.reserve("a", 5.0, now=10.0) == (0, True)
    assert table.views[0].state is SeatState.RESERVED and table.views[0].deadline == 15.0
    assert table.take("a", now=11.0) == 0
    assert table.views[0].state is SeatState.WAITING_KV and table.views[0].deadline is None
    table.advance("a", SeatState.INJECTING)
    table.advance("a", SeatState.DECODING)
    table.finish("a")
    assert table.views[0].state is SeatState.FINISHING
    with pytest.raises(SeatsBusy):  # still touching the engine: nobody else gets in
        table.reserve("b", 5.0, now=12.0)
    table.release("a")
    assert table.views[0].state is SeatState.IDLE and table.seat_of("a") is None
    assert table.reserve("b", 5.0, now=12.0) == (0, True)


def test_each_rid_gets_its_own_seat_until_all_are_held() -> None:
    table = SeatTable(3)
    assert [table.reserve(r, 5.0, 0.0)[0] for r in "abc"] == [0, 1, 2]
    assert table.busy == 3 and table.free == 0
    with pytest.raises(SeatsBusy, match="all 3 seats"):
        table.reserve("d", 5.0, 0.0)
    assert table.cancel_reservation("b")
    assert table.reserve("d", 5.0, 0.0) == (1, True)  # the freed seat
    assert {table.seat_of(r) for r in "acd"} == {0, 1, 2}


def test_reserve_same_rid_refreshes_its_seat() -> None:
    table = SeatTable(2)
    table.reserve("a", 1.0, now=0.0)
    assert table.reserve("a", 3.0, now=0.5) == (0, False)
    assert table.views[0].deadline == 3.5 and table.busy == 1


def test_reservations_expire_at_their_deadlines() -> None:
    table = SeatTable(2)
    table.reserve("a", 1.0, now=0.0)
    table.reserve("b", 2.0, now=0.0)
    assert table.next_deadline() == 1.0
    assert table.expire(0.99) == [] and table.busy == 2
    assert table.expire(1.0) == ["a"] and table.seat_of("a") is None and table.seat_of("b") == 1
    assert table.next_deadline() == 2.0
    table.reserve("a", 1.0, now=2.5)  # b expires on the spot here, whoever asks
    assert table.seat_of("b") is None
    with pytest.raises(NotReserved):  # take after the deadline: expired on the spot
        table.take("a", now=3.5)
    assert table.busy == 0


def test_take_needs_a_live_reservation_of_that_rid() -> None:
    table = SeatTable(2)
    with pytest.raises(NotReserved):
        table.take("a", now=0.0)
    table.reserve("a", 5.0, now=0.0)
    with pytest.raises(NotReserved):
        table.take("b", now=0.0)
    assert table.cancel_reservation("b") is False
    assert table.cancel_reservation("a") is True and table.busy == 0
    with pytest.raises(NotReserved):
        table.take("a", now=0.0)


def test_a_serving_rid_is_never_admitted_twice() -> None:
    table = SeatTable(2)
    serve(table, "a")
    with pytest.raises(SeatsBusy):  # a second /pd/decode of the same rid
        table.take("a", now=0.0)
    with pytest.raises(SeatsBusy):  # a second reservation under the same rid, although a seat is free
        table.reserve("a", 5.0, now=0.0)
    assert table.cancel_reservation("a") is False and table.view_of("a").state is SeatState.DECODING
    assert table.busy == 1


@pytest.mark.parametrize("bad", [
    lambda t: t.advance("a", SeatState.DECODING),  # skips INJECTING
    lambda t: t.advance("b", SeatState.INJECTING),  # other rid
    lambda t: t.release("a"),  # not finished
    lambda t: t.finish("b"),
])
def test_illegal_transitions_are_refused(bad) -> None:
    table = SeatTable(2)
    table.reserve("a", 5.0, now=0.0)
    table.take("a", now=0.0)
    with pytest.raises(SeatError):
        bad(table)
    assert table.view_of("a").state is SeatState.WAITING_KV


def test_finish_from_each_active_state() -> None:
    for stop_at in ACTIVE_STATES:
        table = SeatTable(1)
        table.reserve("a", 5.0, now=0.0)
        table.take("a", now=0.0)
        for phase in (SeatState.INJECTING, SeatState.DECODING):
            if table.view_of("a").state is stop_at:
                break
            table.advance("a", phase)
        table.finish("a")
        table.release("a")
        assert table.busy == 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        SeatTable(2).reserve("a", 0.0, now=0.0)
    with pytest.raises(ValueError):
        SeatTable(0)


RIDS = st.sampled_from(["r0", "r1", "r2", "r3", "r4", "r5"])


class SeatsMachine(RuleBasedStateMachine):
    """Random reserve / take / advance / finish / release / cancel / expire on 3 seats, against a model of who
    holds what: a seat is never double-booked and the table never loses a seat."""

    def __init__(self) -> None:
        super().__init__()
        self.table = SeatTable(3)
        self.now = 0.0
        self.held: dict[str, SeatState] = {}  # the model: rid -> state

    def _try(self, fn, *args):
        try:
            return fn(*args)
        except SeatError:
            return None

    @rule(dt=st.floats(0.0, 2.0))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule(rid=RIDS, ttl=st.floats(0.1, 3.0))
    def reserve(self, rid: str, ttl: float) -> None:
        expired = self.table.expire(self.now)
        for r in expired:
            self.held.pop(r)
        before = self.held.get(rid)
        got = self._try(self.table.reserve, rid, ttl, self.now)
        if got is None:
            assert before not in (None, SeatState.RESERVED) or len(self.held) == 3
        else:
            assert before in (None, SeatState.RESERVED)
            self.held[rid] = SeatState.RESERVED

    @rule(rid=RIDS)
    def take(self, rid: str) -> None:
        for r in self.table.expire(self.now):
            self.held.pop(r)
        if self._try(self.table.take, rid, self.now) is not None:
            assert self.held.get(rid) is SeatState.RESERVED
            self.held[rid] = SeatState.WAITING_KV

    @rule(rid=RIDS)
    def advance(self, rid: str) -> None:
        nxt = {SeatState.WAITING_KV: SeatState.INJECTING, SeatState.INJECTING: SeatState.DECODING}
        state = self.held.get(rid)
        if state in nxt:
            self.table.advance(rid, nxt[state])
            self.held[rid] = nxt[state]

    @rule(rid=RIDS)
    def finish(self, rid: str) -> None:
        if self.held.get(rid) in ACTIVE_STATES:
            self.table.finish(rid)
            self.held[rid] = SeatState.FINISHING

    @rule(rid=RIDS)
    def release(self, rid: str) -> None:
        if self.held.get(rid) is SeatState.FINISHING:
            self.table.release(rid)
            del self.held[rid]

    @rule(rid=RIDS)
    def cancel(self, rid: str) -> None:
        if self.table.cancel_reservation(rid):
            assert self.held.pop(rid) is SeatState.RESERVED

    @invariant()
    def never_double_booked(self) -> None:
        views = self.table.views
        rids = [v.rid for v in views if v.rid is not None]
        assert len(rids) == len(set(rids))  # a rid holds one seat
        assert all((v.rid is None) == (v.state is SeatState.IDLE) for v in views)  # a held seat names its rid
        for rid, state in self.held.items():
            v = self.table.view_of(rid)
            assert v is not None and v.state is state and views[v.index].rid == rid
        assert self.table.busy == len(self.held) <= 3


TestSeatsMachine = SeatsMachine.TestCase
TestSeatsMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
