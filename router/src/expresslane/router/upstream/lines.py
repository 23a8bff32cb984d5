"""The lines of a streamed upstream reply (the native lane's SSE, an express node's NDJSON), every wait bounded."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx

from ..errors import UpstreamError, UpstreamTimeout
from ..resilience import Deadline
from .errors import map_transport_error

__all__ = ["LineReader", "iter_lines", "loads_line", "wait_alive"]

T = TypeVar("T")


async def iter_lines(resp: httpx.Response, *, stage: str, url: str) -> AsyncIterator[str]:
    try:
        async for line in resp.aiter_lines():
            yield line
    except httpx.HTTPError as e:
        raise map_transport_error(e, stage=stage, url=url) from None


async def wait_alive(aw: Awaitable[T], *, want_s: float, deadline: Deadline, alive: Callable[[float], bool] | None,
                     stage: str, what: str) -> T:
    """Await `aw` within `want_s`, extended window by window while `alive(want_s)` says the upstream showed life in
    the last window (busy, not dead), and never past the request's deadline. Raises UpstreamTimeout kind "stall"
    (silent, and no sign of life in the last window: `what` names the wait) or "deadline"; `aw`'s own errors as they
    are (httpx errors mapped by the caller)."""
    left = deadline.left()
    if left <= 0:
        if asyncio.iscoroutine(aw):
            aw.close()
        raise UpstreamTimeout(f"{stage}: the request deadline ({deadline.total_s:g}s) passed", stage=stage,
                              kind="deadline")
    loop = asyncio.get_running_loop()
    stalled = False
    watchdog: asyncio.TimerHandle | None = None

    def check() -> None:  # at each window's end: wait on while the upstream is alive, else cut now
        nonlocal watchdog, stalled
        if alive is not None and alive(want_s):
            watchdog = loop.call_later(want_s, check)
        else:
            stalled = True
            cm.reschedule(loop.time())

    try:
        async with asyncio.timeout(left) as cm:  # the deadline; the watchdog expires it early on a stall
            watchdog = loop.call_later(want_s, check) if want_s < left else None
            try:
                return await aw
            finally:
                if watchdog is not None:
                    watchdog.cancel()
    except TimeoutError:
        if stalled:
            raise UpstreamTimeout(f"{stage}: {what} for {want_s:g}s (stalled)", stage=stage, kind="stall") from None
        raise UpstreamTimeout(f"{stage}: the request deadline ({deadline.total_s:g}s) passed", stage=stage,
                              kind="deadline") from None


class LineReader:
    """The lines of a streamed reply, every wait bounded: the first line by `first_s`, each later one by
    `next_s` (the stall timeout), all of them by the request's deadline. A wait that runs out raises
    UpstreamTimeout kind "stall" (or "deadline"); a broken connection the mapped transport error.

    `alive(window_s)` (optional): whether the upstream showed life within the last window_s seconds (a passing
    health probe, another leg completed there, a line of another stream: fleet/health.HealthMonitor.alive_within).
    A silence past the window from an upstream that is alive is a busy server, not a dead one: the wait goes on,
    window by window, up to the request's deadline, for the first line as for later ones; the stream is cut as
    stalled at the first window in which the upstream showed no life. Without that signal a silence is a stall: a
    stock vLLM decode server under a burst of 256 requests on 2 CPUs went silent for more than 10 s on 14 streams
    that then completed (tests/integration/test_burst.py), and the timer alone cut them. The client library's own
    per-read timeout must not cut the wait first: the callers open streams with the request's deadline as their
    read timeout. `on_line()` (optional) is called for each line (the node's sign of life for the others)."""

    def __init__(self, resp: httpx.Response, *, stage: str, url: str, first_s: float, next_s: float,
                 deadline: Deadline, alive: Callable[[float], bool] | None = None,
                 on_line: Callable[[], None] | None = None):
        self._it = resp.aiter_lines().__aiter__()
        self.stage, self.url = stage, url
        self._first_s, self._next_s, self._deadline = first_s, next_s, deadline
        self._alive = alive
        self._on_line = on_line
        self.lines = 0
        self.waited_alive = 0  # windows that the upstream's liveness carried on

    def _alive_counted(self, window_s: float) -> bool:
        ok = self._alive is not None and self._alive(window_s)
        if ok:
            self.waited_alive += 1
        return ok

    async def next(self) -> str | None:
        """The next line, or None at the end of the stream."""
        want = self._first_s if self.lines == 0 else self._next_s
        what = (f"{self.url} sent nothing" if self.lines else f"{self.url} sent no first line")
        try:
            line = await wait_alive(self._it.__anext__(), want_s=want, deadline=self._deadline,
                                    alive=self._alive_counted if self._alive is not None else None, stage=self.stage,
                                    what=what)
        except StopAsyncIteration:
            return None
        except httpx.HTTPError as e:
            raise map_transport_error(e, stage=self.stage, url=self.url) from None
        self.lines += 1
        if self._on_line is not None:
            self._on_line()
        return line

    async def __aiter__(self) -> AsyncIterator[str]:
        while (line := await self.next()) is not None:
            yield line


def loads_line(line: str, *, stage: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except ValueError:
        raise UpstreamError(f"{stage}: bad line from upstream: {line[:200]!r}", stage=stage) from None
    if not isinstance(obj, dict):
        raise UpstreamError(f"{stage}: bad line from upstream: {line[:200]!r}", stage=stage)
    return obj
