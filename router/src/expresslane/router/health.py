"""Upstream health: one circuit breaker per upstream, fed by active probes and by the request path.

    CLOSED --(unhealthy_threshold probe failures | passive_threshold request failures)--> OPEN
    OPEN --(open_s passed)--> HALF_OPEN
    HALF_OPEN --(healthy_threshold successes)--> CLOSED
    HALF_OPEN --(one failure)--> OPEN (open_s starts again)

Only CLOSED upstreams get traffic while probes run (in HALF_OPEN the probe is the trial). With probes off
(`health.enabled: false`) a HALF_OPEN upstream takes traffic again and the first request's outcome decides.

Probes: `GET <url>/health` every `interval_s` with `timeout_s` on the prefill, every native node and every
express node (an express node answers 503 naming the failing check when its engine, control plane or NIXL
agent is not healthy). Passive reports come from the lanes: connect errors, timeouts, stalls, 503 not_ready.

Metrics: `expresslane_router_upstream_healthy{lane,pool,node}` (1 serving, 0 ejected) and
`expresslane_router_upstream_ejections_total{lane,pool,node,reason}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from .config import ExpressPool, RouterConfig
from .metrics import RouterMetrics, node_label
from .resilience import HealthConfig
from .upstream import OneShotCalls

__all__ = ["BreakerState", "CircuitBreaker", "HealthMonitor", "Upstream"]

log = logging.getLogger("expresslane.router.health")


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """The state machine of one upstream. Pure logic on an injected clock (unit-testable)."""

    def __init__(self, cfg: HealthConfig, clock: Callable[[], float] = time.monotonic, *, trial_traffic: bool = False):
        self.cfg = cfg
        self._clock = clock
        self.trial_traffic = trial_traffic  # HALF_OPEN takes requests (no probes to decide)
        self._state = BreakerState.CLOSED
        self.failures = 0
        self.successes = 0
        self.opened_at = 0.0
        self.reason: str | None = None

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() - self.opened_at >= self.cfg.open_s:
            self._state = BreakerState.HALF_OPEN
            self.successes = 0
        return self._state

    def allows_traffic(self) -> bool:
        s = self.state
        return s is BreakerState.CLOSED or (s is BreakerState.HALF_OPEN and self.trial_traffic)

    def success(self) -> bool:
        """Record a success; True when this re-admits the upstream (HALF_OPEN -> CLOSED)."""
        s = self.state
        self.failures = 0
        if s is BreakerState.HALF_OPEN:
            self.successes += 1
            if self.successes >= self.cfg.healthy_threshold:
                self._state, self.reason = BreakerState.CLOSED, None
                return True
        return False

    def failure(self, reason: str, *, passive: bool) -> bool:
        """Record a failure; True when this ejects the upstream (-> OPEN from CLOSED or HALF_OPEN)."""
        s = self.state
        if s is BreakerState.OPEN:
            return False
        self.failures += 1
        threshold = self.cfg.passive_threshold if passive else self.cfg.unhealthy_threshold
        if s is BreakerState.HALF_OPEN or self.failures >= threshold:
            self._state, self.opened_at, self.reason = BreakerState.OPEN, self._clock(), reason
            self.failures = self.successes = 0
            return True
        return False


@dataclass
class Upstream:
    lane: str  # prefill | native | express
    url: str
    auth: str  # "vllm" | "express": which upstream header set its calls carry
    pools: list[str] = field(default_factory=list)
    breaker: CircuitBreaker | None = None

    @property
    def node(self) -> str:
        return node_label(self.url)


class HealthMonitor:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics, *, headers: Callable[[str], dict[str, str]],
                 clock: Callable[[], float] = time.monotonic):
        self.cfg: HealthConfig = config.health
        self._metrics = metrics
        self._headers = headers
        self._listeners: list[Callable[[], None]] = []
        self.upstreams: dict[str, Upstream] = {}
        self._clock = clock
        for url in config.prefill.static_nodes:  # members from DNS come and go through track / forget
            self._add("prefill", url, "vllm", "prefill", clock)
        for name, pool in config.pools.items():
            lane, auth = ("express", "express") if isinstance(pool, ExpressPool) else ("native", "vllm")
            for n in pool.nodes:
                self._add(lane, n if isinstance(n, str) else n.url, auth, name, clock)
        for u in self.upstreams.values():
            self._set_gauge(u)
            for reason in ("connect", "timeout"):
                for pool in u.pools:
                    metrics.ejections.labels(u.lane, pool, u.node, reason)

    def _add(self, lane: str, url: str, auth: str, pool: str, clock: Callable[[], float]) -> None:
        u = self.upstreams.get(url)
        if u is None:
            u = self.upstreams[url] = Upstream(lane, url, auth, breaker=CircuitBreaker(
                self.cfg, clock, trial_traffic=not self.cfg.enabled))
        if pool not in u.pools:
            u.pools.append(pool)

    # ---- pool membership (discovery.py) ---------------------------------------------------------
    def track(self, lane: str, url: str, auth: str, pool: str) -> None:
        """Start probing a pool member that appeared (it serves until a probe or a request says otherwise)."""
        self._add(lane, url, auth, pool, self._clock)
        self._set_gauge(self.upstreams[url])

    def forget(self, url: str, pool: str) -> None:
        """Stop probing a member that left `pool` (and drop its gauge)."""
        u = self.upstreams.get(url)
        if u is None or pool not in u.pools:
            return
        u.pools.remove(pool)
        with contextlib.suppress(KeyError):
            self._metrics.upstream_healthy.remove(u.lane, pool, u.node)
        if not u.pools:
            del self.upstreams[url]

    # ---- queries -------------------------------------------------------------------------------
    def healthy(self, url: str) -> bool:
        u = self.upstreams.get(url)
        return u is None or u.breaker.allows_traffic()

    def on_change(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def readiness(self) -> tuple[bool, dict]:
        """(ready, body): ready when a prefill member and at least one decode node take traffic."""
        ups = {u.url: {"lane": u.lane, "pools": u.pools, "state": u.breaker.state.value,
                       "healthy": u.breaker.allows_traffic(), **({"reason": u.breaker.reason}
                                                                 if u.breaker.reason else {})}
               for u in self.upstreams.values()}
        prefill_up = any(v["healthy"] for v in ups.values() if v["lane"] == "prefill")  # a pool: one member will do
        decode_up = any(v["healthy"] for v in ups.values() if v["lane"] != "prefill")
        ready = prefill_up and decode_up
        return ready, {"status": "ready" if ready else "not_ready", "upstreams": ups}

    # ---- reports -----------------------------------------------------------------------------------
    def report_success(self, url: str) -> None:
        u = self.upstreams.get(url)
        if u is not None and u.breaker.success():
            log.warning("upstream %s (%s) re-admitted", u.url, u.lane)
            self._changed(u)

    def report_failure(self, url: str, reason: str, *, passive: bool = True) -> None:
        u = self.upstreams.get(url)
        if u is None:
            return
        was_serving = u.breaker.allows_traffic()
        if u.breaker.failure(reason, passive=passive):
            for pool in u.pools:
                self._metrics.ejections.labels(u.lane, pool, u.node, reason).inc()
            log.warning("upstream %s (%s) ejected: %s", u.url, u.lane, reason)
            self._changed(u)
        elif was_serving != u.breaker.allows_traffic():
            self._changed(u)

    def _set_gauge(self, u: Upstream) -> None:
        for pool in u.pools:
            self._metrics.upstream_healthy.labels(u.lane, pool, u.node).set(1 if u.breaker.allows_traffic() else 0)

    def _changed(self, u: Upstream) -> None:
        self._set_gauge(u)
        for cb in self._listeners:
            cb()

    # ---- active probes ---------------------------------------------------------------------------
    async def probe(self, calls: OneShotCalls, u: Upstream) -> None:
        before = u.breaker.allows_traffic()
        t = self.cfg.timeout_s
        try:
            status = await calls.get_status(u.url + "/health", headers=self._headers(u.auth),
                                            timeout=httpx.Timeout(t, connect=t))
        except httpx.TimeoutException:
            self.report_failure(u.url, "probe_timeout", passive=False)
        except httpx.HTTPError:
            self.report_failure(u.url, "probe_connect", passive=False)
        else:
            if status == 200:
                self.report_success(u.url)
            else:
                self.report_failure(u.url, f"probe_http_{status}", passive=False)
        if before != u.breaker.allows_traffic():
            self._set_gauge(u)  # an OPEN -> HALF_OPEN move seen by the probe also updates the gauge

    async def probe_all(self, calls: OneShotCalls) -> None:
        await asyncio.gather(*(self.probe(calls, u) for u in self.upstreams.values()))

    async def run(self, calls: OneShotCalls) -> None:
        """Probe forever (the lifespan cancels it): a round starts every interval_s, however long the last
        one took (a hung node's probe costs timeout_s, and must not slow the detection of the next failure)."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.probe_all(calls)
            except Exception:  # a bug in a probe must not stop the monitor
                log.exception("health probe round failed")
            await asyncio.sleep(max(0.0, self.cfg.interval_s - (loop.time() - started)))

    @contextlib.asynccontextmanager
    async def running(self, calls: OneShotCalls):
        """Probe in the background while the body runs (`calls`: the lanes' one-shot calls, LaneContext.calls)."""
        task = asyncio.create_task(self.run(calls)) if self.cfg.enabled else None
        try:
            yield self
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
