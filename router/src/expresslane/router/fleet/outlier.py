"""Outlier detection for the nodes of one pool: the request path's failures decide which nodes it skips for a while.

Envoy's outlier detection is the model (its names, in seconds): a node is ejected after `consecutive_failures`
failed requests in a row, or when at least `request_volume` requests reached it within one `interval_s` and
`failure_percentage` % of them failed. It stays ejected for `base_ejection_s` x (times ejected), at most
`max_ejection_s`, then serves again (the multiplier drops by one for every interval it goes without an ejection).
Two guards keep the policy from making an overload worse than the failure it reacts to:
  - at most `max_ejection_percent` % of a pool's nodes are ejected at once, and never the last node that serves:
    request errors alone never take a pool's last node away (the active probes, health.py, still decide whether
    a node is DOWN);
  - panic: when fewer than `panic_threshold_percent` % of the nodes the probes call up are serving, ejections
    are ignored and every up node takes traffic.

Per node:   SERVING --(a rule trips, the guards allow it)--> EJECTED --(ejection time passed)--> SERVING

Pure logic on an injected clock: `failure` / `success` record one request's outcome and return the `Decision`
taken (an ejection, a refused ejection, a return), `admits` answers the routing question, `readmissions` reports
the nodes whose ejection ran out. The caller (health.HealthMonitor) turns decisions into metrics and log lines.
Any pool can use it: a detector knows only node names and the pool's membership, which may change (`set_nodes`).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Decision", "NodeState", "OutlierConfig", "OutlierDetector"]


class OutlierConfig(BaseModel):
    """Router config section `outlier` (docs/operations.md, "Ejection policy")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    consecutive_failures: int = Field(5, ge=1)
    interval_s: float = Field(10.0, gt=0)
    failure_percentage: int = Field(50, ge=1, le=100)
    request_volume: int = Field(20, ge=1)
    base_ejection_s: float = Field(5.0, gt=0)
    max_ejection_s: float = Field(60.0, gt=0)
    max_ejection_percent: int = Field(50, ge=0, le=100)
    panic_threshold_percent: int = Field(50, ge=0, le=100)


class NodeState(enum.Enum):
    SERVING = "serving"
    EJECTED = "ejected"


@dataclass(frozen=True)
class Decision:
    """One decision about one node. action: eject | keep (a rule tripped, a guard refused) | readmit."""

    pool: str
    node: str
    action: str
    reason: str  # eject: consecutive_failures | failure_percentage; keep: last_serving_node | max_ejection_percent
    failure: str = ""  # the kind of the failure that tripped it (connect, timeout, transport, ...)
    cause: str = ""  # what the client of that request saw (the error message)
    ejected_for_s: float = 0.0

    def describe(self) -> str:
        if self.action == "readmit":
            return f"node {self.node} of pool {self.pool!r} serves again (ejection time over)"
        what = (f"ejected for {self.ejected_for_s:g}s" if self.action == "eject"
                else "kept serving (ejection refused)")
        return f"node {self.node} of pool {self.pool!r} {what}: {self.reason}; last failure {self.failure}: {self.cause}"


class _Node:
    __slots__ = ("state", "consecutive", "requests", "failures", "interval_start", "ejected_until", "times_ejected")

    def __init__(self, now: float) -> None:
        self.state = NodeState.SERVING
        self.consecutive = 0
        self.requests = 0
        self.failures = 0
        self.interval_start = now
        self.ejected_until = 0.0
        self.times_ejected = 0


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

    def panic(self, up: Callable[[str], bool]) -> bool:
        """Too few of the nodes the probes call up are serving: ejections are ignored."""
        ups = [n for n in self._nodes if up(n)]
        serving = sum(1 for n in ups if self.state(n) is NodeState.SERVING)
        return bool(ups) and serving * 100 < self.cfg.panic_threshold_percent * len(ups)

    def admits(self, node: str, up: Callable[[str], bool]) -> bool:
        """Whether `node` takes traffic as far as outlier detection goes (`up`: the probes' verdict per node)."""
        if not self.cfg.enabled or self.state(node) is NodeState.SERVING:
            return True
        return self.panic(up)

    # ---- outcomes -----------------------------------------------------------------------------------
    def success(self, node: str) -> None:
        n = self._node(node)
        if n is not None:
            n.consecutive = 0
            n.requests += 1

    def failure(self, node: str, kind: str, cause: str, up: Callable[[str], bool]) -> Decision | None:
        """Record a failed request; the decision if a rule tripped (eject, or keep when a guard refused)."""
        n = self._node(node)
        if n is None or not self.cfg.enabled or self.state(node) is NodeState.EJECTED:
            return None
        n.consecutive += 1
        n.requests += 1
        n.failures += 1
        cfg = self.cfg
        if n.consecutive >= cfg.consecutive_failures:
            reason = "consecutive_failures"
        elif n.requests >= cfg.request_volume and n.failures * 100 >= cfg.failure_percentage * n.requests:
            reason = "failure_percentage"
        else:
            return None
        refused = self._guard(node, up)
        if refused is not None:
            n.consecutive = 0  # the next decision needs a new run of failures
            return Decision(self.pool, node, "keep", refused, kind, cause)
        now = self._clock()
        n.times_ejected += 1
        span = min(cfg.base_ejection_s * n.times_ejected, max(cfg.max_ejection_s, cfg.base_ejection_s))
        n.state, n.ejected_until = NodeState.EJECTED, now + span
        n.consecutive = n.requests = n.failures = 0
        n.interval_start = now
        return Decision(self.pool, node, "eject", reason, kind, cause, span)

    def readmissions(self) -> list[Decision]:
        """The nodes whose ejection time is over, now serving again (each reported once)."""
        out = []
        now = self._clock()
        for name, n in self._nodes.items():
            if n.state is NodeState.EJECTED and now >= n.ejected_until:
                n.state = NodeState.SERVING
                n.interval_start = now
                out.append(Decision(self.pool, name, "readmit", "ejection_time_over"))
        return out

    # ---- internals -----------------------------------------------------------------------------------
    def _node(self, node: str) -> _Node | None:
        n = self._nodes.get(node)
        if n is None:
            return None
        now = self._clock()
        quiet = int((now - n.interval_start) // self.cfg.interval_s)
        if quiet:  # a new interval: counts restart
            if self.state(node) is NodeState.SERVING:
                n.times_ejected = max(0, n.times_ejected - quiet)  # intervals without an ejection: shorter next time
            n.requests = n.failures = 0
            n.interval_start = now
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
