"""Router metrics: one `CollectorRegistry` per app, built in the factory and passed down.

Every series is prefixed `expresslane_router_` and names its unit. Label sets for the configured
pools, nodes, lanes and aliases are created up front so dashboards show zeros, not "No data".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .config import LANES, ExpressPool, RouterConfig

__all__ = ["PREFILL_CHOICES", "PREFILL_POOL", "RequestRecord", "RouterMetrics", "node_label"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
_TPS_BUCKETS = (1, 5, 10, 25, 50, 75, 100, 150, 200, 300, 400, 600, 800, 1200, 2000)
_LOOP_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)

P = "expresslane_router_"
#: The membership key of the prefill pool (native and express pools are keyed by their config name; "prefill" is
#: reserved) and why a prefill member was chosen (pools.py).
PREFILL_POOL = "prefill"
PREFILL_CHOICES = ("affinity", "least_loaded", "retry")


def node_label(url: str) -> str:
    return url.split("://", 1)[-1]


class RouterMetrics:
    def __init__(self, config: RouterConfig, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(P + "requests_total", "Finished client requests by served lane, alias and HTTP status",
                                ["lane", "alias", "status"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first streamed token",
                              ["lane"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Gap between streamed token chunks",
                             ["lane"], buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last byte",
                             ["lane"], buckets=_LATENCY_BUCKETS, registry=r)
        self.user_tps = Histogram(P + "user_tokens_per_second",
                                  "Per-request decode speed: tokens after the first / time after the first",
                                  ["lane"], buckets=_TPS_BUCKETS, registry=r)
        self.queue_wait = Histogram(P + "queue_wait_seconds", "Time an express request waited for a node",
                                    ["lane"], buckets=_QUEUE_BUCKETS, registry=r)
        self.queue_depth = Gauge(P + "queue_depth", "Requests waiting for an express seat", ["pool"], registry=r)
        self.inflight = Gauge(P + "inflight_requests", "Requests in flight per decode node (an express node: its "
                              "busy seats)", ["pool", "node"], registry=r)
        self.seats_total = Gauge(P + "express_seats", "Seats of an express pool's nodes (each node's /capabilities "
                                 "`seats`; 1 until known)", ["pool"], registry=r)
        self.seats_busy = Gauge(P + "express_seats_busy", "Express seats held by a request", ["pool"], registry=r)
        self.rejected = Counter(P + "rejected_total", "Express requests refused with 429", ["pool", "reason"],
                                registry=r)
        self.spillover = Counter(P + "spillover_total", "Express requests served by their spill pool",
                                 ["from_pool", "to_pool"], registry=r)
        self.upstream_errors = Counter(P + "upstream_errors_total", "Failed upstream calls",
                                       ["lane", "stage", "type"], registry=r)
        self.generated_tokens = Counter(P + "generated_tokens_total", "Completion tokens returned to clients",
                                        ["lane"], registry=r)
        # ---- off the happy path (fleet/health.py, fleet/outlier.py, lanes/) ----
        self.upstream_healthy = Gauge(P + "upstream_healthy",
                                      "1 while an upstream is healthy (probes) and not ejected (outlier detection), "
                                      "else 0 (it still takes traffic while its pool panics: pool_panic)",
                                      ["lane", "pool", "node"], registry=r)
        self.pool_panic = Gauge(P + "pool_panic", "1 while too few of a pool's members are healthy and it routes to "
                                "all of them (health.healthy_panic_threshold)", ["pool"], registry=r)
        self.health_probes = Counter(P + "health_probes_total",
                                     "Active health checks by result: passed, failed, slow (no answer in time from "
                                     "a node that showed life on the request path: neither)",
                                     ["lane", "node", "result"], registry=r)
        self.ejections = Counter(P + "upstream_ejections_total",
                                 "Upstreams taken out of traffic: marked unhealthy by the probes (reason probe_*) or "
                                 "ejected by outlier detection (reason: the rule that tripped)",
                                 ["lane", "pool", "node", "reason"], registry=r)
        self.outlier_decisions = Counter(P + "outlier_decisions_total",
                                         "Outlier detection's decisions (fleet/outlier.py): eject, keep (a guard "
                                         "refused an ejection; at most once per node and interval), readmit",
                                         ["pool", "node", "decision", "reason"], registry=r)
        self.saturated = Counter(P + "upstream_pool_saturated_total",
                                 "Upstream calls the router refused itself: its own connection pool had no free "
                                 "connection within timeouts.connect_s (never counted against a node)", ["client"],
                                 registry=r)
        self.failovers = Counter(P + "failovers_total",
                                 "Requests moved to another lane before their first token (node down / failed)",
                                 ["alias", "from_lane", "to_lane", "reason"], registry=r)
        self.midstream_failovers = Counter(P + "midstream_failovers_total",
                                           "Express streams continued on the native lane after their node failed",
                                           ["pool", "outcome"], registry=r)
        self.retries = Counter(P + "retries_total", "Decode legs retried on another node of the pool",
                               ["lane", "pool", "reason"], registry=r)
        # ---- pools (pools.py: the prefill pool's choice; discovery.py: membership from static lists and DNS) ----
        self.prefill_requests = Counter(P + "prefill_requests_total",
                                        "Prefill legs sent to a prefill pool member, by why it was chosen "
                                        "(affinity, least_loaded, retry)", ["member", "choice"], registry=r)
        self.prefill_inflight = Gauge(P + "prefill_inflight", "Prefill legs in flight on a prefill pool member",
                                      ["member"], registry=r)
        self.pool_members = Gauge(P + "pool_members", "Current members of a pool (prefill, native or express)",
                                  ["pool"], registry=r)
        self.pool_dns_failures = Counter(P + "pool_dns_failures_total",
                                         "Pool DNS resolutions that failed (the pool kept its last answer)",
                                         ["pool"], registry=r)
        # ---- the router itself (server/loop_lag.py) ----
        self.loop_lag = Histogram(P + "event_loop_lag_seconds", "How late the router's event loop ran a 0.5 s timer "
                                  "(blocked, or the process got no CPU)", buckets=_LOOP_LAG_BUCKETS, registry=r)
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._precreate(config)

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once (prometheus_client takes a lock and builds a key per call;
        the hot path asks for the same few children on every request and every streamed chunk). Label values
        come from bounded sets (configured lanes, pools, nodes, aliases; HTTP statuses)."""
        key = (metric, labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def member_joined(self, pool: str, url: str) -> None:
        """A pool member appeared (discovery.py): its series start at zero, as a configured member's do."""
        if pool == PREFILL_POOL:
            for choice in PREFILL_CHOICES:
                self.prefill_requests.labels(node_label(url), choice)
            self.prefill_inflight.labels(node_label(url)).set(0)
        else:
            self.inflight.labels(pool, node_label(url)).set(0)

    def member_left(self, pool: str, url: str) -> None:
        """A pool member is gone: drop its per-member series (members from DNS come and go with their pods'
        addresses; their series must not pile up)."""
        node = node_label(url)
        series = ([(self.prefill_requests, (node, c)) for c in PREFILL_CHOICES] + [(self.prefill_inflight, (node,))]
                  if pool == PREFILL_POOL else [(self.inflight, (pool, node))])
        for metric, labels in series:
            self._children.pop((metric, labels), None)
            with contextlib.suppress(KeyError):
                metric.remove(*labels)

    def _precreate(self, config: RouterConfig) -> None:
        for url in config.prefill.static_nodes:  # (members from DNS get theirs when they appear)
            for choice in PREFILL_CHOICES:
                self.prefill_requests.labels(node_label(url), choice)
            self.prefill_inflight.labels(node_label(url)).set(0)
        for pool in (PREFILL_POOL, *config.pools):
            self.pool_members.labels(pool)
            self.pool_dns_failures.labels(pool)
            self.pool_panic.labels(pool).set(0)
        for client in ("oneshot", "stream", "probe"):
            self.saturated.labels(client)
        for lane in LANES:
            for h in (self.ttft, self.itl, self.e2e, self.user_tps, self.queue_wait):
                h.labels(lane)
            self.generated_tokens.labels(lane)
        for name, pool in config.pools.items():
            for node in pool.nodes:
                self.inflight.labels(name, node_label(node if isinstance(node, str) else node.url))
            if isinstance(pool, ExpressPool):
                self.queue_depth.labels(name)
                self.seats_total.labels(name).set(len(pool.nodes))
                self.seats_busy.labels(name).set(0)
                for reason in ("queue_full", "queue_timeout", "node_busy"):
                    self.rejected.labels(name, reason)
                targets = {q.spill_to for q in [pool.queue] + [a.queue for a in config.aliases.values()
                                                              if a.queue is not None and a.pool == name]}
                for target in targets - {None}:
                    self.spillover.labels(name, target)
            else:
                self.retries.labels("native", name, "connect")
            if isinstance(pool, ExpressPool):
                for outcome in ("ok", "failed", "disabled", "client_gone"):
                    self.midstream_failovers.labels(name, outcome)
        for alias, a in config.aliases.items():
            self.requests.labels(config.pools[a.pool].lane, alias, "200")
            q = config.queue_for(alias, a.pool)
            if isinstance(config.pools[a.pool], ExpressPool) and q.spill_to:
                self.failovers.labels(alias, "express", "native", "no_healthy_node")


class RequestRecord:
    """One client request's measurements; `finish` records them once (idempotent)."""

    def __init__(self, metrics: RouterMetrics, *, lane: str, alias: str, started: float,
                 clock: Callable[[], float]):
        self._m = metrics
        self.lane = lane
        self.alias = alias
        self.started = started
        self._clock = clock
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished = False

    def token_chunk(self) -> None:
        """A chunk carrying generated text was sent to the client."""
        now = self._clock()
        if self.first_token_at is None:
            self.first_token_at = now
            self._m.child(self._m.ttft, self.lane).observe(now - self.started)
        else:
            self._m.child(self._m.itl, self.lane).observe(now - (self.last_token_at or now))
        self.last_token_at = now

    def finish(self, status: int, completion_tokens: int = 0) -> None:
        if self.finished:
            return
        self.finished = True
        now = self._clock()
        m = self._m
        m.child(m.requests, self.lane, self.alias, str(status)).inc()
        m.child(m.e2e, self.lane).observe(now - self.started)
        if completion_tokens > 0:
            m.child(m.generated_tokens, self.lane).inc(completion_tokens)
        if (completion_tokens > 1 and self.first_token_at is not None and self.last_token_at is not None
                and self.last_token_at > self.first_token_at):
            m.child(m.user_tps, self.lane).observe(
                (completion_tokens - 1) / (self.last_token_at - self.first_token_at))
