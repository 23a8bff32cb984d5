"""The lines of a streamed upstream reply (the native lane's SSE, an express node's NDJSON), every wait bounded."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from ..errors import UpstreamError, UpstreamTimeout
from ..resilience import Deadline
from .errors import map_transport_error

__all__ = ["LineReader", "iter_lines", "loads_line"]


async def iter_lines(resp: httpx.Response, *, stage: str, url: str) -> AsyncIterator[str]:
    try:
        async for line in resp.aiter_lines():
            yield line
    except httpx.HTTPError as e:
        raise map_transport_error(e, stage=stage, url=url) from None


class LineReader:
    """The lines of a streamed reply, every wait bounded: the first line by `first_s`, each later one by
    `next_s` (the stall timeout), all of them by the request's deadline. A wait that runs out raises
    UpstreamTimeout kind "stall" (or "deadline"); a broken connection the mapped transport error.

    `alive(window_s)` (optional): whether the upstream showed it is alive within the last window_s seconds (its
    health probes answered). A later line's silence past `next_s` from an upstream that is alive is a busy server,
    not a dead one: the wait goes on, window by window, up to the request's deadline; the stream is cut as stalled
    at the first window in which the upstream did not answer. Without that signal a silence is a stall: a stock
    vLLM decode server under a burst of 256 requests on 2 CPUs went silent for more than 10 s on 14 streams that
    then completed (tests/integration/test_burst.py), and the timer alone cut them."""

    def __init__(self, resp: httpx.Response, *, stage: str, url: str, first_s: float, next_s: float,
                 deadline: Deadline, alive: Callable[[float], bool] | None = None):
        self._it = resp.aiter_lines().__aiter__()
        self.stage, self.url = stage, url
        self._first_s, self._next_s, self._deadline = first_s, next_s, deadline
        self._alive = alive
        self.lines = 0
        self.waited_alive = 0  # silences past next_s that the upstream's liveness carried on

    async def next(self) -> str | None:
        """The next line, or None at the end of the stream."""
        want = self._first_s if self.lines == 0 else self._next_s
        left = self._deadline.left()
        if left <= 0:
            raise UpstreamTimeout(f"{self.stage}: the request deadline ({self._deadline.total_s:g}s) passed",
                                  stage=self.stage, kind="deadline")
        loop = asyncio.get_running_loop()
        stalled = False

        def check() -> None:  # at each window's end: wait on while the upstream is alive, else cut now
            nonlocal watchdog, stalled
            if self.lines > 0 and self._alive is not None and self._alive(want):
                self.waited_alive += 1
                watchdog = loop.call_later(want, check)
            else:
                stalled = True
                cm.reschedule(loop.time())

        try:
            async with asyncio.timeout(left) as cm:  # the deadline; the watchdog expires it early on a stall
                watchdog = loop.call_later(want, check) if want < left else None
                try:
                    line = await self._it.__anext__()
                finally:
                    if watchdog is not None:
                        watchdog.cancel()
        except StopAsyncIteration:
            return None
        except TimeoutError:
            if stalled:
                raise UpstreamTimeout(f"{self.stage}: {self.url} sent nothing for {want:g}s (stalled)",
                                      stage=self.stage, kind="stall") from None
            raise UpstreamTimeout(f"{self.stage}: the request deadline ({self._deadline.total_s:g}s) passed",
                                  stage=self.stage, kind="deadline") from None
        except httpx.HTTPError as e:
            raise map_transport_error(e, stage=self.stage, url=self.url) from None
        self.lines += 1
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
