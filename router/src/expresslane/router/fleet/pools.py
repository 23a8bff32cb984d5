"""The prefill pool: which member runs a request's prefill leg, and the leg's failover across members.

Every member is a stock vLLM prefill with the same MultiConnector (NixlConnector + ours) and the same destination
allow-list, so any member can hand a request's KV to any decode node; the choice only decides whose prefix cache
and whose queue the request meets. `PrefillPool.choose`:
  1. the members that take traffic: `member_serving` (the health monitor's probes and the pool's outlier
     detection: health.py, outlier.py);
  2. the preferred member: a rendezvous (highest-random-weight) hash of the request's affinity key over them. The
     key is the prompt's first `affinity.prefix_chars` characters (chat: each message's role and text, in order;
     completions: the prompt text, or its token ids written out), so a conversation's next turn, which starts with
     the previous turn's prompt, lands on the member whose vLLM prefix cache holds that prefix's KV blocks (the
     idea of vllm-router's cache_aware policy and llm-d's prefix scorer, without their per-member block index).
     Adding or removing a member moves only the keys that member wins or held;
  3. unless the preferred member has `affinity.max_imbalance` or more prefills in flight than the least loaded
     one: then the least loaded (ties in hash order). A request with no usable key goes to the least loaded.
Prompts shorter than prefix_chars are keyed by their whole text: a first turn that short and its next turn may land
on different members (the next turn then prefills in full: slower, never wrong).

`run` posts the leg: on a failure the lane says may be retried (`retry(err)`) it tries the next member, each member
at most once. Metrics: `expresslane_router_prefill_requests_total{member, choice}` (choice: affinity,
least_loaded, retry) and `expresslane_router_prefill_inflight{member}` (RouterMetrics, the app's one registry).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..config import Affinity
from ..errors import RouterError, UpstreamError, UpstreamUnavailable
from ..metrics import PREFILL_POOL, RouterMetrics, node_label
from .outlier import classify

if TYPE_CHECKING:
    from .health import HealthMonitor

__all__ = ["PrefillPool", "affinity_key", "member_failed", "member_serving"]

T = TypeVar("T")


def member_serving(health: "HealthMonitor | None", url: str, pool: str = PREFILL_POOL) -> bool:
    """Whether member `url` of `pool` (default: the prefill pool) takes traffic now. THE one seam for the pools'
    routing policy, used by the prefill pool's choice, the native lane's node choice and the express gate
    (LaneContext.available): healthy by the active probes and not ejected by the pool's outlier detection, or any
    member while the pool panics (fleet/health.py)."""
    return health is None or health.available(pool, url)


def member_failed(err: RouterError) -> bool:
    """A call to a prefill member that failed as a node fails (a gateway failure or a 5xx: fleet/outlier.classify)
    is run on another member (a native prefill leg's KV, if any, expires on the member that computed it)."""
    return isinstance(err, UpstreamError) and classify(err.kind) is not None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: their text, in order
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def affinity_key(body: dict[str, Any], prefix_chars: int) -> str:
    """The first `prefix_chars` characters of the prompt as the prefill sees it, in order ("" when there is none)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"{m.get('role', '')}\x1f{_text(m.get('content'))}\x1e")
                if sum(map(len, parts)) >= prefix_chars:
                    break
        return "".join(parts)[:prefix_chars]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        return prompt[:prefix_chars]
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return ",".join(map(str, prompt))[:prefix_chars]
    return ""


def _weight(key: str, member: str) -> bytes:
    return hashlib.blake2b(f"{member}\x00{key}".encode(), digest_size=8).digest()


class PrefillPool:
    """Member choice and in-flight counts for the prefill pool. `members()` gives the current member URLs
    (discovery.Membership); `serving(url)` says whether one takes traffic (`member_serving`)."""

    def __init__(self, affinity: Affinity, members: Callable[[], Sequence[str]], serving: Callable[[str], bool],
                 metrics: RouterMetrics, *, retry_after_s: int = 2) -> None:
        self.affinity = affinity
        self.members = members
        self.serving = serving
        self.retry_after_s = retry_after_s
        self.inflight: defaultdict[str, int] = defaultdict(int)
        self.metrics = metrics

    def available(self, exclude: Sequence[str] = ()) -> list[str]:
        return [u for u in self.members() if u not in exclude and self.serving(u)]

    def any_serving(self) -> bool:
        return bool(self.available())

    def unavailable(self, why: str) -> UpstreamUnavailable:
        return UpstreamUnavailable(f"{why}; retry later", stage="prefill", kind="no_healthy_node",
                                   headers={"retry-after": str(self.retry_after_s)})

    def choose(self, key: str, exclude: Sequence[str] = ()) -> tuple[str, str]:
        """(member URL, why: affinity | least_loaded) for a request keyed `key`; the typed 503 when none serves."""
        cands = self.available(exclude)
        if not cands:
            raise self.unavailable("no prefill server takes traffic (unhealthy by its health probes)" if not exclude
                                   else "no other prefill server is left to try")
        if key:
            cands.sort(key=lambda u: _weight(key, u), reverse=True)  # the hash order: cands[0] is preferred
        least = min(cands, key=lambda u: self.inflight[u])  # (min keeps the first of equals: hash order)
        if key and self.inflight[cands[0]] - self.inflight[least] < self.affinity.max_imbalance:
            return cands[0], "affinity"
        return least, "least_loaded"

    async def run(self, body: dict[str, Any], attempt: Callable[[str], Awaitable[T]],
                  retry: Callable[[RouterError], bool], exclude: Sequence[str] = (), *, leg: bool = True) -> T:
        """`attempt(member_url)` on the chosen member; again on the next one while `retry(err)` says the failure
        may be retried elsewhere (each member once; never the members in `exclude`, which this request already
        lost). The last failure is raised. `leg=False`: a side call (/v1/models, /tokenize, ...), chosen and
        failed over the same way but not counted as a prefill leg in the metrics or the in-flight balance."""
        key = affinity_key(body, self.affinity.prefix_chars)
        tried: list[str] = list(exclude)
        while True:
            url, why = self.choose(key, tried)
            if leg:
                m = self.metrics
                m.child(m.prefill_requests, node_label(url), "retry" if tried else why).inc()
                self._track(url, +1)
            try:
                return await attempt(url)
            except RouterError as e:
                tried.append(url)
                if not retry(e) or not self.available(tried):
                    raise
            finally:
                if leg:
                    self._track(url, -1)

    def _track(self, url: str, delta: int) -> None:
        self.inflight[url] += delta
        if not self.inflight[url] and url not in self.members():  # the last leg of a member that left the pool
            del self.inflight[url]  # (its series went with it: RouterMetrics.member_left)
            return
        m = self.metrics
        m.child(m.prefill_inflight, node_label(url)).set(self.inflight[url])
