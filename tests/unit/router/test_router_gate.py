"""Express node gate: one request per node, FIFO hand-over, bounded queue, timeouts, no lost nodes."""

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
    assert gate.busy_count == 0 and len(gate._free) == 1
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
