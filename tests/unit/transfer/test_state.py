"""The receive side's pure state table, driven directly (no sockets, no NIXL, explicit clock)."""

from __future__ import annotations

import pytest

from expresslane.engine.transfer.state import (
    Admitted,
    ReceiveTable,
    Refused,
    Rejected,
    ReqState,
    SlotState,
)

H = 4


def _table(slots: int = 2, **kw) -> ReceiveTable:
    return ReceiveTable(slots, 1000, max_seq_len=64, num_kv_heads=H, unclaimed_ttl_s=10, tombstone_ttl_s=100, **kw)


def _admit(t: ReceiveTable, rid: str, conn: int = 1, rank: int = 0, world: int = 1, now: float = 0.0,
           tokens: int = 8):
    return t.admit(rid, rank=rank, world_size=world, head_start=rank * H // world, num_heads=H // world,
                   num_tokens=tokens, conn_id=conn, now=now)


def test_happy_path_expected_writing_arrived_claimed_released() -> None:
    t = _table()
    t.expect("a", 30, now=0)
    assert t.state_of("a") is ReqState.EXPECTED and t.slots_in_use() == 1
    adm = _admit(t, "a")
    assert isinstance(adm, Admitted) and t.state_of("a") is ReqState.WRITING and t.writes_in_flight()
    out = t.landed("a", adm.generation, 0, conn_id=1, now=1)
    assert out is not None and out.state is ReqState.ARRIVED and not t.writes_in_flight()
    assert t.claim("a") is not None and t.state_of("a") is ReqState.CLAIMED
    assert t.claim("a") is None  # only once
    t.release("a", now=2)
    assert t.state_of("a") is None and t.slots_in_use() == 0


def test_two_slots_take_the_next_request_while_one_is_claimed() -> None:
    t = _table(2)
    t.expect("n", 30, 0)
    g = _admit(t, "n").generation
    t.landed("n", g, 0, 1, 0)
    t.claim("n")  # decoding
    t.expect("n+1", 30, 0)  # lands while n decodes
    assert isinstance(_admit(t, "n+1", conn=2), Admitted)
    with pytest.raises(Refused) as e:
        t.expect("n+2", 30, 0)
    assert e.value.reason == "no_slot"


@pytest.mark.parametrize("setup,reason", [
    (lambda t: None, "unknown_rid"),
    (lambda t: (t.expect("r", 30, 0), t.cancel("r", 1)), "cancelled"),
    (lambda t: (t.expect("r", 1, 0), t.tick(5)), "expired"),
    (lambda t: t.cancel("r", 0), "cancelled"),  # cancelled before it was ever expected
])
def test_kv_for_unknown_cancelled_or_expired_rids_is_rejected_at_admit(setup, reason: str) -> None:
    t = _table()
    setup(t)
    res = _admit(t, "r", now=6)
    assert isinstance(res, Rejected) and res.reason == reason
    assert t.slots_in_use() == 0


def test_admit_checks_shape_length_and_duplicates() -> None:
    t = _table()
    t.expect("r", 30, 0)
    assert _admit(t, "r", tokens=65).reason == "too_long"
    assert t.admit("r", rank=0, world_size=1, head_start=0, num_heads=3, num_tokens=8, conn_id=1,
                   now=0).reason == "bad_request"
    assert isinstance(_admit(t, "r"), Admitted)
    assert _admit(t, "r", conn=9).reason == "duplicate"  # same rank again: hijack / keepalive refused
    assert t.state_of("r") is ReqState.WRITING and len(t.requests["r"].ranks) == 1


def test_expect_extends_and_tombstones_are_forgotten() -> None:
    t = _table(1)
    t.expect("r", 1, 0)
    t.expect("r", 20, 0)  # extends, no second slot
    assert t.slots_in_use() == 1
    assert t.tick(5) == []
    (out,) = t.tick(21)
    assert out.state is ReqState.EXPIRED and t.slots_in_use() == 0
    t.expect("r", 5, 22)  # an expired rid stays expired: its waiter learns that at once
    assert t.state_of("r") is ReqState.EXPIRED and t.slots_in_use() == 0
    t.cancel("c", 23)
    with pytest.raises(Refused):
        t.expect("c", 5, 24)  # a cancelled one is refused
    t.tick(200)
    assert t.state_of("r") is None and t.state_of("c") is None


def test_an_abort_before_the_decode_takes_over_is_not_forgotten() -> None:
    """The prefill aborts (e.g. the node refused the KV as too long) between /pd/reserve and /pd/decode; the
    decode's own expect() must keep the FAILED outcome, not re-reserve the rid and wait out its timeout."""
    t = _table(1)
    t.expect("r", 30, 0)
    t.abort("r", "rejected_too_long", conn_id=1, write_final=True, now=1)
    t.expect("r", 30, 2)  # /pd/decode takes the reservation over
    assert t.state_of("r") is ReqState.FAILED and t.slots_in_use() == 0


def test_abandoned_write_fences_the_slot_until_the_connection_ends() -> None:
    t = _table(1)
    t.expect("a", 30, 0)
    _admit(t, "a", conn=1)
    out = t.cancel("a", 1)  # the client went away while the WRITE may still be landing
    assert out.state is ReqState.CANCELLED
    assert t.slots[0].state is SlotState.FENCING
    with pytest.raises(Refused):
        t.expect("b", 30, 2)  # not reused while a write may land, however long that takes
    t.tick(10_000)
    assert t.slots[0].state is SlotState.FENCING  # no timer lifts the fence
    t.connection_closed(1, 10_001)
    assert t.slots[0].state is SlotState.FREE
    t.expect("b", 30, 10_002)


def test_abort_fails_the_waiter_and_fences_unless_the_write_is_final() -> None:
    t = _table(1)
    t.expect("a", 30, 0)
    g = _admit(t, "a", conn=1).generation
    out = t.abort("a", "write_timeout", conn_id=1, write_final=False, now=1)
    assert out.state is ReqState.FAILED and out.reason == "aborted:write_timeout"
    assert t.slots[0].state is SlotState.FENCING
    t.landed("a", g, 0, conn_id=1, now=2)  # the late write's notification: it is final now
    assert t.slots[0].state is SlotState.FREE
    # abort of a merely expected rid (e.g. prefill had no staging slot): fails at once, slot free
    t.expect("b", 30, 3)
    assert t.abort("b", "no_staging_slot", conn_id=7, write_final=True, now=3).state is ReqState.FAILED
    assert t.slots_in_use() == 0 and _admit(t, "b", conn=8).reason == "failed"


def test_sender_vanished_and_failed_landing() -> None:
    t = _table(2)
    t.expect("a", 30, 0)
    _admit(t, "a", conn=1)
    (out,) = t.connection_closed(1, 1)
    assert out.reason == "sender_vanished" and t.slots_in_use() == 0
    t.expect("c", 30, 2)
    g = _admit(t, "c", conn=2).generation
    out = t.landed("c", g, 0, conn_id=2, now=3, error="checksum_mismatch")
    assert out.state is ReqState.FAILED and out.reason == "checksum_mismatch" and t.slots_in_use() == 0
    t.expect("d", 30, 4)
    g = _admit(t, "d", conn=3).generation
    t.landed("d", g, 0, conn_id=3, now=5, error="no_notification")
    assert t.slots[0].state is SlotState.FENCING or t.slots[1].state is SlotState.FENCING  # bytes may come


def test_done_from_another_connection_or_generation_is_ignored() -> None:
    t = _table()
    t.expect("a", 30, 0)
    g = _admit(t, "a", conn=1).generation
    assert t.landed("a", g, 0, conn_id=2, now=1) is None  # injected done from another connection
    assert t.landed("a", g + 1, 0, conn_id=1, now=1) is None  # stale generation
    assert t.state_of("a") is ReqState.WRITING


def test_two_ranks_arrive_when_both_landed() -> None:
    t = _table()
    t.expect("tp", 30, 0)
    g0 = _admit(t, "tp", conn=1, rank=0, world=2)
    g1 = _admit(t, "tp", conn=2, rank=1, world=2)
    assert g0.generation == g1.generation and g1.dest_offset == g0.dest_offset + 500
    assert t.landed("tp", g0.generation, 0, 1, 1) is None
    assert t.landed("tp", g1.generation, 1, 2, 1).state is ReqState.ARRIVED


def test_unclaimed_arrival_expires_and_frees() -> None:
    t = _table(1)
    t.expect("a", 1, 0)
    g = _admit(t, "a").generation
    t.landed("a", g, 0, 1, 1)
    assert t.tick(5) == []  # unclaimed_ttl_s=10 from arrival
    (out,) = t.tick(12)
    assert out.state is ReqState.EXPIRED and t.slots_in_use() == 0


def test_a_connection_the_node_closed_keeps_its_writes_fenced_until_their_notification() -> None:
    t = _table(1)
    t.expect("a", 30, 0)
    g = _admit(t, "a", conn=1).generation
    (out,) = t.connection_closed(1, 1, peer_closed=False)  # e.g. the write deadline passed
    assert out.reason == "sender_vanished" and t.slots[0].state is SlotState.FENCING
    assert t.fenced_writes() == [("a", 1, g, 0)]
    t.write_final(1, g, 0, 2)  # its notification arrived: no byte of it can land any more
    assert t.slots[0].state is SlotState.FREE
