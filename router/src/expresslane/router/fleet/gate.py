"""The express gate: seats on express nodes, and a bounded FIFO queue in front.

An express node serves up to S requests at once, each in a seat of its own (its `GET /capabilities` says
`"seats": S`; a node that does not say, and every `kind: tilert` node, has one). The gate holds at most S leases on a
node of S seats, never more: a seat is never double-booked. Until a node's seats are known it counts as one
(`set_seats` tells the gate; capabilities.CapabilityRouter learns them).

`NodeGate.acquire(max_waiting, max_wait_s)` returns a `Lease` on the least-loaded node that takes traffic (fewest
busy seats; ties: the node granted least recently), waiting in FIFO order behind earlier requests when every seat of
every such node is busy. It raises `QueueFull` at once when `max_waiting` requests already wait, and `QueueTimeout`
after `max_wait_s`. A freed seat goes straight to the oldest waiter. A waiter that is cancelled (client gone) or times
out just as a seat was handed to it passes the seat on, so no seat is ever lost. `Lease.release()` is idempotent and
synchronous, so it is safe in every `finally`, even inside a cancelled task.

Health: `available(node)` (default: always) says whether a node may be handed out (fleet/health.py: healthy and not
ejected, or its pool panics). An unavailable node is never given to a request; when no node of the gate is available
at all, `acquire` raises `NoHealthyNode` at once (and so do the requests already waiting), instead of queueing for a
node that takes no traffic. `poke()` re-runs the hand-over after a change (health, seats, membership).

Membership (an express pool from DNS: discovery.py): `add(node)` puts a node in the gate (handed out under the same
rules); `remove(node)` drains it: it is never handed out again, the requests holding its seats keep them until they
end, and then the node leaves the gate (`on_gone(node)`). A node added back while still draining is simply kept, its
busy seats with it. A gate may have no node at all (a DNS pool that resolved to nothing): `acquire` then raises
NoHealthyNode.

Per node: 0 <= busy <= seats at every grant (a node whose seats shrank below its busy ones gets no grant until enough
of them are released). The grant order is the module's only policy: least busy seats first, then least recently
granted (what "least loaded" means for nodes whose every seat decodes as fast as the next).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

__all__ = ["Lease", "NoHealthyNode", "NodeGate", "QueueFull", "QueueTimeout"]

N = TypeVar("N")


class QueueFull(Exception):
    """`max_waiting` requests already wait for a seat."""

    reason = "queue_full"


class QueueTimeout(Exception):
    """No seat became free within `max_wait_s`."""

    reason = "queue_timeout"


class NoHealthyNode(Exception):
    """No node of the gate takes traffic (or the gate has none)."""

    reason = "no_healthy_node"


class Lease(Generic[N]):
    def __init__(self, gate: "NodeGate[N]", node: N, waited_s: float):
        self._gate = gate
        self.node = node
        self.waited_s = waited_s
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._gate._release(self.node)

    def __enter__(self) -> "Lease[N]":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Node(Generic[N]):
    __slots__ = ("node", "seats", "busy", "granted_at")

    def __init__(self, node: N, seats: int, granted_at: int) -> None:
        self.node = node
        self.seats = seats
        self.busy = 0
        self.granted_at = granted_at  # the grant counter at its last grant (least recently granted first)


class NodeGate(Generic[N]):
    def __init__(self, nodes: Sequence[N], *, on_change: Callable[["NodeGate[N]"], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, available: Callable[[N], bool] | None = None,
                 on_gone: Callable[[N], None] | None = None):
        self._order = itertools.count()
        self._state: dict[int, _Node[N]] = {}  # id(node) -> its seats; members and draining nodes
        self.nodes: list[N] = []
        self.draining: list[N] = []  # removed, seats still held by requests
        for n in nodes:
            self.nodes.append(n)
            self._state[id(n)] = _Node(n, 1, self._never_granted())
        self._waiters: deque[asyncio.Future[N]] = deque()
        self._on_change = on_change
        self._clock = clock
        self._available = available or (lambda node: True)
        self._on_gone = on_gone or (lambda node: None)

    def _never_granted(self) -> int:
        """A grant stamp older than every real grant (nodes never granted come first, in the order they came)."""
        return next(self._order) - (1 << 62)

    # ---- state ---------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    def seats(self, node: N) -> int:
        s = self._state.get(id(node))
        return s.seats if s is not None else 0

    def busy_seats(self, node: N) -> int:
        s = self._state.get(id(node))
        return s.busy if s is not None else 0

    def is_busy(self, node: N) -> bool:
        """Whether any seat of `node` is held."""
        return self.busy_seats(node) > 0

    @property
    def busy_count(self) -> int:
        """Busy seats over every node, draining ones included."""
        return sum(s.busy for s in self._state.values())

    @property
    def seats_total(self) -> int:
        """Seats of the member nodes (draining ones excluded: they take no new request)."""
        return sum(self._state[id(n)].seats for n in self.nodes)

    @property
    def busy_nodes(self) -> int:
        return sum(1 for s in self._state.values() if s.busy)

    # ---- seats --------------------------------------------------------------------------------
    def set_seats(self, node: N, seats: int) -> None:
        """`node` has `seats` seats (>= 1; what its /capabilities said). More seats serve waiters at once; fewer
        let the busy ones finish first."""
        s = self._state.get(id(node))
        if s is None or s.seats == max(1, seats):
            return
        s.seats = max(1, seats)
        self.poke()
        self._changed()

    # ---- acquire / release -------------------------------------------------------------------
    @property
    def any_available(self) -> bool:
        return any(self._available(n) for n in self.nodes)

    def _pick(self) -> _Node[N] | None:
        """The least-loaded member with a free seat that takes traffic (fewest busy, then least recently granted)."""
        best: _Node[N] | None = None
        for n in self.nodes:
            s = self._state[id(n)]
            if s.busy < s.seats and (best is None or (s.busy, s.granted_at) < (best.busy, best.granted_at)) \
                    and self._available(n):
                best = s
        return best

    def _grant(self, s: _Node[N]) -> N:
        assert s.busy < s.seats, "a seat is never double-booked"
        s.busy += 1
        s.granted_at = next(self._order)
        return s.node

    def try_acquire(self) -> Lease[N] | None:
        if not self.waiting:
            s = self._pick()
            if s is not None:
                node = self._grant(s)
                self._changed()
                return Lease(self, node, 0.0)
        return None

    async def acquire(self, *, max_waiting: int, max_wait_s: float) -> Lease[N]:
        lease = self.try_acquire()
        if lease is not None:
            return lease
        if not self.any_available:
            raise NoHealthyNode(self._none_left("take no traffic"))
        if self.waiting >= max_waiting:
            raise QueueFull(f"{self.waiting} requests already wait (max_waiting={max_waiting})")
        t0 = self._clock()
        fut: asyncio.Future[N] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._changed()
        try:
            async with asyncio.timeout(max_wait_s):
                node = await asyncio.shield(fut)
        except BaseException as exc:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # A seat was handed over in the same instant we gave up: pass it on.
                self._release(fut.result())
            else:
                fut.cancel()
            self._prune()
            self._changed()
            if isinstance(exc, TimeoutError):
                raise QueueTimeout(f"no express seat became free within {max_wait_s:g}s") from None
            raise
        self._prune()
        return Lease(self, node, self._clock() - t0)  # its seat was counted when it was handed over

    # ---- membership ----------------------------------------------------------------------------
    def add(self, node: N) -> None:
        """A node joined: handed out from now on (a draining node that comes back keeps its busy seats)."""
        if any(n is node for n in self.nodes):
            return
        self.nodes.append(node)
        if any(n is node for n in self.draining):
            self.draining = [n for n in self.draining if n is not node]
        elif id(node) not in self._state:
            self._state[id(node)] = _Node(node, 1, self._never_granted())
        self.poke()
        self._changed()

    def remove(self, node: N) -> None:
        """A node left: never handed out again; the requests holding its seats keep them to their end (drain)."""
        if not any(n is node for n in self.nodes):
            return
        self.nodes = [n for n in self.nodes if n is not node]
        if self.is_busy(node):
            self.draining.append(node)
        else:
            del self._state[id(node)]
            self._on_gone(node)
        self.poke()  # the last available node gone: the waiters fail at once (NoHealthyNode)
        self._changed()

    def _release(self, node: N) -> None:
        s = self._state.get(id(node))
        if s is None or s.busy <= 0:
            return
        s.busy -= 1
        if any(n is node for n in self.draining):
            if s.busy == 0:
                self.draining = [n for n in self.draining if n is not node]
                del self._state[id(node)]
                self._on_gone(node)
        else:
            self._dispatch()
        self._changed()

    def _dispatch(self) -> None:
        """Hand free seats to the waiters, oldest first, each to the least-loaded node that takes traffic."""
        while self._waiters:
            w = self._waiters[0]
            if w.done():
                self._waiters.popleft()
                continue
            s = self._pick()
            if s is None:
                return
            self._waiters.popleft()
            w.set_result(self._grant(s))  # the seat is the waiter's from now on

    def poke(self) -> None:
        """Something changed (health, seats, membership): hand free seats to waiters; fail the waiters if no node
        takes traffic any more."""
        if not self.any_available:
            for w in self._waiters:
                if not w.done():
                    w.set_exception(NoHealthyNode(self._none_left("stopped taking traffic")))
            self._prune()
            self._changed()
            return
        if self.waiting:
            self._dispatch()
            self._changed()

    def _none_left(self, verb: str) -> str:
        return (f"all {len(self.nodes)} node(s) {verb}" if self.nodes
                else "the pool has no node (its DNS name has no address)")

    def _prune(self) -> None:
        while self._waiters and self._waiters[0].done():
            self._waiters.popleft()
        if any(w.done() for w in self._waiters):
            self._waiters = deque(w for w in self._waiters if not w.done())

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)
