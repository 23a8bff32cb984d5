"""What both lanes share: the per-app context, shielded cleanup, and a stream that always cleans up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..config import RouterConfig
from ..errors import RouterError, UpstreamError
from ..metrics import RequestRecord, RouterMetrics
from ..fleet.pools import PrefillPool, member_serving
from ..resilience import Deadline
from ..upstream.calls import HttpxOneShot, OneShotCalls

if TYPE_CHECKING:
    from ..fleet.discovery import Membership
    from ..fleet.health import HealthMonitor

__all__ = ["LaneContext", "ManagedStream", "count_upstream_error", "shielded"]

log = logging.getLogger("expresslane.router")
_new_timeout = httpx.Timeout.__new__


@dataclass
class LaneContext:
    config: RouterConfig
    client: httpx.AsyncClient
    metrics: RouterMetrics
    clock: Callable[[], float]
    health: "HealthMonitor | None" = None
    headers: Callable[[str], dict[str, str]] = lambda kind: {}  # secrets.upstream_headers
    calls: OneShotCalls | None = None  # one-shot calls (the hot path); None = through `client` (HttpxOneShot)
    # Pools (pools.py, discovery.py): None = the config's static members.
    prefills: PrefillPool | None = None
    membership: "Membership | None" = None
    _background: set[asyncio.Task] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.calls is None:
            self.calls = HttpxOneShot(self.client)
        if self.prefills is None:
            static = self.config.prefill.static_nodes
            self.prefills = PrefillPool(self.config.prefill.affinity, lambda: static,
                                        lambda url: member_serving(self.health, url), self.metrics,
                                        retry_after_s=self.config.resilience.unavailable_retry_after_s)

    def native_nodes(self, pool: str) -> list[str]:
        """The native pool's current members (static and DNS)."""
        if self.membership is not None:
            return self.membership.urls(pool)
        return self.config.pools[pool].nodes  # type: ignore[union-attr]

    def timeout(self, read_s: float) -> httpx.Timeout:
        """httpx.Timeout(read_s, connect=timeouts.connect_s), set directly: its constructor's argument checks cost
        more than the rest of a leg's bookkeeping, twice a request (test_router_prefill_and_lanes.py checks that
        both are equal)."""
        t = _new_timeout(httpx.Timeout)
        t.connect = self.config.timeouts.connect_s
        t.read = t.write = t.pool = read_s
        return t

    def deadline(self, record: RequestRecord) -> Deadline:
        return Deadline(self.clock, record.started, self.config.resilience.request_deadline_s)

    def healthy(self, url: str) -> bool:
        return self.health is None or self.health.healthy(url)

    def alive_within(self, url: str, window_s: float) -> bool:
        """`url` showed a sign of life within the last window_s seconds: a passing probe, a completed leg, a stream
        line (False without a health monitor)."""
        return self.health is not None and self.health.alive_within(url, window_s)

    def alive(self, url: str) -> Callable[[float], bool]:
        """`alive_within` for one node, as a LineReader's liveness signal."""
        return lambda window_s: self.alive_within(url, window_s)

    def on_line(self, url: str) -> Callable[[], None] | None:
        """A callback for each line a stream from `url` gets: a sign of life (None without a health monitor)."""
        health = self.health
        if health is None:
            return None
        return lambda: health.report_alive(url)

    def available(self, pool: str, url: str) -> bool:
        """`url` takes traffic of `pool`: probes and outlier detection (pools.member_serving)."""
        return member_serving(self.health, url, pool)

    def report_failure(self, url: str, kind: str, cause: str = "") -> None:
        """A leg to `url` failed; outlier detection decides whether `kind` is the node's (fleet/outlier.classify)."""
        if self.health is not None:
            self.health.report_failure(url, kind, cause)

    def report_error(self, url: str, err: RouterError) -> None:
        """report_failure for a typed error (only UpstreamErrors can be the node's)."""
        if self.health is not None and isinstance(err, UpstreamError):
            self.health.report_failure(url, err.kind, err.message)

    def report_success(self, url: str) -> None:
        if self.health is not None:
            self.health.report_success(url)

    def background(self, aw: Awaitable[Any]) -> None:
        """Run cleanup (a cancel, a release) without making the client wait for it; shutdown awaits it."""
        task = asyncio.ensure_future(shielded(aw))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self, timeout_s: float) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout_s)




def count_upstream_error(ctx: LaneContext, lane: str, err: RouterError) -> None:
    if isinstance(err, UpstreamError):
        ctx.metrics.upstream_errors.labels(lane, err.stage, err.kind).inc()


async def shielded(aw: Awaitable[Any]) -> None:
    """Await cleanup even inside a cancelled task or scope; never raises."""
    with anyio.CancelScope(shield=True):
        try:
            await aw
        except Exception:  # cleanup must not mask the original outcome
            log.exception("cleanup failed")


class ManagedStream(StreamingResponse):
    """A StreamingResponse whose `on_close` runs on EVERY exit: normal end, client disconnect,
    cancellation, or an exception before the first byte. `record` gets status 499 if the body did
    not run to its end."""

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], Awaitable[Any]],
                 record: RequestRecord, headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close
        self._record = record

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await shielded(aclose())
            await shielded(self._on_close())
            self._record.finish(499)


@contextlib.asynccontextmanager
async def closing_on_error(stack: contextlib.AsyncExitStack) -> AsyncIterator[None]:
    """Close `stack` (shielded) if the body raises or is cancelled; leave it open on success."""
    try:
        yield
    except BaseException:
        await shielded(stack.aclose())
        raise
