"""The router's own event loop, watched: how late a periodic timer fires.

Every timeout, stall window and probe of the router is a timer on one asyncio loop. When that loop is blocked (a
synchronous call on it) or the process gets no CPU (a starved or frozen host), every timer fires late at once, and
the upstream that was being waited on is blamed for the router's own delay: a connect that finished in a
millisecond reads as a connect timeout. This monitor sleeps `interval_s` again and again and observes how much
later than asked it woke up, into `expresslane_router_event_loop_lag_seconds`, and logs a WARNING for a lag of
`warn_s` or more, so such a failure is read as the router's (or its host's), not the node's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["LoopLagMonitor"]

log = logging.getLogger("expresslane.router.loop")


class LoopLagMonitor:
    def __init__(self, histogram: Any, *, interval_s: float = 0.5, warn_s: float = 1.0) -> None:
        self.histogram, self.interval_s, self.warn_s = histogram, interval_s, warn_s
        self.worst_s = 0.0

    def observe(self, lag_s: float) -> None:
        lag_s = max(lag_s, 0.0)
        self.histogram.observe(lag_s)
        self.worst_s = max(self.worst_s, lag_s)
        if lag_s >= self.warn_s:
            log.warning("the router's event loop ran %.2fs late (blocked, or the process got no CPU): every "
                        "timeout and stall window in that time ran late by as much", lag_s)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Watch while inside: a chain of loop timers (no task, so entering and leaving cost the app no extra
        turn of the loop)."""
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def tick(asked_at: float) -> None:
            nonlocal handle
            now = loop.time()
            self.observe(now - asked_at - self.interval_s)
            handle = loop.call_later(self.interval_s, tick, now)

        handle = loop.call_later(self.interval_s, tick, loop.time())
        try:
            yield
        finally:
            handle.cancel()
