"""Calling upstreams (vLLM servers, express nodes) with one error mapping.

connect refused / DNS / pool exhausted -> UpstreamUnavailable (503)
read/write/connect timeout             -> UpstreamTimeout (504)
4xx                                    -> UpstreamRejected (relayed unchanged)
503                                    -> UpstreamUnavailable
other non-2xx, non-JSON 2xx, bad shape -> UpstreamError (502)

One-shot calls (the prefill legs, the native lane's non-streaming decode leg, health probes) go through a `OneShotCalls`:
the router's own keep-alive HTTP/1.1 client (`h1_pool.H1Pool`, no httpx objects on that path) or, given another
httpx transport (tests: httpx.MockTransport), `HttpxOneShot` over the router's httpx.AsyncClient. Both raise the
same typed errors: `status_error` and `json_object` below are the one mapping of a reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import httpx

from .errors import UpstreamError, UpstreamRejected, UpstreamTimeout, UpstreamUnavailable
from .resilience import Deadline

__all__ = ["HttpxOneShot", "OneShotCalls", "LineReader", "open_stream", "post_json", "map_transport_error", "check_status",
           "read_json", "status_error", "json_object", "total_timeout_error"]


def map_transport_error(exc: httpx.HTTPError, *, stage: str, url: str) -> UpstreamError:
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.PoolTimeout):
        return UpstreamTimeout(f"{stage}: {url} did not answer in time ({type(exc).__name__})",
                               stage=stage, kind="timeout")
    if isinstance(exc, (httpx.ConnectError, httpx.PoolTimeout)):
        return UpstreamUnavailable(f"{stage}: cannot connect to {url} ({exc or type(exc).__name__})",
                                   stage=stage, kind="connect")
    return UpstreamError(f"{stage}: {url} failed: {type(exc).__name__}: {exc}", stage=stage, kind="transport")


def status_error(status: int, content: bytes, content_type: str | None, *, stage: str) -> UpstreamError | None:
    """The mapped error of a reply's status, None for a 2xx."""
    if 200 <= status < 300:
        return None
    if 400 <= status < 500:
        return UpstreamRejected(status, content, content_type, stage=stage)
    detail = content[:300].decode("utf-8", "replace")
    cls = UpstreamUnavailable if status == 503 else UpstreamError
    return cls(f"{stage}: upstream answered {status}: {detail}", stage=stage, kind=f"http_{status}")


async def check_status(resp: httpx.Response, *, stage: str) -> None:
    """Raise the mapped error for a non-2xx reply (reads the body of a streamed reply first)."""
    if resp.is_success:
        return
    content = await resp.aread()
    err = status_error(resp.status_code, content, resp.headers.get("content-type"), stage=stage)
    if err is not None:
        raise err


def json_object(content: bytes, *, stage: str) -> dict[str, Any]:
    """A reply body that must be one JSON object (UpstreamError otherwise)."""
    try:
        data = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        raise UpstreamError(f"{stage}: upstream reply is not JSON", stage=stage) from None
    if not isinstance(data, dict):
        raise UpstreamError(f"{stage}: upstream reply is not a JSON object", stage=stage)
    return data


def read_json(resp: httpx.Response, *, stage: str) -> dict[str, Any]:
    return json_object(resp.content, stage=stage)


def total_timeout_error(url: str, total: float | None, *, stage: str) -> UpstreamTimeout:
    return UpstreamTimeout(f"{stage}: {url} did not answer within {total:g}s", stage=stage, kind="timeout")


class OneShotCalls(Protocol):
    async def post_json(self, url: str, body: dict, *, stage: str, timeout: httpx.Timeout,
                        headers: dict[str, str] | None = None) -> dict[str, Any]:
        """POST a JSON body, read the whole JSON-object reply, every failure typed (module docstring)."""

    async def get_status(self, url: str, *, timeout: httpx.Timeout, headers: dict[str, str] | None = None) -> int:
        """GET, read and drop the body, the status; failures as httpx's exceptions (health.py maps them)."""


class HttpxOneShot:
    """OneShotCalls over an httpx.AsyncClient (whatever its transport)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def post_json(self, url: str, body: dict, *, stage: str, timeout: httpx.Timeout,
                        headers: dict[str, str] | None = None) -> dict[str, Any]:
        return await post_json(self.client, url, body, stage=stage, timeout=timeout, headers=headers)

    async def get_status(self, url: str, *, timeout: httpx.Timeout, headers: dict[str, str] | None = None) -> int:
        return (await self.client.get(url, headers=headers, timeout=timeout)).status_code


async def post_json(client: httpx.AsyncClient, url: str, body: dict, *, stage: str,
                    timeout: httpx.Timeout, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """POST, read the whole JSON reply. The call as a whole is bounded by timeout.read too (httpx's read
    timeout is per read: a reply that trickles in would otherwise outlive the request's deadline)."""
    total = timeout.read
    try:
        async with asyncio.timeout(total):
            resp = await client.post(url, json=body, timeout=timeout, headers=headers)
            await check_status(resp, stage=stage)
    except httpx.HTTPError as e:
        raise map_transport_error(e, stage=stage, url=url) from None
    except TimeoutError:
        raise total_timeout_error(url, total, stage=stage) from None
    return read_json(resp, stage=stage)


@contextlib.asynccontextmanager
async def open_stream(client: httpx.AsyncClient, url: str, body: dict, *, stage: str,
                      timeout: httpx.Timeout, headers: dict[str, str] | None = None) -> AsyncIterator[httpx.Response]:
    """POST and yield the 2xx streaming reply (headers received, body unread); closes it on exit."""
    try:
        req = client.build_request("POST", url, json=body, timeout=timeout, headers=headers)
        resp = await client.send(req, stream=True)
    except httpx.HTTPError as e:
        raise map_transport_error(e, stage=stage, url=url) from None
    try:
        await check_status(resp, stage=stage)
        yield resp
    finally:
        await resp.aclose()


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
