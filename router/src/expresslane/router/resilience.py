"""Typed config for the router's behaviour off the happy path, and the per-request deadline.

Two sections of the router config (both optional; every value has a safe default):

  health:      active probes and the per-node circuit breaker (health.py)
    enabled: true             probe every upstream (prefill, native nodes, express nodes) in the background
    interval_s: 2             between probe rounds
    timeout_s: 2              one probe's budget (GET <node>/health)
    unhealthy_threshold: 2    consecutive probe failures that eject a serving node (CLOSED -> OPEN)
                              (request-path failures do not: they go to outlier detection, section `outlier`,
                              outlier.py)
    open_s: 3                 how long an ejected node stays OPEN before it may be re-admitted (HALF_OPEN)
    healthy_threshold: 1      consecutive successes in HALF_OPEN that re-admit it (-> CLOSED)

  resilience:  deadlines, retries and failover (lanes/)
    request_deadline_s: 600   whole request, arrival to last byte; past it: 504 / an error event
    stall_timeout_s: 10       a stream that sends nothing for this long is dead (error event, cancel, release);
                              a native decode node whose probes answered within that window is busy: its
                              stream is waited on, window by window, up to the request deadline
                              and it is the decode leg's read timeout, so a partitioned node costs seconds
    first_token_timeout_s: 30 the same for the wait before a decode leg's first byte (KV wait included)
    reserve_ttl_s: 60         ttl of POST /pd/reserve (the node caps it): prefill + handoff must fit in it
    native_retries: 1         a native decode node that fails before the first byte: retry on another node (on
                              the same node after retry_backoff_s when it is the pool's only serving node)
    retry_backoff_s: 0.2      the wait before such a retry on the same node
    midstream_failover: true  an express stream whose node dies after tokens reached the client continues on
                              the native lane from its token history
    midstream_failover_aliases: {}   per-alias override of midstream_failover, e.g. {tiny-x: false}
    first_token_at_once: true streaming express requests of an alias with mid-stream failover get the prefill's
                              first token as soon as the prefill leg answers, while the handoff runs (a node
                              failure after it is a mid-stream failover)
    unavailable_retry_after_s: 2     Retry-After of the 503 an express request gets when no node can serve it
                                     and its alias does not spill
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from .errors import UpstreamTimeout

__all__ = ["Deadline", "DeadlineExceeded", "HealthConfig", "ResilienceConfig"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HealthConfig(_Strict):
    enabled: bool = True
    interval_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    unhealthy_threshold: int = Field(2, ge=1)
    open_s: float = Field(3.0, ge=0)
    healthy_threshold: int = Field(1, ge=1)


class ResilienceConfig(_Strict):
    request_deadline_s: float = Field(600.0, gt=0)
    stall_timeout_s: float = Field(10.0, gt=0)
    first_token_timeout_s: float = Field(30.0, gt=0)
    reserve_ttl_s: float = Field(60.0, gt=0)
    native_retries: int = Field(1, ge=0)
    retry_backoff_s: float = Field(0.2, ge=0)
    midstream_failover: bool = True
    midstream_failover_aliases: dict[str, bool] = Field(default_factory=dict)
    first_token_at_once: bool = True
    unavailable_retry_after_s: int = Field(2, ge=0)

    def midstream_failover_for(self, alias: str) -> bool:
        return self.midstream_failover_aliases.get(alias, self.midstream_failover)


class DeadlineExceeded(Exception):
    """The request's deadline passed."""


class Deadline:
    """A per-request deadline on the app's clock: `budget(s)` is min(s, time left), raising once none is left."""

    def __init__(self, clock: Callable[[], float], started: float, total_s: float):
        self._clock = clock
        self.at = started + total_s
        self.total_s = total_s

    def left(self) -> float:
        return self.at - self._clock()

    def budget(self, want_s: float) -> float:
        left = self.left()
        if left <= 0:
            raise DeadlineExceeded(f"the request deadline ({self.total_s:g}s) passed")
        return min(want_s, left)

    def timeout_for(self, want_s: float, *, stage: str) -> float:
        """`budget`, with the typed 504 (kind "deadline") the client gets when nothing is left."""
        try:
            return self.budget(want_s)
        except DeadlineExceeded as e:
            raise UpstreamTimeout(f"{stage}: {e}", stage=stage, kind="deadline") from None
