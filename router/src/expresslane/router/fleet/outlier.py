"""Outlier detection for the nodes of one pool, as Envoy models it: the request path's outcomes decide which nodes the
pool skips for a while.

Every leg that reaches a node reports its outcome (the lanes, through health.HealthMonitor): a success, or a failure
whose kind `classify` sorts into Envoy's two classes:
  - gateway failure: the node could not be reached or answered as a broken gateway does: a connect error, a timeout,
    a stream that went silent while its node showed no sign of life (stall), a connection dropped mid-reply
    (transport), an express node that says it is not ready, or an HTTP 502 / 503 / 504;
  - 5xx: any other HTTP 5xx (500 from a node whose process answers but fails every request);
  - not the node's: a 4xx, a busy node (429), the request's own deadline, the router's own pool saturation:
    never counted.
Rules (Envoy's names, seconds; any rule can be turned off with null):
  consecutive_5xx                  that many 5xx or gateway failures in a row eject the node;
  consecutive_gateway_failure      that many gateway failures in a row eject it;
  failure_percentage_threshold     at least that % of the node's legs failed within one `interval_s`, counted once
                                   it had `failure_percentage_request_volume` legs, and only in a pool of at least
                                   `failure_percentage_minimum_hosts` nodes.
An ejected node stays out for `base_ejection_time_s` x (times ejected), at most `max_ejection_time_s`; the multiplier
drops by one for each whole `interval_s` the node serves after its ejection ended (never while it is ejected). A
passing active health check ends an ejection at once (`successful_active_health_check_uneject_host`, as Envoy's
default). Guards: at most `max_ejection_percent` % of the pool is ejected at once (at least one node may be), and
never the pool's last serving node. A refused ejection ("keep") is reported at most once per node per interval.
Panic routing (too few healthy members: route to all of them) is the pool's business: health.HealthMonitor.

Per node:   SERVING --(a rule trips, the guards allow it)--> EJECTED
            EJECTED --(ejection time over, or a passing active health check)--> SERVING

Pure logic on an injected clock: `success` / `failure` record one leg's outcome (`failure` returns the `Decision`
taken: an ejection, or a refused one), `uneject` ends an ejection after a passing probe, `readmissions` reports the
nodes whose ejection time ran out, `admits` answers the routing question. The caller turns decisions into metrics
and log lines. A detector knows only node names and the pool's membership, which may change (`set_nodes`).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Decision", "FailureClass", "NodeState", "OutlierConfig", "OutlierDetector", "classify"]


class OutlierConfig(BaseModel):
    """Router config section `outlier` (docs/operations.md, "Health and outlier detection")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    interval_s: float = Field(10.0, gt=0)
    consecutive_5xx: int | None = Field(5, ge=1)
    consecutive_gateway_failure: int | None = Field(3, ge=1)
    failure_percentage_threshold: int | None = Field(85, ge=1, le=100)
    failure_percentage_request_volume: int = Field(50, ge=1)
    failure_percentage_minimum_hosts: int = Field(2, ge=1)
    base_ejection_time_s: float = Field(5.0, gt=0)
    max_ejection_time_s: float = Field(60.0, gt=0)
    max_ejection_percent: int = Field(50, ge=0, le=100)
    successful_active_health_check_uneject_host: bool = True


class FailureClass(enum.Enum):
    GATEWAY = "gateway_failure"  # unreachable, hung, dropped, not ready, 502 / 503 / 504
    SERVER = "5xx"  # another 5xx: the node answers and fails the request


_GATEWAY_KINDS = frozenset({"connect", "timeout", "stall", "transport", "not_ready", "http_502", "http_503",
                            "http_504"})


def classify(kind: str) -> FailureClass | None:
    """Envoy's class of a failed leg's kind (errors.UpstreamError.kind), or None when it is not the node's."""
    if kind in _GATEWAY_KINDS:
        return FailureClass.GATEWAY
    if kind.startswith("http_5") and kind[5:].isdigit():
        return FailureClass.SERVER
    return None


class NodeState(enum.Enum):
    SERVING = "serving"
    EJECTED = "ejected"


@dataclass(frozen=True)
class Decision:
    """One decision about one node. action: eject | keep (a rule tripped, a guard refused) | readmit."""

    pool: str
    node: str
    action: str
    # eject: consecutive_5xx | consecutive_gateway_failure | failure_percentage; keep: last_serving_node |
    # max_ejection_percent; readmit: ejection_time_over | active_health_check
    reason: str
    failure: str = ""  # the kind of the failure that tripped it (connect, timeout, http_500, ...)
    cause: str = ""  # what the client of that leg saw (the error message)
    ejected_for_s: float = 0.0

    def describe(self) -> str:
        if self.action == "readmit":
            why = "a passing health check" if self.reason == "active_health_check" else "ejection time over"
            return f"node {self.node} of pool {self.pool!r} serves again ({why})"
        what = (f"ejected for {self.ejected_for_s:g}s" if self.action == "eject"
                else "kept serving (ejection refused)")
        return f"node {self.node} of pool {self.pool!r} {what}: {self.reason}; last failure {self.failure}: {self.cause}"


class _Node:
    __slots__ = ("state", "consecutive_5xx", "consecutive_gateway", "requests", "failures", "interval_start",
                 "ejected_until", "times_ejected", "decay_from", "kept_at")

    def __init__(self, now: float) -> None:
        self.state = NodeState.SERVING
        self.consecutive_5xx = 0
        self.consecutive_gateway = 0
        self.requests = 0
        self.failures = 0
        self.interval_start = now
        self.ejected_until = 0.0
        self.times_ejected = 0
        self.decay_from = now  # the multiplier decays from here on, one step per whole interval served
        self.kept_at: float | None = None  # when a refused ejection was last reported


class OutlierDetector:
    def __init__(self, pool: str, nodes: Iterable[str], cfg: OutlierConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool, self.cfg, self._clock = pool, cfg, clock
        self._nodes: dict[str, _Node] = {}
        self.set_nodes(nodes)

    # ---- membership --------------------------------------------------------------------------------
    def set_nodes(self, nodes: Iterable[str]) -> None:
        """The pool's nodes now (a resolved pool changes): new ones start serving, gone ones are forgotten."""
        now = self._clock()
        self._nodes = {n: self._nodes.get(n) or _Node(now) for n in nodes}

    @property
    def nodes(self) -> list[str]:
        return list(self._nodes)

    # ---- queries -----------------------------------------------------------------------------------
    def state(self, node: str) -> NodeState:
        n = self._nodes.get(node)
        if n is None or n.state is NodeState.SERVING or self._clock() >= n.ejected_until:
            return NodeState.SERVING
        return NodeState.EJECTED

    def ejected(self) -> list[str]:
        return [name for name in self._nodes if self.state(name) is NodeState.EJECTED]

    def admits(self, node: str) -> bool:
        """Whether `node` takes traffic as far as outlier detection goes (panic aside: the pool decides that)."""
        return not self.cfg.enabled or self.state(node) is NodeState.SERVING

    def times_ejected(self, node: str) -> int:
        """The ejection multiplier now (what the next ejection's time is based on, less one)."""
        n = self._nodes.get(node)
        if n is None:
            return 0
        self._decay(n, self._clock())
        return n.times_ejected

    # ---- outcomes -----------------------------------------------------------------------------------
    def success(self, node: str) -> None:
        n = self._node(node)
        if n is not None:
            n.consecutive_5xx = n.consecutive_gateway = 0
            n.requests += 1

    def failure(self, node: str, kind: str, cause: str, up: Callable[[str], bool]) -> Decision | None:
        """Record a failed leg (`kind`: its UpstreamError kind; `up`: the probes' verdict per node); the decision
        if a rule tripped (eject, or keep when a guard refused it), None otherwise or when `kind` is not the node's."""
        cls = classify(kind)
        n = self._node(node)
        if cls is None or n is None or not self.cfg.enabled or self.state(node) is NodeState.EJECTED:
            return None
        cfg = self.cfg
        n.requests += 1
        n.failures += 1
        n.consecutive_5xx += 1
        n.consecutive_gateway = n.consecutive_gateway + 1 if cls is FailureClass.GATEWAY else 0
        if cfg.consecutive_gateway_failure is not None and n.consecutive_gateway >= cfg.consecutive_gateway_failure:
            reason = "consecutive_gateway_failure"
        elif cfg.consecutive_5xx is not None and n.consecutive_5xx >= cfg.consecutive_5xx:
            reason = "consecutive_5xx"
        elif (cfg.failure_percentage_threshold is not None and len(self._nodes) >= cfg.failure_percentage_minimum_hosts
              and n.requests >= cfg.failure_percentage_request_volume
              and n.failures * 100 >= cfg.failure_percentage_threshold * n.requests):
            reason = "failure_percentage"
        else:
            return None
        now = self._clock()
        refused = self._guard(node, up)
        if refused is not None:
            if n.kept_at is not None and now - n.kept_at < cfg.interval_s:
                return None  # reported already in this interval
            n.kept_at = now
            return Decision(self.pool, node, "keep", refused, kind, cause)
        self._decay(n, now)
        n.times_ejected += 1
        span = min(cfg.base_ejection_time_s * n.times_ejected, max(cfg.max_ejection_time_s, cfg.base_ejection_time_s))
        n.state, n.ejected_until = NodeState.EJECTED, now + span
        n.consecutive_5xx = n.consecutive_gateway = n.requests = n.failures = 0
        n.interval_start = now
        return Decision(self.pool, node, "eject", reason, kind, cause, span)

    def uneject(self, node: str) -> Decision | None:
        """A passing active health check: an ejected node serves again now (when the config says so)."""
        n = self._nodes.get(node)
        if n is None or not self.cfg.successful_active_health_check_uneject_host or n.state is not NodeState.EJECTED:
            return None
        now = self._clock()
        self._serve_again(n, min(now, n.ejected_until))
        return Decision(self.pool, node, "readmit", "active_health_check")

    def readmissions(self) -> list[Decision]:
        """The nodes whose ejection time is over, now serving again (each reported once)."""
        out = []
        now = self._clock()
        for name, n in self._nodes.items():
            if n.state is NodeState.EJECTED and now >= n.ejected_until:
                self._serve_again(n, n.ejected_until)
                out.append(Decision(self.pool, name, "readmit", "ejection_time_over"))
        return out

    # ---- internals -----------------------------------------------------------------------------------
    def _serve_again(self, n: _Node, ended: float) -> None:
        n.state = NodeState.SERVING
        n.ejected_until = ended
        n.decay_from = ended  # the multiplier decays only from the ejection's end on
        n.interval_start = self._clock()
        n.requests = n.failures = 0

    def _decay(self, n: _Node, now: float) -> None:
        """One step off the multiplier per whole interval served since the last ejection ended (or the last step)."""
        if n.state is NodeState.EJECTED:
            if now < n.ejected_until:
                return  # never while ejected
            n.decay_from = max(n.decay_from, n.ejected_until)
        steps = int((now - n.decay_from) // self.cfg.interval_s)
        if steps > 0:
            n.times_ejected = max(0, n.times_ejected - steps)
            n.decay_from += steps * self.cfg.interval_s

    def _node(self, node: str) -> _Node | None:
        n = self._nodes.get(node)
        if n is None:
            return None
        now = self._clock()
        if now - n.interval_start >= self.cfg.interval_s:  # a new interval: the percentage counts restart
            n.requests = n.failures = 0
            n.interval_start = now
        self._decay(n, now)
        return n

    def _guard(self, node: str, up: Callable[[str], bool]) -> str | None:
        """Why ejecting `node` is refused, or None when it may go."""
        others_serving = [m for m in self._nodes if m != node and up(m) and self.state(m) is NodeState.SERVING]
        if not others_serving:
            return "last_serving_node"
        pct = self.cfg.max_ejection_percent
        allowed = max(1, math.floor(pct * len(self._nodes) / 100)) if pct else 0  # Envoy: at least one
        if len(self.ejected()) + 1 > allowed:
            return "max_ejection_percent"
        return None
