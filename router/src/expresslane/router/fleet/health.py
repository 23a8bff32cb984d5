"""Upstream health as Envoy models it: active health checking per upstream, outlier detection per pool (outlier.py),
and panic routing per pool.

Active health checking: one `ActiveHealth` state machine per upstream, moved by probes only.

    HEALTHY   --(unhealthy_threshold failing probes in a row)-->  UNHEALTHY
    UNHEALTHY --(healthy_threshold passing probes in a row)-->    HEALTHY

A probe is `GET <url>/health` every `interval_s`, within `timeout_s`, on the probes' own connection pool (traffic
cannot starve it). Its outcome (`ProbeResult`):
  PASSED  200: the node's process answers (also a sign of life, below);
  FAILED  connect refused / unreachable / a connect that took longer than timeout_s (probe_connect), another status
          (probe_http_<status>: an express node answers 503 naming the check that fails), or no answer in time from
          a node that showed no other sign of life in the window (probe_timeout);
  SLOW    no answer in time from a node that did show life within interval_s + timeout_s (a leg to it completed, a
          stream line came from it): neither passing nor failing. A busy server with a slow /health is not a dead
          one; a paused or hung one completes nothing and fails its probes.
A member that appears (DNS) and must be proven first (an express node) starts UNHEALTHY ("not_probed_yet"). With
probes off (`health.enabled: false`) every upstream is healthy and outlier detection alone takes nodes out.

Outlier detection (outlier.py): the lanes report every leg's outcome here (`report_success`, `report_failure`, with
the error's message as its cause; `report_alive` for each line a stream gets). A passing probe ends an ejection
(outlier `successful_active_health_check_uneject_host`). Every decision is one log line naming the rule, the failure
and its cause; a refused ejection at most once per node per interval.

Routing: a member takes its pool's traffic (`available`) when it is healthy and not ejected; when fewer than
`healthy_panic_threshold` % of the pool's members are, the pool panics and every member takes traffic (Envoy's panic
routing: probes and errors can make a pool slower, never empty it; a one-member pool always keeps its member).

A request that cannot connect to a node starts a probe round at once.

Metrics: `expresslane_router_upstream_healthy{lane,pool,node}` (1: healthy and not ejected; panic aside),
`expresslane_router_pool_panic{pool}` (1 while the pool routes to every member), `..._upstream_ejections_total{lane,
pool,node,reason}` (probe_* when probes mark it unhealthy, an outlier rule otherwise),
`..._outlier_decisions_total{pool,node,decision,reason}`, `..._health_probes_total{lane,node,result}`.
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
from ..resilience import HealthConfig
from ..upstream.calls import OneShotCalls
from .outlier import Decision, OutlierConfig, OutlierDetector

__all__ = ["ActiveHealth", "HealthMonitor", "HealthState", "ProbeResult", "Upstream"]

log = logging.getLogger("expresslane.router.fleet.health")


class HealthState(enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


class ProbeResult(enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    SLOW = "slow"


class ActiveHealth:
    """One upstream's active health checking (module docstring). Pure logic: the probes' outcomes in, the state out."""

    __slots__ = ("cfg", "state", "failures", "successes", "reason")

    def __init__(self, cfg: HealthConfig, *, proven: bool = True) -> None:
        self.cfg = cfg
        self.state = HealthState.HEALTHY if proven or not cfg.enabled else HealthState.UNHEALTHY
        self.failures = 0  # failing probes in a row
        self.successes = 0  # passing probes in a row
        self.reason: str | None = None if self.state is HealthState.HEALTHY else "not_probed_yet"

    @property
    def healthy(self) -> bool:
        return self.state is HealthState.HEALTHY or not self.cfg.enabled

    def passed(self) -> bool:
        """A passing probe; True when it makes the upstream healthy."""
        self.failures = 0
        self.successes += 1
        if self.state is HealthState.UNHEALTHY and self.successes >= self.cfg.healthy_threshold:
            self.state, self.reason = HealthState.HEALTHY, None
            return True
        return False

    def failed(self, reason: str) -> bool:
        """A failing probe; True when it makes the upstream unhealthy."""
        self.successes = 0
        self.failures += 1
        if self.state is HealthState.HEALTHY and self.failures >= self.cfg.unhealthy_threshold:
            self.state, self.reason = HealthState.UNHEALTHY, reason
            return True
        if self.state is HealthState.UNHEALTHY:
            self.reason = reason
        return False

    def unproven(self) -> None:
        """A member that just appeared and must pass a probe before it takes traffic."""
        self.state, self.failures, self.successes, self.reason = HealthState.UNHEALTHY, 0, 0, "not_probed_yet"


@dataclass
class Upstream:
    lane: str  # prefill | native | express
    url: str
    auth: str  # "vllm" | "express": which upstream header set its calls carry
    health: ActiveHealth
    pools: list[str] = field(default_factory=list)
    probed_at: float | None = None  # the clock's time of the last passing probe
    leg_at: float | None = None  # ... of the last sign of life on the request path: a completed leg, a stream line

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
        self._panic: dict[str, bool] = {}
        self.upstreams: dict[str, Upstream] = {}
        self.outliers: dict[str, OutlierDetector] = {}  # pool -> its detector ("prefill": the prefill pool)
        for url in config.prefill.static_nodes:  # members from DNS come and go through track / forget
            self._add("prefill", url, "vllm", "prefill")
        for name, pool in config.pools.items():
            lane, auth = ("express", "express") if isinstance(pool, ExpressPool) else ("native", "vllm")
            for n in pool.nodes:
                self._add(lane, n if isinstance(n, str) else n.url, auth, name)
        for u in self.upstreams.values():
            self._set_gauges(u)
            for pool in u.pools:
                for reason in ("probe_connect", "probe_timeout", "consecutive_gateway_failure", "consecutive_5xx"):
                    metrics.ejections.labels(u.lane, pool, u.node, reason)

    def _add(self, lane: str, url: str, auth: str, pool: str) -> None:
        u = self.upstreams.get(url)
        if u is None:
            u = self.upstreams[url] = Upstream(lane, url, auth, ActiveHealth(self.cfg))
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
        otherwise; else it serves once a probe passed (ActiveHealth.unproven), and a probe round starts at once."""
        new = url not in self.upstreams
        self._add(lane, url, auth, pool)
        u = self.upstreams[url]
        if new and not proven and self.cfg.enabled:
            u.health.unproven()
            if self._wake is not None:
                self._wake.set()
        self._changed(u)

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
        self._update_panic(pool)

    # ---- queries -------------------------------------------------------------------------------
    def healthy(self, url: str) -> bool:
        """Whether the active health checks call `url` healthy (outlier detection aside)."""
        u = self.upstreams.get(url)
        return u is None or u.health.healthy

    def alive_within(self, url: str, window_s: float) -> bool:
        """Whether `url` showed a sign of life within the last window_s seconds: a passing probe, a completed leg,
        a line of a stream (a silent stream from it is slow, not dead: upstream/lines.LineReader)."""
        u = self.upstreams.get(url)
        if u is None:
            return False
        at = max(u.probed_at or -1e18, u.leg_at or -1e18)
        return self._clock() - at < window_s

    def legs_alive_within(self, url: str, window_s: float) -> bool:
        """Whether the request path saw `url` alive within window_s (probes aside: the second signal a slow probe
        is judged by)."""
        u = self.upstreams.get(url)
        return u is not None and u.leg_at is not None and self._clock() - u.leg_at < window_s

    def routable(self, pool: str, url: str) -> bool:
        """Healthy (probes) and not ejected from `pool` (outlier detection): takes traffic outside panic."""
        if not self.healthy(url):
            return False
        d = self.outliers.get(pool)
        return d is None or d.admits(url)

    def panicking(self, pool: str) -> bool:
        """Fewer than healthy_panic_threshold % of the pool's members are routable: route to all of them."""
        d = self.outliers.get(pool)
        threshold = self.cfg.healthy_panic_threshold
        if d is None or not threshold:
            return False
        members = d.nodes
        if not members:
            return False
        good = sum(1 for m in members if self.routable(pool, m))
        return good * 100 < threshold * len(members)

    def available(self, pool: str, url: str) -> bool:
        """Whether `url` takes traffic of `pool`: routable, or the pool panics (and `url` is one of its members)."""
        if self.routable(pool, url):
            return True
        d = self.outliers.get(pool)
        return d is not None and url in d.nodes and self.panicking(pool)

    def on_change(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def readiness(self) -> tuple[bool, dict]:
        """(ready, details): ready when a prefill member and at least one decode node are healthy. The details name
        every upstream, its state and the pools it is ejected from (the app shows them to an authenticated caller)."""
        ups = {}
        for u in self.upstreams.values():
            ejected = [p for p in u.pools if p in self.outliers and not self.outliers[p].admits(u.url)]
            ups[u.url] = {"lane": u.lane, "pools": u.pools, "state": u.health.state.value, "healthy": u.health.healthy,
                          **({"reason": u.health.reason} if u.health.reason else {}),
                          **({"ejected_from": ejected} if ejected else {})}
        prefill_up = any(v["healthy"] for v in ups.values() if v["lane"] == "prefill")  # a pool: one member will do
        decode_up = any(v["healthy"] for v in ups.values() if v["lane"] != "prefill")
        ready = prefill_up and decode_up
        panic = sorted(p for p in self.outliers if self.panicking(p))
        return ready, {"status": "ready" if ready else "not_ready", "upstreams": ups, "panic": panic}

    # ---- the request path's reports ---------------------------------------------------------------
    def report_alive(self, url: str) -> None:
        """A sign of life from `url` (a stream line): no outcome yet."""
        u = self.upstreams.get(url)
        if u is not None:
            u.leg_at = self._clock()

    def report_success(self, url: str) -> None:
        """A leg to `url` completed (its reply, or a stream's first line)."""
        u = self.upstreams.get(url)
        if u is None:
            return
        u.leg_at = self._clock()
        for pool in u.pools:
            self.outliers[pool].success(url)

    def report_failure(self, url: str, kind: str, cause: str = "") -> None:
        """A leg to `url` failed (`kind`: the UpstreamError kind; `cause`: its message). Outlier detection of each of
        its pools decides (a kind that is not the node's is ignored: outlier.classify); a connect failure also
        starts a probe round at once."""
        u = self.upstreams.get(url)
        if u is None:
            return
        if kind == "connect" and self._wake is not None:
            self._wake.set()
        for pool in u.pools:
            before = self.routable(pool, url)
            decision = self.outliers[pool].failure(url, kind, cause, self.healthy)
            if decision is not None:
                self._decided(u, decision)
            if before != self.routable(pool, url):
                self._changed(u)

    def _decided(self, u: Upstream, d: Decision) -> None:
        self._metrics.outlier_decisions.labels(d.pool, u.node, d.action, d.reason).inc()
        if d.action == "eject":
            self._metrics.ejections.labels(u.lane, d.pool, u.node, d.reason).inc()
        log.warning("upstream %s (%s): %s", u.url, u.lane, d.describe())

    def _readmissions(self) -> None:
        for d in self.outliers.values():
            for decision in d.readmissions():
                u = self.upstreams.get(decision.node)
                if u is not None:
                    self._decided(u, decision)
                    self._changed(u)

    def _set_gauges(self, u: Upstream) -> None:
        for pool in u.pools:
            self._metrics.upstream_healthy.labels(u.lane, pool, u.node).set(1 if self.routable(pool, u.url) else 0)

    def _update_panic(self, pool: str) -> None:
        panic = self.panicking(pool)
        if panic != self._panic.get(pool, False):
            self._panic[pool] = panic
            if panic:
                log.warning("pool %s panics: fewer than %d %% of its members are healthy; every member takes traffic",
                            pool, self.cfg.healthy_panic_threshold)
            else:
                log.warning("pool %s routes to its healthy members again", pool)
        self._metrics.pool_panic.labels(pool).set(1 if panic else 0)

    def _changed(self, u: Upstream) -> None:
        self._set_gauges(u)
        for pool in u.pools:
            self._update_panic(pool)
        for cb in self._listeners:
            cb()

    # ---- active probes ---------------------------------------------------------------------------
    def probe_outcome(self, u: Upstream, result: ProbeResult, reason: str = "") -> None:
        """Apply one probe's outcome to `u` (what `probe` measured; tests drive it directly)."""
        self._metrics.health_probes.labels(u.lane, u.node, result.value).inc()
        if result is ProbeResult.PASSED:
            u.probed_at = self._clock()
            changed = u.health.passed()
            if changed:
                log.warning("upstream %s (%s) is healthy again", u.url, u.lane)
            for pool in u.pools:
                decision = self.outliers[pool].uneject(u.url)
                if decision is not None:
                    self._decided(u, decision)
                    changed = True
            if changed:
                self._changed(u)
        elif result is ProbeResult.FAILED:
            if u.health.failed(reason):
                for pool in u.pools:
                    self._metrics.ejections.labels(u.lane, pool, u.node, reason).inc()
                log.warning("upstream %s (%s) is unhealthy: %s", u.url, u.lane, reason)
                self._changed(u)
        else:
            log.info("upstream %s (%s): its probe got no answer within %gs, but the node shows life: busy, not "
                     "down", u.url, u.lane, self.cfg.timeout_s)

    async def probe(self, calls: OneShotCalls, u: Upstream) -> None:
        t = self.cfg.timeout_s
        try:
            status = await calls.get_status(u.url + "/health", headers=self._headers(u.auth),
                                            timeout=httpx.Timeout(t, connect=t))
        except (httpx.ConnectError, httpx.ConnectTimeout):
            self.probe_outcome(u, ProbeResult.FAILED, "probe_connect")
        except httpx.TimeoutException:  # connected, no answer in time: slow, or silent?
            alive = self.legs_alive_within(u.url, self.cfg.interval_s + t)
            self.probe_outcome(u, ProbeResult.SLOW if alive else ProbeResult.FAILED, "probe_timeout")
        except httpx.HTTPError:
            self.probe_outcome(u, ProbeResult.FAILED, "probe_connect")
        else:
            if status == 200:
                self.probe_outcome(u, ProbeResult.PASSED)
            else:
                self.probe_outcome(u, ProbeResult.FAILED, f"probe_http_{status}")

    async def probe_all(self, calls: OneShotCalls) -> None:
        await asyncio.gather(*(self.probe(calls, u) for u in list(self.upstreams.values())))
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
        """Probe in the background while the body runs (`calls`: the probes' own one-shot calls)."""
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
