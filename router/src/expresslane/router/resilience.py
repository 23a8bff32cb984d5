"""Typed config for the router's behaviour off the happy path, and the per-request deadline.

Two sections of the router config (both optional; every value has a safe default):

  health:      active health checking, as Envoy's (fleet/health.py)
    enabled: true             probe every upstream (prefill, native nodes, express nodes) in the background
    interval_s: 2             between probe rounds
    timeout_s: 2              one probe's budget (GET <node>/health)
    unhealthy_threshold: 3    consecutive failed probes that mark a healthy node unhealthy (a probe that
                              connected but got no answer in time fails only when the node showed no other sign
                              of life within the window: no leg completed there, no stream line came from it)
    healthy_threshold: 1      consecutive passing probes that mark an unhealthy node healthy again
    healthy_panic_threshold: 50   when fewer than this % of a pool's members are healthy (probes) and not
                              ejected (outlier detection), the pool routes to ALL its members (Envoy's panic
                              routing: a one-member pool always keeps its member); 0 = never
    max_connections: 64       the probes' own connection pool (traffic cannot starve it)
  resilience:  deadlines, retries and failover (lanes/)
    request_deadline_s: 600   whole request, arrival to last byte; past it: 504 / an error event
    stall_timeout_s: 10       a stream that sends nothing for this long, from a node that showed no sign of life in
                              that window (no passing probe, no other leg completed or streaming), is dead: an
                              error event, cancel, release. From a node that did, it is busy: the stream is waited
                              on, window by window, up to the request deadline, whatever the client library's own
                              per-read timeout (the legs' read timeout is the request deadline)
    first_token_timeout_s: 30 the same for the wait before a decode leg's first line (KV wait included)
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
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import UpstreamTimeout

__all__ = ["Deadline", "DeadlineExceeded", "HealthConfig", "ResilienceConfig"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HealthConfig(_Strict):
    enabled: bool = True
    interval_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    unhealthy_threshold: int = Field(3, ge=1)
    healthy_threshold: int = Field(1, ge=1)
    healthy_panic_threshold: int = Field(50, ge=0, le=100)
    max_connections: int = Field(64, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _no_breaker_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "open_s" in data:
            raise ValueError("open_s is gone: an unhealthy node is probed every interval_s and serves again after "
                             "healthy_threshold passing probes (Envoy's active health checking); remove open_s")
        return data


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
