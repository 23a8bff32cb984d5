"""The node's one engine thread: every touch of the engine (inject, start, steps, probes) runs on it, in order.

Jobs come from the event loop with `submit(fn)` and run between steps. On a multi-seat engine the thread steps
the scheduler (decode/batch.py) whenever a request is active, running the jobs that arrived in between first, so
a request that joins (its inject, its start) holds the others up by at most one step plus that job; with nothing
active it sleeps on the job queue. On a one-seat engine a decode is a job of its own that iterates the
Generation to its end (the batch-1 loop and its greedy chain).

Each step's wall time and row count go to `on_step(rows, seconds)` (the node's metrics). A step that raises fails
every request in it (the scheduler marks them) and is logged; the thread goes on serving.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable

from ..decode import DecodeEngine

log = logging.getLogger(__name__)

_STOP = object()


class EngineThreadGone(RuntimeError):
    """The engine thread has stopped (the node is shutting down)."""


class EngineThread:
    def __init__(self, engine: DecodeEngine, on_step: Callable[[int, float], None] | None = None,
                 name: str = "expresslane-engine") -> None:
        self.engine = engine
        self.on_step = on_step
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self.steps = 0
        self.last_step_at = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Run fn(*args) on the engine thread between steps; its Future."""
        if self._stopped:
            raise EngineThreadGone("the engine thread has stopped")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fut, fn, args))
        return fut

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop after the current job or step; fail whatever is still active."""
        if self._stopped:
            return
        self._stopped = True
        self._jobs.put(_STOP)
        self._thread.join(timeout_s)

    def _run_job(self, item) -> bool:
        if item is _STOP:
            return False
        fut, fn, args = item
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the caller's Future carries it
                fut.set_exception(e)
        return True

    def _loop(self) -> None:
        scheduler = self.engine.scheduler
        try:
            while True:
                if scheduler is not None and scheduler.active:
                    while True:  # jobs that arrived during the last step, then the next step
                        try:
                            item = self._jobs.get_nowait()
                        except queue.Empty:
                            break
                        if not self._run_job(item):
                            return
                    t0 = time.perf_counter()
                    try:
                        rows = scheduler.step()
                    except Exception:  # noqa: BLE001 - the scheduler failed the step's requests already
                        log.exception("a decode step failed: its requests end with an error")
                        continue
                    self.steps += 1
                    self.last_step_at = time.monotonic()
                    if rows and self.on_step is not None:
                        self.on_step(rows, time.perf_counter() - t0)
                    continue
                if not self._run_job(self._jobs.get()):
                    return
        finally:
            if scheduler is not None:
                scheduler.cancel_all(EngineThreadGone("the node is shutting down"))
            while True:  # jobs that never ran
                try:
                    item = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    item[0].set_exception(EngineThreadGone("the node is shutting down"))
