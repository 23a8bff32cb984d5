"""Upstream health: active probes decide whether a node is DOWN (a circuit breaker per upstream); the request
path's failures feed outlier detection per pool (outlier.py), which may take a node out of one pool's traffic for
a while but never makes a pool's last serving node unavailable.

Breaker (probes only):
    CLOSED --(unhealthy_threshold probe failures)--> OPEN
    OPEN --(open_s passed)--> HALF_OPEN
    HALF_OPEN --(healthy_threshold successes)--> CLOSED
    HALF_OPEN --(one failure)--> OPEN (open_s starts again)

Only CLOSED upstreams get traffic while probes run (in HALF_OPEN the probe is the trial). With probes off
(`health.enabled: false`) the breaker never opens; outlier detection alone takes nodes out of traffic.

Probes: `GET <url>/health` every `interval_s` with `timeout_s` on the prefill, every native node and every
express node (an express node answers 503 naming the failing check when its engine, control plane or NIXL
agent is not healthy). A request that cannot connect to a node starts a probe round at once (a dead node is
found by the probes within one round, not only by outlier detection's count).

Passive reports come from the lanes (connect errors, timeouts, stalls, transport errors, 503 not_ready), with the
error's message as their cause; every outlier decision is one log line naming the rule, the failure and its cause.

Metrics: `expresslane_router_upstream_healthy{lane,pool,node}` (1 takes traffic, 0 not),
`expresslane_router_upstream_ejections_total{lane,pool,node,reason}` and
`expresslane_router_outlier_decisions_total{pool,node,decision,reason}`.
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

from ..config import ExpressPool, RouterConfig
from ..metrics import RouterMetrics, node_label
from .outlier import Decision, OutlierConfig, OutlierDetector
from ..resilience import HealthConfig
from ..upstream.calls import OneShotCalls

__all__ = ["BreakerState", "CircuitBreaker", "HealthMonitor", "Upstream"]

log = logging.getLogger("expresslane.router.fleet.health")


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

    def unproven(self) -> None:
        """A member that just appeared and has not answered a probe yet: HALF_OPEN, so it takes traffic after
        healthy_threshold probe successes (with probes off: at once, as trial traffic)."""
        self._state, self.successes, self.failures, self.reason = BreakerState.HALF_OPEN, 0, 0, "not_probed_yet"

    def failure(self, reason: str) -> bool:
        """Record a failed probe; True when this ejects the upstream (-> OPEN from CLOSED or HALF_OPEN)."""
        s = self.state
        if s is BreakerState.OPEN:
            return False
        self.failures += 1
        if s is BreakerState.HALF_OPEN or self.failures >= self.cfg.unhealthy_threshold:
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
    answered_at: float | None = None  # the clock's time of the last probe that got 200

    @property
    def node(self) -> str:
        return node_label(self.url)


class HealthMonitor:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics, *, headers: Callable[[str], dict[str, str]],
                 clock: Callable[[], float] = time.monotonic):
        self.cfg: HealthConfig = config.health
        self.outlier_cfg: OutlierConfig = config.outlier
        self._metrics = metrics
        self._headers = headers
        self._clock = clock
        self._listeners: list[Callable[[], None]] = []
        self._wake: asyncio.Event | None = None
        self.upstreams: dict[str, Upstream] = {}
        self.outliers: dict[str, OutlierDetector] = {}  # pool -> its detector ("prefill": the prefill pool)
        for url in config.prefill.static_nodes:  # members from DNS come and go through track / forget
            self._add("prefill", url, "vllm", "prefill")
        for name, pool in config.pools.items():
            lane, auth = ("express", "express") if isinstance(pool, ExpressPool) else ("native", "vllm")
            for n in pool.nodes:
                self._add(lane, n if isinstance(n, str) else n.url, auth, name)
        for u in self.upstreams.values():
            self._set_gauge(u)
            for reason in ("probe_connect", "probe_timeout", "consecutive_failures"):
                for pool in u.pools:
                    metrics.ejections.labels(u.lane, pool, u.node, reason)

    def _add(self, lane: str, url: str, auth: str, pool: str) -> None:
        u = self.upstreams.get(url)
        if u is None:
            u = self.upstreams[url] = Upstream(lane, url, auth, breaker=CircuitBreaker(
                self.cfg, self._clock, trial_traffic=not self.cfg.enabled))
        if pool not in u.pools:
            u.pools.append(pool)
        self.add_pool(pool, [*self.outliers[pool].nodes, url] if pool in self.outliers else [url])

    def add_pool(self, pool: str, urls: list[str]) -> OutlierDetector:
        """The outlier detector of `pool` (made on first use; its membership set to `urls`)."""
        d = self.outliers.get(pool)
        if d is None:
            d = self.outliers[pool] = OutlierDetector(pool, urls, self.outlier_cfg, self._clock)
        else:
            d.set_nodes(urls)
        return d

    # ---- pool membership (discovery.py) ---------------------------------------------------------
    def track(self, lane: str, url: str, auth: str, pool: str, *, proven: bool = True) -> None:
        """Start probing a pool member that appeared. `proven`: it serves until a probe or a request says
        otherwise; else it serves once a probe found it healthy (CircuitBreaker.unproven), and a probe round
        starts at once."""
        new = url not in self.upstreams
        self._add(lane, url, auth, pool)
        u = self.upstreams[url]
        if new and not proven:
            u.breaker.unproven()
            if self._wake is not None:
                self._wake.set()
        self._set_gauge(u)

    def forget(self, url: str, pool: str) -> None:
        """Stop probing a member that left `pool` (and drop its gauge and its outlier state in that pool)."""
        u = self.upstreams.get(url)
        if u is None or pool not in u.pools:
            return
        u.pools.remove(pool)
        if pool in self.outliers:
            self.outliers[pool].set_nodes([n for n in self.outliers[pool].nodes if n != url])
        with contextlib.suppress(KeyError):
            self._metrics.upstream_healthy.remove(u.lane, pool, u.node)
        if not u.pools:
            del self.upstreams[url]

    # ---- queries -------------------------------------------------------------------------------
    def healthy(self, url: str) -> bool:
        """Whether the probes let `url` take traffic (outlier detection aside)."""
        u = self.upstreams.get(url)
        return u is None or u.breaker.allows_traffic()

    def answered_within(self, url: str, window_s: float) -> bool:
        """Whether a probe of `url` got 200 within the last window_s seconds and the probes let it take traffic:
        the process answers (a silent stream from it is slow, not dead: upstream.LineReader)."""
        u = self.upstreams.get(url)
        return (u is not None and u.answered_at is not None and self._clock() - u.answered_at <= window_s
                and u.breaker.allows_traffic())

    def available(self, pool: str, url: str) -> bool:
        """Whether `url` takes traffic of `pool`: the probes let it, and outlier detection does (or panics)."""
        if not self.healthy(url):
            return False
        d = self.outliers.get(pool)
        return d is None or d.admits(url, self.healthy)

    def on_change(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def readiness(self) -> tuple[bool, dict]:
        """(ready, body): ready when a prefill member and at least one decode node take traffic."""
        ups = {u.url: {"lane": u.lane, "pools": u.pools, "state": u.breaker.state.value,
                       "healthy": u.breaker.allows_traffic(), **({"reason": u.breaker.reason}
                                                                 if u.breaker.reason else {}),
                       **({"ejected_from": ej} if (ej := [p for p in u.pools if p in self.outliers
                                                          and not self.outliers[p].admits(u.url, self.healthy)])
                          else {})}
               for u in self.upstreams.values()}
        prefill_up = any(v["healthy"] for v in ups.values() if v["lane"] == "prefill")  # a pool: one member will do
        decode_up = any(v["healthy"] for v in ups.values() if v["lane"] != "prefill")
        ready = prefill_up and decode_up
        return ready, {"status": "ready" if ready else "not_ready", "upstreams": ups}

    # ---- reports -----------------------------------------------------------------------------------
    def report_success(self, url: str) -> None:
        u = self.upstreams.get(url)
        if u is None:
            return
        for pool in u.pools:
            self.outliers[pool].success(url)
        if u.breaker.success():  # (HALF_OPEN takes requests only with probes off)
            log.warning("upstream %s (%s) re-admitted", u.url, u.lane)
            self._changed(u)

    def report_failure(self, url: str, kind: str, cause: str = "") -> None:
        """A request to `url` failed (`kind`: the UpstreamError kind; `cause`: its message). Outlier detection of
        each of its pools decides; a connect failure also starts a probe round at once."""
        u = self.upstreams.get(url)
        if u is None:
            return
        if kind == "connect" and self._wake is not None:
            self._wake.set()
        for pool in u.pools:
            before = self.available(pool, url)
            decision = self.outliers[pool].failure(url, kind, cause, self.healthy)
            if decision is not None:
                self._decided(u, decision)
            if before != self.available(pool, url):
                self._changed(u)

    def _decided(self, u: Upstream, d: Decision) -> None:
        self._metrics.outlier_decisions.labels(d.pool, u.node, d.action, d.reason).inc()
        if d.action == "eject":
            self._metrics.ejections.labels(u.lane, d.pool, u.node, d.reason).inc()
        log.warning("upstream %s (%s): %s", u.url, u.lane, d.describe())

    def _readmissions(self) -> None:
        for pool, d in self.outliers.items():
            for decision in d.readmissions():
                u = self.upstreams.get(decision.node)
                if u is not None:
                    self._decided(u, decision)
                    self._changed(u)

    def _set_gauge(self, u: Upstream) -> None:
        for pool in u.pools:
            self._metrics.upstream_healthy.labels(u.lane, pool, u.node).set(1 if self.available(pool, u.url) else 0)

    def _changed(self, u: Upstream) -> None:
        self._set_gauge(u)
        for cb in self._listeners:
            cb()

    # ---- active probes ---------------------------------------------------------------------------
    def _probe_failed(self, u: Upstream, reason: str) -> None:
        was_serving = u.breaker.allows_traffic()
        if u.breaker.failure(reason):
            for pool in u.pools:
                self._metrics.ejections.labels(u.lane, pool, u.node, reason).inc()
            log.warning("upstream %s (%s) ejected: %s", u.url, u.lane, reason)
            self._changed(u)
        elif was_serving != u.breaker.allows_traffic():
            self._changed(u)

    async def probe(self, calls: OneShotCalls, u: Upstream) -> None:
        before = u.breaker.allows_traffic()
        t = self.cfg.timeout_s
        try:
            status = await calls.get_status(u.url + "/health", headers=self._headers(u.auth),
                                            timeout=httpx.Timeout(t, connect=t))
        except httpx.TimeoutException:
            self._probe_failed(u, "probe_timeout")
        except httpx.HTTPError:
            self._probe_failed(u, "probe_connect")
        else:
            if status == 200:
                u.answered_at = self._clock()
                if u.breaker.success():
                    log.warning("upstream %s (%s) re-admitted", u.url, u.lane)
                    self._changed(u)
            else:
                self._probe_failed(u, f"probe_http_{status}")
        if before != u.breaker.allows_traffic():
            self._set_gauge(u)  # an OPEN -> HALF_OPEN move seen by the probe also updates the gauge

    async def probe_all(self, calls: OneShotCalls) -> None:
        await asyncio.gather(*(self.probe(calls, u) for u in self.upstreams.values()))
        self._readmissions()

    async def run(self, calls: OneShotCalls) -> None:
        """Probe forever (the lifespan cancels it): a round starts every interval_s, however long the last
        one took (a hung node's probe costs timeout_s, and must not slow the detection of the next failure)."""
        loop = asyncio.get_running_loop()
        self._wake = wake = asyncio.Event()
        while True:
            started = loop.time()
            wake.clear()
            try:
                await self.probe_all(calls)
            except Exception:  # a bug in a probe must not stop the monitor
                log.exception("health probe round failed")
            with contextlib.suppress(TimeoutError):  # the next round: at interval_s, or soon after a connect failure
                await asyncio.wait_for(wake.wait(), max(0.0, self.cfg.interval_s - (loop.time() - started)))
                await asyncio.sleep(min(0.2, self.cfg.interval_s))  # (a burst of connect failures: one round)

    @contextlib.asynccontextmanager
    async def running(self, calls: OneShotCalls):
        """Probe in the background while the body runs (`calls`: the lanes' one-shot calls, LaneContext.calls)."""
        task = asyncio.create_task(self.run(calls) if self.cfg.enabled else self.run_readmissions())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def run_readmissions(self) -> None:
        """Without probes: report the nodes whose ejection ran out, once a second."""
        while True:
            await asyncio.sleep(1.0)
            self._readmissions()
