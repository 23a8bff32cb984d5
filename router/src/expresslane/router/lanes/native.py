"""Native lane: prefill on the stock vLLM prefill server, decode on a stock vLLM NixlConnector node.

1. prefill leg (prefill.native_prefill_body): max_tokens=1, stream=false,
   kv_transfer_params={"do_remote_decode": true}; the reply's `kv_transfer_params` say where the KV is.
2. decode leg on the node with the fewest outstanding requests: the client's own body with `model`
   set to the served name and the returned `kv_transfer_params`. Streaming relays the node's SSE
   events, rewriting `model` to the alias; the router always asks for the usage chunk (to count
   tokens) and drops it again unless the client asked for it.
The response id is the decode's, the usage is the decode's with `prompt_tokens` from the prefill.

Off the happy path:
- only healthy nodes (health.py) are picked; no healthy node -> 503 + Retry-After before any prefill;
  a prefill known down -> the same, at once.
- a decode node that fails before the first byte reaches the client (connect error, a 5xx, a connection closed
  before any reply, no first event in `first_token_timeout_s` from a node showing no life, a stream that ends
  before its first event) is
  retried on another serving node, or on the same node after `resilience.retry_backoff_s` when it is the pool's
  only serving one (at most `resilience.native_retries` times, counted in retries_total). After a connect error
  the KV was never touched, so the same kv_transfer_params are reused; otherwise the prefill runs again (the
  first node may have pulled and freed the blocks).
- every leg's outcome is reported to outlier detection (fleet/health.py, fleet/outlier.py): a success, or a failure
  with its message; outlier detection ejects a node after a run of gateway failures or 5xx, never the pool's last
  serving node.
- a stream that sends nothing for `stall_timeout_s` from a node that showed no sign of life within that window (no
  passing probe, no other leg there), or that ends without `[DONE]`, is an error event in vLLM's streaming error
  format (then `[DONE]`), never a quiet success; a node that shows life is busy, and its stream is waited on up to
  the request deadline (upstream/lines.LineReader; the leg's read timeout is the deadline, not the window).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.responses import Response

from ..config import NativePool
from ..errors import RouterError, UpstreamError, UpstreamTimeout, UpstreamUnavailable
from ..json_codec import CompactJSONResponse
from ..metrics import RequestRecord, node_label
from ..openai.shapes import SSE_DONE, ClientRequest, iter_sse_data, sse
from ..fleet.pools import member_failed
from .prefill import native_prefill_body, prompt_tokens
from ..resilience import Deadline
from ..upstream.lines import LineReader, wait_alive
from ..upstream.calls import open_stream
from .base import LaneContext, ManagedStream, closing_on_error, count_upstream_error

__all__ = ["NativeLane", "NativeStream", "decode_body", "fix_usage"]

log = logging.getLogger("expresslane.router")

T = TypeVar("T")

# Failures before the first byte that another node may not have: retried there.
RETRY_KINDS = ("connect", "http_500", "http_502", "http_503", "http_504", "stall", "timeout", "transport", "truncated")


def decode_body(body: dict[str, Any], model: str, kv_transfer_params: dict[str, Any],
                *, force_usage: bool) -> dict[str, Any]:
    out = dict(body)
    out["model"] = model
    out["kv_transfer_params"] = kv_transfer_params
    if force_usage and out.get("stream"):
        out["stream_options"] = {**(out.get("stream_options") or {}), "include_usage": True}
    return out


def fix_usage(obj: dict[str, Any], prompt_tokens_: int) -> int:
    """Set usage.prompt_tokens from the prefill, recompute the total; return completion_tokens."""
    u = obj.get("usage")
    if not isinstance(u, dict):
        return 0
    completion = u.get("completion_tokens") if isinstance(u.get("completion_tokens"), int) else 0
    u["prompt_tokens"] = prompt_tokens_
    u["total_tokens"] = prompt_tokens_ + completion
    return completion


def _has_text(obj: dict[str, Any]) -> bool:
    for c in obj.get("choices") or ():
        if isinstance(c, dict) and (c.get("text") or (c.get("delta") or {}).get("content")):
            return True
    return False


@dataclass
class NativeStream:
    """An open native decode stream whose first SSE event has been read (so it is known to work)."""

    url: str
    first: str  # the first event's data
    events: AsyncIterator[str]  # the rest
    stack: contextlib.AsyncExitStack  # closes the upstream reply and the node's in-flight count

    async def all_events(self) -> AsyncIterator[str]:
        yield self.first
        async for data in self.events:
            yield data


class NativeLane:
    def __init__(self, ctx: LaneContext, pools: dict[str, NativePool]):
        self.ctx = ctx
        self.pools = pools
        self._outstanding: defaultdict[tuple[str, str], int] = defaultdict(int)  # (pool, url): members may come and go

    # ---- node choice -------------------------------------------------------------------------
    def pick_node(self, pool: str, exclude: tuple[str, ...] = ()) -> str | None:
        """The serving node (probes and outlier detection: LaneContext.available) with the fewest outstanding
        requests, or None when none is up."""
        cands = [u for u in self.ctx.native_nodes(pool) if u not in exclude and self.ctx.available(pool, u)]
        return min(cands, key=lambda url: self._outstanding[(pool, url)]) if cands else None

    def _track(self, pool: str, url: str, delta: int) -> None:
        key = (pool, url)
        self._outstanding[key] += delta
        if not self._outstanding[key] and url not in self.ctx.native_nodes(pool):  # a member that left the pool:
            del self._outstanding[key]  # its last request ended (its series went with it: RouterMetrics.member_left)
            return
        m = self.ctx.metrics
        m.child(m.inflight, pool, node_label(url)).set(self._outstanding[key])

    def _unavailable(self, what: str) -> UpstreamUnavailable:
        ra = self.ctx.config.resilience.unavailable_retry_after_s
        return UpstreamUnavailable(f"{what}; retry later", stage="decode", kind="no_healthy_node",
                                   headers={"retry-after": str(ra)})

    def _failed(self, url: str, err: RouterError) -> None:
        count_upstream_error(self.ctx, "native", err)
        self.ctx.report_error(url, err)  # outlier detection tells the node's failures from the rest

    # ---- the prefill leg ---------------------------------------------------------------------------
    def require_prefill_up(self) -> None:
        """No prefill member taking traffic fails the request at once (typed 503 + Retry-After), on both lanes."""
        if not self.ctx.prefills.any_serving():  # type: ignore[union-attr]
            raise self.ctx.prefills.unavailable(  # type: ignore[union-attr]
                "no prefill server takes traffic (unhealthy by its health probes)")

    async def prefill(self, body: dict[str, Any], path: str, deadline: Deadline) -> tuple[dict[str, Any], int]:
        """(kv_transfer_params, prompt tokens) of a native prefill leg for the client body `body`, on a member of the
        prefill pool (fleet/pools.py); a member that fails as a node does (pools.member_failed) is left for the next
        one."""
        ctx, cfg = self.ctx, self.ctx.config
        self.require_prefill_up()
        leg = native_prefill_body(body, cfg.prefill.model)

        async def attempt(url: str) -> tuple[dict[str, Any], int]:
            try:
                pre = await ctx.calls.post_json(url + path, leg, stage="prefill", headers=ctx.headers("vllm"),
                                                timeout=ctx.timeout(deadline.timeout_for(cfg.timeouts.prefill_s,
                                                                                         stage="prefill")))
                kvp = pre.get("kv_transfer_params")
                if not isinstance(kvp, dict):
                    raise UpstreamError("prefill reply has no kv_transfer_params: is the prefill server started "
                                        "with a kv-transfer-config that includes NixlConnector?", stage="prefill")
                ctx.report_success(url)
                return kvp, prompt_tokens(pre)
            except RouterError as e:
                self._failed(url, e)
                raise

        return await ctx.prefills.run(body, attempt, retry=member_failed)  # type: ignore[union-attr]

    # ---- orchestration ---------------------------------------------------------------------------
    async def handle(self, req: ClientRequest, pool: str, record: RequestRecord) -> Response:
        ctx, cfg = self.ctx, self.ctx.config
        deadline = ctx.deadline(record)
        if self.pick_node(pool) is None:
            raise self._unavailable(f"no decode node of pool {pool!r} takes traffic (unhealthy by its probes)")
        kvp, n_prompt = await self.prefill(req.body, req.path, deadline)

        async def attempt(url: str, kvp: dict[str, Any], n_prompt: int) -> Response:
            body = decode_body(req.body, cfg.native_model(pool), kvp, force_usage=True)
            if req.stream:
                st = await self.open_stream(pool, url, req.path, body, deadline)
                return ManagedStream(self._relay(req, st, n_prompt, record), on_close=st.stack.aclose, record=record)
            return await self._non_stream(req, pool, url, body, n_prompt, record, deadline)

        return await self.decode_leg(pool, kvp, n_prompt, attempt,
                                     lambda: self.prefill(req.body, req.path, deadline), deadline)

    async def decode_leg(self, pool: str, kvp: dict[str, Any], n_prompt: int,
                         attempt: Callable[[str, dict[str, Any], int], Awaitable[T]],
                         prefill_again: Callable[[], Awaitable[tuple[dict[str, Any], int]]], deadline: Deadline) -> T:
        """`attempt(url, kv_transfer_params, prompt_tokens)` on the least-loaded serving node, with the lane's retry
        rule (module docstring): a failure before the first byte of a kind in RETRY_KINDS is tried again on another
        serving node, or on the same one after retry_backoff_s, at most resilience.native_retries times; after
        anything but a connect error the prefill runs again (`prefill_again`). The native lane's own requests and an
        express request's mid-stream failover (continuation.py) both decode through here."""
        res = self.ctx.config.resilience
        tried: tuple[str, ...] = ()
        attempts = 0
        while True:
            url = self.pick_node(pool, tried) or (tried[-1] if tried and self.ctx.available(pool, tried[-1])
                                                  else None)  # the only serving node: once more, after a backoff
            if url is None:
                raise self._unavailable(f"no healthy decode node of pool {pool!r} is left to try")
            try:
                return await attempt(url, kvp, n_prompt)
            except UpstreamError as e:
                if attempts >= res.native_retries or e.kind not in RETRY_KINDS:
                    raise
                attempts += 1
                tried += (url,)
                self.ctx.metrics.retries.labels("native", pool, e.kind).inc()
                log.warning("native decode leg on %s failed before its first byte (%s: %s): retrying on %s",
                            url, e.kind, e.message, self.pick_node(pool, tried) or "the same node")
                if self.pick_node(pool, tried) is None:
                    await asyncio.sleep(deadline.timeout_for(res.retry_backoff_s, stage="decode"))
                if e.kind != "connect":  # the node may have pulled (and so freed) the KV: prefill again
                    kvp, n_prompt = await prefill_again()

    async def _non_stream(self, req: ClientRequest, pool: str, url: str, body: dict[str, Any], n_prompt: int,
                          record: RequestRecord, deadline: Deadline) -> Response:
        ctx = self.ctx
        self._track(pool, url, +1)
        try:
            out = await ctx.calls.post_json(url + req.path, body, stage="decode", headers=ctx.headers("vllm"),
                                  timeout=ctx.timeout(deadline.timeout_for(ctx.config.timeouts.decode_s,
                                                                           stage="decode")))
        except RouterError as e:
            if isinstance(e, UpstreamError) and e.kind == "timeout" and deadline.left() <= 0:
                e = UpstreamTimeout(f"decode: the request deadline ({deadline.total_s:g}s) passed", stage="decode",
                                    kind="deadline")  # the request's clock ran out, not the node's fault
            self._failed(url, e)
            raise e from None
        finally:
            self._track(pool, url, -1)
        ctx.report_success(url)
        out["model"] = req.alias
        if "kv_transfer_params" in out:
            out["kv_transfer_params"] = None
        completion = fix_usage(out, n_prompt)
        record.finish(200, completion)
        return CompactJSONResponse(out)

    async def open_stream(self, pool: str, url: str, path: str, body: dict[str, Any],
                          deadline: Deadline) -> NativeStream:
        """POST a streaming decode leg and read its first event (bounded by first_token_timeout_s)."""
        ctx, res = self.ctx, self.ctx.config.resilience
        stack = contextlib.AsyncExitStack()
        async with closing_on_error(stack):
            self._track(pool, url, +1)
            stack.callback(self._track, pool, url, -1)
            try:
                first_s = deadline.timeout_for(res.first_token_timeout_s, stage="decode")
                # the headers within the wait for the first line (LineReader's rules); the read timeout is the
                # deadline's: the reader decides when a silence is a stall, not the client library
                read_s = deadline.timeout_for(ctx.config.timeouts.decode_s, stage="decode")
                resp = await wait_alive(stack.enter_async_context(open_stream(
                    ctx.client, url + path, body, stage="decode", headers=ctx.headers("vllm"),
                    timeout=ctx.timeout(read_s))), want_s=first_s, deadline=deadline, alive=ctx.alive(url),
                    stage="decode", what=f"{url} sent no reply")
                reader = LineReader(resp, stage="decode", url=url, first_s=first_s, next_s=res.stall_timeout_s,
                                    deadline=deadline, alive=ctx.alive(url), on_line=ctx.on_line(url))
                events = iter_sse_data(reader.__aiter__())
                first = await anext(events, None)
                if first is None:
                    raise UpstreamError(f"decode node {url} ended its stream before the first event",
                                        stage="decode", kind="truncated")
            except RouterError as e:
                self._failed(url, e)
                raise
        ctx.report_success(url)
        return NativeStream(url, first, events, stack)

    async def _relay(self, req: ClientRequest, st: NativeStream, n_prompt: int,
                     record: RequestRecord) -> AsyncIterator[bytes]:
        completion = 0
        try:
            saw_done = False
            async for data in st.all_events():
                if data.strip() == "[DONE]":
                    saw_done = True
                    break
                try:
                    obj = json.loads(data)
                except ValueError:
                    raise UpstreamError(f"decode node sent a bad SSE event: {data[:200]!r}", stage="decode") from None
                if not isinstance(obj, dict):
                    raise UpstreamError(f"decode node sent a bad SSE event: {data[:200]!r}", stage="decode")
                if "error" in obj:  # vLLM's own mid-stream error event: relay it as is
                    count_upstream_error(self.ctx, "native", UpstreamError("", stage="decode", kind="stream_error"))
                    yield sse(obj)
                    yield SSE_DONE
                    record.finish(500, completion)
                    return
                obj["model"] = req.alias
                if isinstance(obj.get("usage"), dict):
                    completion = fix_usage(obj, n_prompt)
                    if not obj.get("choices") and not req.include_usage:
                        continue
                if not req.include_usage:
                    obj.pop("usage", None)
                if _has_text(obj):
                    record.token_chunk()
                yield sse(obj)
            if not saw_done:
                raise UpstreamError(f"decode node {st.url} ended the stream without [DONE]", stage="decode",
                                    kind="truncated")
        except UpstreamError as e:
            self._failed(st.url, e)
            yield sse(e.body())
            yield SSE_DONE
            record.finish(e.status, completion)
            return
        yield SSE_DONE
        record.finish(200, completion)
