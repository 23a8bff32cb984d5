"""Calls to one express decode node (TileRT's `/pd/*` contract plus our `/pd/reserve`), with typed outcomes.

    reserve(leg)       POST /pd/reserve {rid, ttl_s}   (kind expresslane, BEFORE the prefill leg)
    open_decode(leg)   POST /pd/decode {..., stream: true}, then read up to the first token batch
    cancel(leg)        POST /pd/cancel {rid}           (every early exit; bounded by timeouts.cancel_s)

The router always asks the node for NDJSON (also for a non-streaming client, which gets the assembled
JSON), so every wait on a node is bounded: the first token batch by `first_token_timeout_s` (the node's
own KV wait, `timeouts.kv_wait_s`, is shorter), each later line by `stall_timeout_s`, each of them extended
window by window while the node shows life (a busy node is not a dead one), all by the request's deadline.

Outcomes before the first token are `NodeBusy` (429: requeue) or `NodeFailed(reason)` (the request may go
elsewhere: the lane applies the alias's policy). Every call's outcome is reported to outlier detection (a
success, or a failure with its kind: fleet/outlier.classify tells the node's failures from the rest).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..config import ExpressNode
from ..errors import BadRequest, RouterError, UpstreamError
from ..resilience import Deadline
from ..openai.logprobs import Position
from ..upstream.errors import map_transport_error
from ..upstream.lines import LineReader, loads_line, wait_alive
from .base import LaneContext

__all__ = ["Leg", "NodeBusy", "NodeClient", "NodeFailed", "NodeTokens", "STAGE"]

log = logging.getLogger("expresslane.router.express")
STAGE = "express_decode"


class NodeBusy(Exception):
    """The node answered 429: another request holds it (e.g. a second router)."""


class NodeFailed(Exception):
    """The node cannot serve this request before its first token; `reason` is a metric label."""

    def __init__(self, reason: str, detail: str, *, before_prefill: bool = False):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.before_prefill = before_prefill  # nothing was spent yet: another node of the pool may take it


@dataclass
class Leg:
    """One request on one node: what the prefill leg produced, plus the node call's state."""

    node: ExpressNode
    kind: str  # expresslane | tilert
    rid: str
    response_id: str = ""
    first_token_id: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    n_prompt: int = 0
    max_tokens: int = 0
    settled: bool = False  # the node finished or never took the rid: no /pd/cancel needed
    first_lp: Position | None = None  # the first token's logprobs, from the prefill reply
    # logprobs wanted: one Position per answer token, in the order the token batches were yielded
    positions: list[Position] | None = None
    constrained: bool = False  # the node decodes under a grammar: a native continuation could not resume it


def _reason_of(text: str) -> str:
    """A short metric-safe label from a node's error body (`{"error": "kv_transfer_failed", ...}`)."""
    try:
        import json

        obj = json.loads(text)
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict):
            err = err.get("code") or err.get("type")
        if isinstance(err, str) and err.replace("_", "").isalnum() and len(err) <= 40:
            return err
    except ValueError:
        pass
    return ""


class NodeTokens:
    """The node's token batches: the first (already read) and the rest; `done` once the done line came."""

    def __init__(self, leg: Leg, resp: httpx.Response, reader: LineReader, first: list[int]):
        self.leg = leg
        self._resp = resp
        self._reader = reader
        self._first = first
        self._first_lp: tuple[Any, Any] = (None, None)
        self.done = False
        self.finish_reason: str | None = None
        self.batch_lp: tuple[Any, Any] = (None, None)  # the last yielded batch's (lp, tp) arrays, if sent

    async def batches(self) -> AsyncIterator[list[int]]:
        if self._first:
            self.batch_lp = self._first_lp
            yield self._first
        if self.done:
            return
        while (line := await self._reader.next()) is not None:
            if not line.strip():
                continue
            msg = loads_line(line, stage=STAGE)
            if "t" in msg:
                ids = msg["t"] if isinstance(msg["t"], list) else []
                if ids:
                    self.batch_lp = (msg.get("lp"), msg.get("tp"))
                    yield [int(t) for t in ids]
            elif msg.get("done"):
                self.done, self.finish_reason = True, msg.get("finish_reason")
                self.leg.settled = True
                return
            elif "error" in msg:
                self.leg.settled = True  # the node ended this request itself
                raise UpstreamError(f"express node {self.leg.node.name} failed mid-stream: {msg.get('error')}",
                                    stage=STAGE, kind="stream_error")
        raise UpstreamError(f"express node {self.leg.node.name} ended the stream without a done line",
                            stage=STAGE, kind="truncated")

    async def aclose(self) -> None:
        await self._resp.aclose()


class NodeClient:
    def __init__(self, ctx: LaneContext):
        self.ctx = ctx
        self.no_reserve: set[str] = set()  # nodes that answered 404/405 to /pd/reserve (older contract)

    def _headers(self) -> dict[str, str]:
        return self.ctx.headers("express")

    def _down(self, leg: Leg, kind: str, cause: str) -> None:
        self.ctx.report_failure(leg.node.url, kind, cause)  # outlier detection keeps only the node's failures

    # ---- reserve ------------------------------------------------------------------------------
    async def reserve(self, leg: Leg, deadline: Deadline) -> None:
        if leg.node.url in self.no_reserve:
            return
        cfg = self.ctx.config
        t = deadline.timeout_for(cfg.timeouts.connect_s, stage=STAGE)
        url = leg.node.url + "/pd/reserve"
        try:
            resp = await self.ctx.client.post(url, json={"rid": leg.rid, "ttl_s": cfg.resilience.reserve_ttl_s},
                                              headers=self._headers(), timeout=httpx.Timeout(t, connect=t))
        except httpx.HTTPError as e:
            err = map_transport_error(e, stage=STAGE, url=url)
            self._down(leg, err.kind, err.message)  # a timed-out reserve may have landed: leave it unsettled
            raise NodeFailed(err.kind, err.message, before_prefill=True) from None
        if resp.is_success:
            self.ctx.report_success(leg.node.url)
            return
        leg.settled = True  # nothing was reserved for us
        text = resp.text[:300]
        if resp.status_code == 429:
            raise NodeBusy(text)
        if resp.status_code == 503:
            msg = f"express node {leg.node.name} is not ready: {text}"
            self._down(leg, "not_ready", msg)
            raise NodeFailed("not_ready", msg, before_prefill=True)
        if resp.status_code in (404, 405):  # a node of the older contract: serve it without reservations
            log.warning("express node %s has no /pd/reserve (%d): serving it without reservations; a dead node "
                        "is then found only after the prefill", leg.node.url, resp.status_code)
            self.no_reserve.add(leg.node.url)
            leg.settled = False
            return
        if resp.status_code >= 500:
            self._down(leg, f"http_{resp.status_code}", f"express node {leg.node.name} answered /pd/reserve with "
                                                        f"{resp.status_code}: {text}")
        raise NodeFailed(f"reserve_http_{resp.status_code}",
                         f"express node {leg.node.name} refused the reservation ({resp.status_code}): {text}",
                         before_prefill=True)

    # ---- decode -----------------------------------------------------------------------------------
    async def open_decode(self, leg: Leg, body: dict[str, Any], deadline: Deadline) -> NodeTokens:
        """POST /pd/decode and read its first token batch. Raises NodeBusy, NodeFailed or BadRequest."""
        ctx, res = self.ctx, self.ctx.config.resilience
        url = leg.node.url + "/pd/decode"
        first_s = deadline.timeout_for(res.first_token_timeout_s, stage=STAGE)
        alive = ctx.alive(leg.node.url)
        resp: httpx.Response | None = None
        try:
            # read timeout: the deadline's (the waits below decide when a silence is a stall, not the library)
            timeout = httpx.Timeout(deadline.left(), connect=ctx.config.timeouts.connect_s)
            req = ctx.client.build_request("POST", url, json={**body, "stream": True}, headers=self._headers(),
                                           timeout=timeout)
            resp = await wait_alive(ctx.client.send(req, stream=True), want_s=first_s, deadline=deadline,
                                    alive=alive, stage=STAGE, what=f"express node {leg.node.name} sent no reply")
            if not resp.is_success:
                await self._refused(leg, resp)
            reader = LineReader(resp, stage=STAGE, url=leg.node.url, first_s=first_s, next_s=res.stall_timeout_s,
                                deadline=deadline, alive=alive, on_line=ctx.on_line(leg.node.url))
            tokens = NodeTokens(leg, resp, reader, [])
            gen = tokens.batches()
            first = await anext(gen, None)
            await gen.aclose()
        except httpx.HTTPError as e:
            await self._close(resp)
            err = map_transport_error(e, stage=STAGE, url=url)
            self._down(leg, err.kind, err.message)
            raise NodeFailed(err.kind, err.message) from None
        except UpstreamError as e:  # read errors, stall, deadline, an error line or a truncated stream before a token
            await self._close(resp)
            self._down(leg, e.kind, e.message)
            raise NodeFailed(e.kind, e.message) from None
        except BaseException:
            await self._close(resp)
            raise
        ctx.report_success(leg.node.url)
        if first is not None:
            tokens._first, tokens._first_lp = first, tokens.batch_lp
        return tokens  # first is None: a done line before any token (done is set)

    async def _close(self, resp: httpx.Response | None) -> None:
        if resp is not None:
            await resp.aclose()

    async def _refused(self, leg: Leg, resp: httpx.Response) -> None:
        content = (await resp.aread())[:300].decode("utf-8", "replace")
        await resp.aclose()
        code, name = resp.status_code, leg.node.name
        if code == 429:
            raise NodeBusy(content)
        if code in (400, 422, 501):  # the node refuses a parameter it cannot honour: the client's to fix
            leg.settled = True
            self.ctx.metrics.upstream_errors.labels("express", STAGE, f"http_{code}").inc()
            raise BadRequest(f"express node {name} refused the request: {content}; "
                             "send 'X-Lane: native' to use the native lane")
        if code == 503:
            msg = f"express node {name} is not ready: {content}"
            self._down(leg, "not_ready", msg)
            raise NodeFailed("not_ready", msg)
        reason = _reason_of(content) or {504: "kv_timeout", 409: "not_reserved"}.get(code) or f"http_{code}"
        msg = f"express node {name} answered {code}: {content}"
        if code >= 500 and code != 504:  # (504: the KV never arrived: the prefill's handoff failed, not the node)
            self._down(leg, f"http_{code}", msg)
        raise NodeFailed(reason, msg)

    # ---- cancel ---------------------------------------------------------------------------------
    async def cancel_unless_settled(self, leg: Leg) -> None:
        if leg.settled:
            return
        leg.settled = True
        t = self.ctx.config.timeouts.cancel_s
        try:
            r = await self.ctx.client.post(leg.node.url + "/pd/cancel", json={"rid": leg.rid}, headers=self._headers(),
                                           timeout=httpx.Timeout(t, connect=min(t, self.ctx.config.timeouts.connect_s)))
            log.info("cancel %s on %s -> %d", leg.rid, leg.node.url, r.status_code)
        except httpx.HTTPError as e:
            log.warning("cancel %s on %s failed: %s", leg.rid, leg.node.url, e)


def count_node_failure(ctx: LaneContext, err: RouterError | NodeFailed) -> None:
    kind = err.reason if isinstance(err, NodeFailed) else getattr(err, "kind", "error")
    ctx.metrics.upstream_errors.labels("express", STAGE, kind).inc()
