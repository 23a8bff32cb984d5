"""Express gate: seats per node (one until known), least-loaded hand-out, FIFO hand-over, bounded queue, timeouts,
no lost seat, never a double-booked one (a property test over any sequence of events)."""

from __future__ import annotations

import asyncio

import pytest

from expresslane.router.fleet.gate import NodeGate, NoHealthyNode, QueueFull, QueueTimeout


async def test_one_request_per_node_then_waiters_queue():
    gate = NodeGate(["a", "b"])
    l1 = await gate.acquire(max_waiting=4, max_wait_s=1)
    l2 = await gate.acquire(max_waiting=4, max_wait_s=1)
    assert {l1.node, l2.node} == {"a", "b"} and gate.busy_count == 2
    waiter = asyncio.ensure_future(gate.acquire(max_waiting=4, max_wait_s=1))
    await asyncio.sleep(0.01)
    assert not waiter.done() and gate.waiting == 1
    l1.release()
    l3 = await waiter
    assert l3.node == l1.node and gate.busy_count == 2 and gate.waiting == 0
    assert l3.waited_s > 0


async def test_waiters_are_served_first_in_first_out():
    gate = NodeGate(["a"])
    lease = await gate.acquire(max_waiting=8, max_wait_s=1)
    order: list[int] = []

    async def wait(i):
        got = await gate.acquire(max_waiting=8, max_wait_s=2)
        order.append(i)
        await asyncio.sleep(0.005)
        got.release()

    tasks = []
    for i in range(5):
        tasks.append(asyncio.ensure_future(wait(i)))
        await asyncio.sleep(0.001)
    lease.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    assert gate.busy_count == 0


async def test_a_new_request_does_not_overtake_waiters():
    gate = NodeGate(["a"])
    lease = await gate.acquire(max_waiting=8, max_wait_s=1)
    waiter = asyncio.ensure_future(gate.acquire(max_waiting=8, max_wait_s=1))
    await asyncio.sleep(0.01)
    lease.release()
    assert gate.try_acquire() is None  # the node already belongs to the waiter
    (await waiter).release()


async def test_full_queue_fails_at_once():
    gate = NodeGate(["a"])
    await gate.acquire(max_waiting=1, max_wait_s=1)
    first = asyncio.ensure_future(gate.acquire(max_waiting=1, max_wait_s=5))
    await asyncio.sleep(0.01)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(QueueFull):
        await gate.acquire(max_waiting=1, max_wait_s=5)
    assert loop.time() - t0 < 0.05
    first.cancel()
    with pytest.raises(QueueFull):  # max_waiting=0: no queue at all
        await _busy_gate_zero_queue()


async def _busy_gate_zero_queue():
    gate = NodeGate(["x"])
    await gate.acquire(max_waiting=0, max_wait_s=0)  # free node: max_waiting=0 still admits
    await gate.acquire(max_waiting=0, max_wait_s=5)


async def test_waiting_too_long_times_out_and_leaves_the_queue():
    gate = NodeGate(["a"])
    lease = await gate.acquire(max_waiting=4, max_wait_s=1)
    with pytest.raises(QueueTimeout):
        await gate.acquire(max_waiting=4, max_wait_s=0.05)
    assert gate.waiting == 0
    lease.release()
    assert gate.busy_count == 0 and gate.try_acquire() is not None


async def test_cancelled_waiter_does_not_lose_the_node():
    gate = NodeGate(["a"])
    lease = await gate.acquire(max_waiting=4, max_wait_s=1)
    doomed = asyncio.ensure_future(gate.acquire(max_waiting=4, max_wait_s=5))
    later = asyncio.ensure_future(gate.acquire(max_waiting=4, max_wait_s=5))
    await asyncio.sleep(0.01)
    lease.release()  # handed to `doomed`...
    doomed.cancel()  # ...which is cancelled before it runs: the node must move on to `later`
    with pytest.raises(asyncio.CancelledError):
        await doomed
    got = await asyncio.wait_for(later, 1)
    assert got.node == "a" and gate.busy_count == 1
    got.release()
    assert gate.busy_count == 0 and gate.waiting == 0


async def test_release_is_idempotent_and_context_manager_releases_on_error():
    gate = NodeGate(["a"])
    lease = await gate.acquire(max_waiting=1, max_wait_s=1)
    lease.release()
    lease.release()
    assert gate.busy_count == 0 and gate.busy_seats("a") == 0
    with pytest.raises(RuntimeError):
        with await gate.acquire(max_waiting=1, max_wait_s=1):
            raise RuntimeError("boom")
    assert gate.busy_count == 0


async def test_gauge_callback_sees_depth_and_busy():
    seen = []
    gate = NodeGate(["a"], on_change=lambda g: seen.append((g.waiting, g.busy_count)))
    lease = await gate.acquire(max_waiting=2, max_wait_s=1)
    w = asyncio.ensure_future(gate.acquire(max_waiting=2, max_wait_s=1))
    await asyncio.sleep(0.01)
    lease.release()
    (await w).release()
    assert (1, 1) in seen and seen[-1] == (0, 0)


# ---- membership (an express pool from DNS): nodes join and are drained -------------------------------------------

async def test_a_removed_node_is_drained_never_handed_out_again():
    gone: list[str] = []
    gate = NodeGate(["a", "b"], on_gone=gone.append)
    la = await gate.acquire(max_waiting=4, max_wait_s=1)
    lb = await gate.acquire(max_waiting=4, max_wait_s=1)
    waiter = asyncio.ensure_future(gate.acquire(max_waiting=4, max_wait_s=1))
    await asyncio.sleep(0.01)
    gate.remove(la.node)  # busy: its request keeps it to the end
    assert gate.nodes == [lb.node] and gate.draining == [la.node] and gone == []
    la.release()  # the drained node goes, and is NOT given to the waiter
    await asyncio.sleep(0.01)
    assert not waiter.done() and gone == [la.node] and gate.draining == [] and not gate.is_busy(la.node)
    lb.release()
    assert (await waiter).node == lb.node


async def test_removing_the_last_node_fails_the_waiters_at_once_and_an_empty_gate_refuses():
    gate = NodeGate(["a"])
    lease = await gate.acquire(max_waiting=4, max_wait_s=5)
    waiter = asyncio.ensure_future(gate.acquire(max_waiting=4, max_wait_s=5))
    await asyncio.sleep(0.01)
    gate.remove("a")
    with pytest.raises(NoHealthyNode, match="no node"):
        await asyncio.wait_for(waiter, 1)
    lease.release()
    with pytest.raises(NoHealthyNode, match="no node"):
        await gate.acquire(max_waiting=4, max_wait_s=5)
    assert NodeGate([]).nodes == []


async def test_a_node_that_joins_serves_the_waiters_and_only_when_available():
    up = {"a": True, "b": False}
    gate = NodeGate(["a"], available=lambda n: up[n])
    lease = await gate.acquire(max_waiting=4, max_wait_s=1)
    waiter = asyncio.ensure_future(gate.acquire(max_waiting=4, max_wait_s=1))
    await asyncio.sleep(0.01)
    gate.add("b")  # not available yet (not probed): nobody gets it
    await asyncio.sleep(0.01)
    assert not waiter.done() and gate.nodes == ["a", "b"]
    up["b"] = True
    gate.poke()  # the health monitor's change: the waiter gets the new node
    assert (await waiter).node == "b"
    lease.release()


async def test_a_draining_node_that_comes_back_stays_held_by_its_request():
    gate = NodeGate(["a"])
    lease = await gate.acquire(max_waiting=4, max_wait_s=1)
    gate.remove("a")
    gate.add("a")  # back in DNS before its request ended: no second request on it meanwhile
    assert gate.nodes == ["a"] and gate.draining == [] and gate.is_busy("a") and gate.try_acquire() is None
    lease.release()
    assert gate.try_acquire() is not None


# ---- seats: a node of S seats holds up to S leases, never more ---------------------------------------------------

async def test_a_node_of_several_seats_holds_that_many_leases_and_the_least_loaded_goes_first():
    gate = NodeGate(["a", "b"])
    gate.set_seats("a", 3)  # b's seats are not known: it counts as one
    got = [(await gate.acquire(max_waiting=4, max_wait_s=1)) for _ in range(4)]
    # least loaded first, ties to the one granted least recently: a, b, a (b full), a
    assert [g.node for g in got] == ["a", "b", "a", "a"]
    assert gate.busy_seats("a") == 3 and gate.busy_seats("b") == 1 and gate.busy_count == 4 and gate.seats_total == 4
    waiter = asyncio.ensure_future(gate.acquire(max_waiting=4, max_wait_s=1))
    await asyncio.sleep(0.01)
    assert not waiter.done()  # every seat of every node is busy: it queues
    got[1].release()  # b's seat
    assert (await waiter).node == "b"
    gate.set_seats("b", 2)  # b turns out to have two: a new request goes there (a is full)
    assert gate.try_acquire().node == "b"
    assert gate.busy_seats("b") == 2


async def test_more_seats_serve_waiters_at_once_and_fewer_let_the_busy_ones_finish():
    gate = NodeGate(["a"])
    held = await gate.acquire(max_waiting=4, max_wait_s=1)
    waiters = [asyncio.ensure_future(gate.acquire(max_waiting=4, max_wait_s=1)) for _ in range(2)]
    await asyncio.sleep(0.01)
    gate.set_seats("a", 3)  # the node's /capabilities said 3: both waiters get a seat now
    leases = [await asyncio.wait_for(w, 1) for w in waiters]
    assert gate.busy_seats("a") == 3
    gate.set_seats("a", 1)  # it restarted with one seat: nothing new until two of the three are released
    held.release()
    assert gate.try_acquire() is None
    leases[0].release()
    assert gate.try_acquire() is None
    leases[1].release()
    assert gate.try_acquire() is not None


async def test_a_draining_node_keeps_its_busy_seats_and_goes_when_the_last_is_released():
    gone: list[str] = []
    gate = NodeGate(["a"], on_gone=gone.append)
    gate.set_seats("a", 2)
    l1 = await gate.acquire(max_waiting=1, max_wait_s=1)
    l2 = await gate.acquire(max_waiting=1, max_wait_s=1)
    gate.remove("a")
    l1.release()
    assert gone == [] and gate.draining == ["a"]
    l2.release()
    assert gone == ["a"] and gate.draining == [] and gate.busy_count == 0


def test_seats_are_never_double_booked_property():
    """Any sequence of acquires, releases, cancels, seat changes, health changes and membership changes: a node
    never holds more leases than the seats it had at each grant, every lease is counted on its node exactly once,
    a waiter never waits while an available member has a free seat, waiters are served in arrival order, and
    releasing everything leaves no busy seat."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    nodes = ["a", "b", "c"]
    op = st.one_of(
        st.tuples(st.just("acquire"), st.integers(0, 3)),
        st.tuples(st.just("release"), st.integers(0, 30)),
        st.tuples(st.just("cancel"), st.integers(0, 30)),
        st.tuples(st.just("seats"), st.sampled_from(nodes), st.integers(1, 4)),
        st.tuples(st.just("health"), st.sampled_from(nodes), st.booleans()),
        st.tuples(st.just("remove"), st.sampled_from(nodes)),
        st.tuples(st.just("add"), st.sampled_from(nodes)),
    )

    async def run(ops) -> None:
        up = dict.fromkeys(nodes, True)
        gate = NodeGate(list(nodes), available=lambda n: up[n])
        grant = gate._grant

        def checked_grant(state):  # every grant, seen from outside: a free seat, on a member that takes traffic
            assert gate.busy_seats(state.node) < gate.seats(state.node), ("double-booked", state.node)
            assert up[state.node] and any(n == state.node for n in gate.nodes), ("granted off the rules", state.node)
            return grant(state)

        gate._grant = checked_grant
        held: list = []
        waiting: list[tuple[int, asyncio.Future]] = []
        served: list[int] = []
        arrivals = 0

        def check() -> None:
            live: dict[str, int] = {}
            for lease in held:
                if not lease.released:
                    live[lease.node] = live.get(lease.node, 0) + 1
            for _, w in waiting:  # handed over, not resumed yet: counted on the node already
                if w.done() and not w.cancelled() and w.exception() is None:
                    n = w.result().node
                    live[n] = live.get(n, 0) + 1
            for n in nodes:
                assert gate.busy_seats(n) == live.get(n, 0), (n, gate.busy_seats(n), live)
            if any(not w.done() for _, w in waiting):
                for n in gate.nodes:
                    if up[n]:
                        assert gate.busy_seats(n) >= gate.seats(n), ("a waiter waits beside a free seat", n)

        for o in ops:
            kind = o[0]
            if kind == "acquire":
                arrivals += 1
                i = arrivals
                task = asyncio.ensure_future(gate.acquire(max_waiting=o[1], max_wait_s=30))
                await asyncio.sleep(0)
                waiting.append((i, task))
            elif kind == "release" and held:
                held[o[1] % len(held)].release()
            elif kind == "cancel" and waiting:
                waiting[o[1] % len(waiting)][1].cancel()
            elif kind == "seats":
                gate.set_seats(o[1], o[2])
            elif kind == "health":
                up[o[1]] = o[2]
                gate.poke()
            elif kind == "remove":
                gate.remove(o[1])
            elif kind == "add":
                gate.add(o[1])
            for _ in range(3):
                await asyncio.sleep(0)
            still = []
            for i, w in waiting:
                if w.done():
                    if not w.cancelled():
                        if w.exception() is None:
                            held.append(w.result())
                            served.append(i)
                        elif not isinstance(w.exception(), (QueueFull, NoHealthyNode)):
                            raise w.exception()  # (a refusal is an answer; anything else is a bug)
                else:
                    still.append((i, w))
            waiting = still
            check()
        assert served == sorted(served)  # FIFO: a later arrival never overtakes a waiter
        for _, w in waiting:
            w.cancel()
        await asyncio.sleep(0)
        for lease in held:
            lease.release()
        assert gate.busy_count == 0 and gate.waiting == 0

    @settings(max_examples=300, deadline=None)
    @given(st.lists(op, max_size=40))
    def prop(ops):
        asyncio.run(run(ops))

    prop()
