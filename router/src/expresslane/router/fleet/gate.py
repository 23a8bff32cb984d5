"""Express node gate: at most ONE request in flight per node, and a bounded FIFO queue in front.

`NodeGate.acquire(max_waiting, max_wait_s)` returns a `Lease` on a free node, waiting in FIFO order
behind earlier requests when all nodes are busy. It raises `QueueFull` at once when `max_waiting`
requests already wait, and `QueueTimeout` after `max_wait_s`. A released node goes straight to the
oldest waiter. A waiter that is cancelled (client gone) or times out just as a node was handed to it
passes the node on, so no node is ever lost. `Lease.release()` is idempotent and synchronous, so it is
safe in every `finally`, even inside a cancelled task.

Health: `available(node)` (default: always) says whether a node may be handed out (health.py's breaker).
An unavailable node is never given to a request; when no node of the gate is available at all, `acquire`
raises `NoHealthyNode` at once (and so do the requests already waiting), instead of queueing for a node that
is down. `poke()` re-runs the hand-over after a health change (a node came back, or all went down).

Membership (an express pool from DNS: discovery.py): `add(node)` puts a node in the gate (handed out under the same
rules: one request at a time, only while `available`); `remove(node)` drains it: it is never handed out again, a
request holding it keeps it until that request ends, and then the node leaves the gate (`on_gone(node)`). A node
added back while still draining is simply kept. A gate may have no node at all (a DNS pool that resolved to
nothing): `acquire` then raises NoHealthyNode.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

__all__ = ["Lease", "NoHealthyNode", "NodeGate", "QueueFull", "QueueTimeout"]

N = TypeVar("N")


class QueueFull(Exception):
    """`max_waiting` requests already wait for a node."""

    reason = "queue_full"


class QueueTimeout(Exception):
    """No node became free within `max_wait_s`."""

    reason = "queue_timeout"


class NoHealthyNode(Exception):
    """Every node of the gate is known down (ejected by the health monitor)."""

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


class NodeGate(Generic[N]):
    def __init__(self, nodes: Sequence[N], *, on_change: Callable[["NodeGate[N]"], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, available: Callable[[N], bool] | None = None,
                 on_gone: Callable[[N], None] | None = None):
        self.nodes = list(nodes)
        self.draining: list[N] = []  # removed, still held by a request
        self._free: deque[N] = deque(self.nodes)  # least recently used first
        self._busy: set[int] = set()
        self._waiters: deque[asyncio.Future[N]] = deque()
        self._on_change = on_change
        self._clock = clock
        self._available = available or (lambda node: True)
        self._on_gone = on_gone or (lambda node: None)

    # ---- state ---------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    def is_busy(self, node: N) -> bool:
        return id(node) in self._busy

    @property
    def busy_count(self) -> int:
        return len(self._busy)

    # ---- acquire / release -------------------------------------------------------------------
    @property
    def any_available(self) -> bool:
        return any(self._available(n) for n in self.nodes)

    def _pop_free(self) -> N | None:
        for node in self._free:
            if self._available(node):
                self._free.remove(node)
                return node
        return None

    def try_acquire(self) -> Lease[N] | None:
        if not self.waiting:
            node = self._pop_free()
            if node is not None:
                return self._take(node, 0.0)
        return None

    async def acquire(self, *, max_waiting: int, max_wait_s: float) -> Lease[N]:
        lease = self.try_acquire()
        if lease is not None:
            return lease
        if not self.any_available:
            raise NoHealthyNode(self._none_left("are down"))
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
                # A node was handed over in the same instant we gave up: pass it on.
                self._release(fut.result())
            else:
                fut.cancel()
            self._prune()
            self._changed()
            if isinstance(exc, TimeoutError):
                raise QueueTimeout(f"no node became free within {max_wait_s:g}s") from None
            raise
        self._prune()
        return self._take(node, self._clock() - t0, already_busy=True)

    def _take(self, node: N, waited_s: float, *, already_busy: bool = False) -> Lease[N]:
        if not already_busy:
            self._busy.add(id(node))
        self._changed()
        return Lease(self, node, waited_s)

    # ---- membership ----------------------------------------------------------------------------
    def add(self, node: N) -> None:
        """A node joined: handed out from now on (a draining node that comes back is kept as it is)."""
        if any(n is node for n in self.nodes):
            return
        self.nodes.append(node)
        if any(n is node for n in self.draining):
            self.draining = [n for n in self.draining if n is not node]  # still busy: freed by its release
            self._changed()
            return
        self._free.append(node)
        self._busy.discard(id(node))
        self.poke()
        self._changed()

    def remove(self, node: N) -> None:
        """A node left: never handed out again; a request holding it keeps it to its end (drain)."""
        if not any(n is node for n in self.nodes):
            return
        self.nodes = [n for n in self.nodes if n is not node]
        if self.is_busy(node):
            self.draining.append(node)
        else:
            self._free = deque(n for n in self._free if n is not node)
            self._on_gone(node)
        self.poke()  # the last available node gone: the waiters fail at once (NoHealthyNode)
        self._changed()

    def _release(self, node: N) -> None:
        if any(n is node for n in self.draining):
            self.draining = [n for n in self.draining if n is not node]
            self._busy.discard(id(node))
            self._on_gone(node)
            self._changed()
            return
        if self._available(node):
            while self._waiters:
                w = self._waiters.popleft()
                if not w.done():
                    w.set_result(node)  # stays busy: ownership moves to the waiter
                    self._changed()
                    return
        self._busy.discard(id(node))
        self._free.append(node)
        self._changed()

    def poke(self) -> None:
        """Health changed: hand free nodes that came back to waiters; fail the waiters if none is left."""
        if not self.any_available:
            for w in self._waiters:
                if not w.done():
                    w.set_exception(NoHealthyNode(self._none_left("went down")))
            self._prune()
            self._changed()
            return
        while self.waiting:
            node = self._pop_free()
            if node is None:
                break
            self._busy.add(id(node))
            self._release(node)

    def _none_left(self, verb: str) -> str:
        return f"all {len(self.nodes)} node(s) {verb}" if self.nodes else "the pool has no node (its DNS name has no address)"

    def _prune(self) -> None:
        while self._waiters and self._waiters[0].done():
            self._waiters.popleft()
        if any(w.done() for w in self._waiters):
            self._waiters = deque(w for w in self._waiters if not w.done())

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)
