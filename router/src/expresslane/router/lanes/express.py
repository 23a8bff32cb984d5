"""Express lane: stock vLLM prefill -> a decode node speaking TileRT's HTTP contract (a few users per node).

Per request:
1. Gate: take a free seat of the pool (at most a node's seats in flight on it: fleet/gate.py), else wait in the
   pool's bounded FIFO queue; a full queue or `max_wait_s` without a node -> the alias's `when_full`:
   `spill` (served by the native `spill_to` pool, counted) or `reject` (429 + Retry-After).
2. Prefill leg (prefill.express_prefill_body) with the node's marker in `kv_transfer_params`:
   kind expresslane: {expresslane_host, expresslane_ctrl_port, expresslane_rid=<router uuid hex>};
   kind tilert: {tilert_host, tilert_ctrl_port}, rid derived from the prefill reply id (TileRT's rule).
   The first token id comes from the reply (`token_ids`, else logprobs `token_id:N`).
3. POST {node}/pd/decode {rid, first_token_id, max_tokens, sampling, stream, timeout_s}; NDJSON when
   the client streams, one JSON reply otherwise. The node's token ids (starting with first_token_id)
   are detokenized here (detokenizer.OutputAssembler: stop strings, stop ids, EOS, length).
   Node replies: 429 busy -> release and requeue (at most `busy_retries` times, then `when_full`);
   504 -> 504 (the KV never arrived); 400/422/501 (a parameter the node cannot honour) -> 400 with
   the node's message; anything else -> 502. Options the pool's node kind cannot honour (prompt_logprobs,
   echo, ...; for TileRT also logprobs, structured outputs, tools, min_tokens, frequency_penalty) are
   refused with 400 before any work (express_options.py; capability routing usually sends them native
   first). `kind: expresslane` nodes also get `prompt_token_ids` (a repetition penalty covers the prompt,
   as in vLLM; prompt-lookup speculation drafts from it), `structured_outputs` (structured.py / tools.py:
   as vLLM builds them) and `top_logprobs` (the client's k; the answer's logprobs: logprobs.py).
   vLLM's output limits are applied here (output_limits.py): over the context before any work, min_tokens
   against the budget once the prefill reply gave the prompt length (the reservation is cancelled).
   The client body is read once, into req.opts (request.py).
4. The node is released on every exit. If the router stops early (stop string, client gone, error, a node
   504/502, a retry after 429) it first POSTs /pd/cancel {rid} (bounded by timeouts.cancel_s), then releases.

Off the happy path (issue 11; node calls in express_node.py, failover in continuation.py):
- the gate hands out only healthy nodes; kind expresslane reserves the node (POST /pd/reserve) BEFORE the
  prefill leg, so a dead or busy node costs no prefill;
- a request that cannot be served before its first token reaches the client (no healthy node, reserve
  fails, the prefill reports `expresslane_status: failed`, the node answers 502/503/504/409 or cannot be
  reached, or sends no first token in time) follows its alias's policy as for busy: `spill` to the native
  target (failovers_total{reason}) or a typed 503 with Retry-After. A failed reserve first tries another
  healthy node of the pool;
- the node is always asked for NDJSON: the first token within `first_token_timeout_s`, each later line
  within `stall_timeout_s`, all within the request deadline; a stall ejects the node;
- after the first token, a node failure continues the request on the native lane from its token history
  (continuation.py; per alias `resilience.midstream_failover`), else it is an error event (stream) or a
  typed 5xx (non-stream), never a partial 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from starlette.responses import Response

from ..config import ExpressNode, ExpressPool, QueueConfig
from ..openai.detokenizer import IncrementalDetokenizer, ModelText, OutputAssembler
from ..errors import LaneBusy, RouterError, UpstreamError, UpstreamRejected, UpstreamUnavailable
from ..fleet.gate import Lease, NodeGate, NoHealthyNode, QueueFull, QueueTimeout
from ..metrics import RequestRecord, node_label
from ..openai.shapes import SSE_DONE, ClientRequest, sse
from ..fleet.pools import member_failed
from .prefill import derive_tilert_rid, express_prefill_body, first_token_id, prompt_token_ids, prompt_tokens
from ..resilience import Deadline
from ..openai.output_limits import check_requested, effective_max_tokens
from ..openai.logprobs import Position, TokenStrings, from_node, from_prefill
from ..openai.structured import node_structured_outputs
from ..upstream.errors import map_transport_error, read_json
from ..fleet.outlier import classify
from .base import LaneContext, ManagedStream, closing_on_error, count_upstream_error
from .continuation import Continuation
from .express_node import STAGE, Leg, NodeBusy, NodeClient, NodeFailed, NodeTokens
from .express_options import SAMPLING_KEYS, check_express_supported, sampling_of
from .express_output import Feed, LogprobOut, collect, relay
from .native import NativeLane

__all__ = ["SAMPLING_KEYS", "ExpressLane", "NodeBusy", "check_express_supported", "sampling_of"]

log = logging.getLogger("expresslane.router.express")

def _label(text: str) -> str:
    """A short metric-safe label from a free-form reason (`too_long: 9000 > 4096` -> `too_long`)."""
    head = text.split(":", 1)[0].strip().lower()
    return "".join(c if c.isalnum() or c == "_" else "_" for c in head)[:40] or "failed"


# Request fields vLLM checks in its engine's input processor (SamplingParams.verify: max_logprobs,
# prompt_logprobs): a streamed request to a vLLM server learns of those refusals as an error event inside a
# 200 stream, not as a 400. The express prefill leg is not streamed, so its 400 is relayed the way vLLM would
# have streamed it (the native lane's decode server does so itself).
_ENGINE_CHECKED_PARAMS = frozenset({"logprobs", "prompt_logprobs"})


def _checked_by_vllm_engine(e: UpstreamRejected) -> bool:
    err = e.body().get("error")
    return e.stage == "prefill" and e.status == 400 and isinstance(err, dict) and err.get("param") in _ENGINE_CHECKED_PARAMS


def _in_stream_error(e: UpstreamRejected, record: RequestRecord) -> Response:
    async def events() -> AsyncIterator[bytes]:
        yield sse(e.body())
        yield SSE_DONE
        record.finish(e.status, 0)

    async def nothing() -> None:
        return None
    return ManagedStream(events(), on_close=nothing, record=record)


class PrefillLost(NodeFailed):
    """The prefill member died or hung during this request's prefill leg (after the request reached it)."""

    def __init__(self, member: str, detail: str) -> None:
        super().__init__("prefill_lost", detail)
        self.member = member


class ExpressLane:
    def __init__(self, ctx: LaneContext, pools: dict[str, ExpressPool], native: NativeLane,
                 model_text: ModelText | None):
        self.ctx = ctx
        self.pools = pools
        self.native = native
        self.model_text = model_text
        self.nodes = NodeClient(ctx)
        self.gates: dict[str, NodeGate[ExpressNode]] = {
            name: NodeGate(p.nodes, on_change=self._gauges(name), available=self._available(name),
                           on_gone=lambda n, name=name: log.warning("express node %s left pool %s (drained)",
                                                                     n.url, name))
            for name, p in pools.items()}
        if ctx.health is not None:
            ctx.health.on_change(lambda: [g.poke() for g in self.gates.values()])
        if ctx.membership is not None:  # DNS members come and go (discovery.py)
            ctx.membership.on_change(self._members_changed)
        self._max_model_len: int | None = ctx.config.max_model_len
        self._model_len_fetch: asyncio.Future | None = None
        self._token_strings: TokenStrings | None = None
        self.node_busy: Callable[[str], None] = lambda url: None  # (the app: CapabilityRouter.expire)

    def seats_changed(self, node: ExpressNode, seats: int) -> None:
        """A node's /capabilities told its seats (fleet/capabilities.py): its gate holds that many leases on it."""
        for gate in self.gates.values():
            if any(n is node for n in [*gate.nodes, *gate.draining]):
                gate.set_seats(node, seats)

    def _members_changed(self, pool: str, added: list[str], removed: list[str]) -> None:
        """An express pool's DNS answer changed: a new address is a new node of its gate (it takes requests once
        a health probe found it healthy: app._follow_members); a gone one is drained (its request, if any,
        finishes there; it is never reserved again)."""
        p, gate = self.pools.get(pool), self.gates.get(pool)
        if p is None or gate is None:
            return
        held = {n.url: n for n in [*gate.nodes, *gate.draining]}
        static = {n.url: n for n in p.nodes}
        for url in removed:
            if url in held:
                gate.remove(held[url])
        for url in added:
            gate.add(held.get(url) or static.get(url) or p.dns_node(url))

    def _available(self, pool: str):
        return lambda n: self.ctx.available(pool, n.url)

    def _gauges(self, pool: str):
        m = self.ctx.metrics

        def update(gate: NodeGate[ExpressNode]) -> None:
            m.queue_depth.labels(pool).set(gate.waiting)
            m.seats_total.labels(pool).set(gate.seats_total)
            m.seats_busy.labels(pool).set(gate.busy_count)
            for n in gate.nodes:
                m.inflight.labels(pool, node_label(n.url)).set(gate.busy_seats(n))
        return update

    # ---- admission -----------------------------------------------------------------------------
    async def handle(self, req: ClientRequest, pool: str, record: RequestRecord, queue: QueueConfig) -> Response:
        check_express_supported(req.body, self.pools[pool].kind, tool_parser=self.ctx.config.tool_call_parser)
        if self._max_model_len is None:
            self.native.require_prefill_up()  # a prefill known down: its typed 503 before asking it anything
        check_requested(req.opts, await self._model_len())  # vLLM's limit, before any work
        if self.model_text is None:
            raise RouterError("express lane has no tokenizer loaded (tokenizer_dir)")
        deadline = self.ctx.deadline(record)
        gate, busy_retries = self.gates[pool], self.pools[pool].busy_retries
        busy = failed = 0
        lost_on: tuple[str, ...] = ()  # prefill members this request lost a leg on: not tried again for it
        while True:
            try:
                lease = await gate.acquire(max_waiting=queue.max_waiting,
                                           max_wait_s=max(0.0, min(queue.max_wait_s, deadline.left())))
            except (QueueFull, QueueTimeout) as e:
                return await self._when_full(req, pool, queue, e.reason, str(e), record)
            except NoHealthyNode as e:
                return await self._failover(req, pool, queue, e.reason, str(e), record)
            self.ctx.metrics.queue_wait.labels("express").observe(lease.waited_s)
            try:
                return await self._serve(req, pool, lease, record, deadline, lost_on)
            except UpstreamRejected as e:
                if req.stream and _checked_by_vllm_engine(e):
                    return _in_stream_error(e, record)
                raise
            except NodeBusy:
                busy += 1
                log.info("express node %s busy (attempt %d)", lease.node.url, busy)
                self.node_busy(lease.node.url)  # every seat held there while the router counted one free: ask again
                if busy > busy_retries:
                    return await self._when_full(req, pool, queue, "node_busy",
                                                 f"express nodes stayed busy after {busy} tries", record)
                await asyncio.sleep(min(0.05 * busy, 0.5))
            except PrefillLost as e:  # the node was released; a new attempt reserves it again for another member
                lost_on += (e.member,)
                log.warning("express request: %s (attempt %d)", e.detail, len(lost_on))
                if self.ctx.prefills.available(lost_on):  # type: ignore[union-attr]
                    continue
                return await self._failover(req, pool, queue, e.reason, e.detail, record)
            except NodeFailed as e:
                self.ctx.metrics.upstream_errors.labels("express", STAGE, e.reason).inc()
                log.warning("express node %s cannot serve a request: %s (%s)", lease.node.url, e.reason, e.detail)
                failed += 1
                if e.before_prefill and failed < len(gate.nodes) and gate.any_available:
                    continue  # nothing spent yet: another healthy node of the pool may take it
                return await self._failover(req, pool, queue, e.reason, e.detail, record)

    async def _when_full(self, req: ClientRequest, pool: str, queue: QueueConfig, reason: str, why: str,
                         record: RequestRecord) -> Response:
        m = self.ctx.metrics
        if queue.when_full == "spill" and queue.spill_to:
            m.spillover.labels(pool, queue.spill_to).inc()
            record.lane = "native"
            return await self.native.handle(req, queue.spill_to, record)
        m.rejected.labels(pool, reason).inc()
        raise LaneBusy(f"the express lane is busy ({why}); retry later or send 'X-Lane: native'",
                       retry_after_s=queue.retry_after_s, reason=reason)

    async def _failover(self, req: ClientRequest, pool: str, queue: QueueConfig, reason: str, why: str,
                        record: RequestRecord) -> Response:
        """No express node can serve this request before its first token: the alias's policy decides."""
        if queue.when_full == "spill" and queue.spill_to:
            self.ctx.metrics.failovers.labels(req.alias, "express", "native", reason).inc()
            record.lane = "native"
            return await self.native.handle(req, queue.spill_to, record)
        ra = self.ctx.config.resilience.unavailable_retry_after_s
        raise UpstreamUnavailable(f"the express lane cannot serve this request now ({reason}: {why}); retry later "
                                  "or send 'X-Lane: native'", stage=STAGE, kind=reason,
                                  code="express_lane_unavailable", headers={"retry-after": str(ra)})

    def _failover_pool(self, alias: str, pool: str) -> str | None:
        """Where a mid-stream failover continues: the alias's spill target, else the default native pool."""
        q = self.ctx.config.queue_for(alias, pool)
        return q.spill_to or self.ctx.config.lane_pool("native")

    # ---- one attempt on one node ------------------------------------------------------------------
    async def _serve(self, req: ClientRequest, pool: str, lease: Lease[ExpressNode], record: RequestRecord,
                     deadline: Deadline, lost_on: tuple[str, ...] = ()) -> Response:
        leg = Leg(node=lease.node, kind=self.pools[pool].kind, rid=uuid.uuid4().hex)
        stack = contextlib.AsyncExitStack()
        stack.push_async_callback(self._let_go, leg, lease)
        async with closing_on_error(stack):
            if leg.kind == "expresslane":
                await self.nodes.reserve(leg, deadline)
            await self._prefill(req, leg, deadline, lost_on)
            res = self.ctx.config.resilience
            tokens: NodeTokens | None = None
            if not (req.stream and res.first_token_at_once and res.midstream_failover_for(req.alias)):
                tokens = await self.nodes.open_decode(leg, self._decode_body(req, leg), deadline)
                stack.push_async_callback(tokens.aclose)
        asm = self._assembler(req, leg)
        feed = Feed(self._logprob_out(req))
        batches = self._batches(req, pool, leg, tokens, asm, feed, stack, deadline)
        if req.stream:
            return ManagedStream(relay(req, leg, asm, feed, batches, stack, record), on_close=stack.aclose,
                                 record=record)
        return await collect(req, leg, asm, feed, batches, stack, record)

    async def _let_go(self, leg: Leg, lease: Lease[ExpressNode]) -> None:
        """Cancel the rid on the node unless it finished on its own, then release the node. A node known
        down is released at once and its cancel runs in the background (it may hang until cancel_s)."""
        if leg.settled:
            lease.release()
            return
        if not self.ctx.healthy(leg.node.url):
            lease.release()
            self.ctx.background(self.nodes.cancel_unless_settled(leg))
            return
        try:
            await self.nodes.cancel_unless_settled(leg)
        finally:
            lease.release()

    async def _prefill(self, req: ClientRequest, leg: Leg, deadline: Deadline, lost_on: tuple[str, ...] = ()) -> None:
        ctx, cfg = self.ctx, self.ctx.config
        node = leg.node
        if leg.kind == "tilert":
            marker = {"tilert_host": node.ctrl_host, "tilert_ctrl_port": node.ctrl_port}
        else:
            marker = {"expresslane_host": node.ctrl_host, "expresslane_ctrl_port": node.ctrl_port,
                      "expresslane_rid": leg.rid}
        body = express_prefill_body(req.body, cfg.prefill.model, chat=req.kind == "chat", kv_transfer_params=marker)
        self.native.require_prefill_up()

        async def attempt(url: str) -> dict[str, Any]:  # on one member of the prefill pool (fleet/pools.py)
            try:
                out = await ctx.calls.post_json(url + req.path, body, stage="prefill", headers=ctx.headers("vllm"),
                                                timeout=ctx.timeout(deadline.timeout_for(cfg.timeouts.prefill_s,
                                                                                         stage="prefill")))
            except RouterError as e:
                count_upstream_error(ctx, "express", e)
                ctx.report_error(url, e)
                if isinstance(e, UpstreamError) and e.kind != "connect" and classify(e.kind) is not None:
                    # the member failed as a node does and may have begun the handoff under this rid: start over
                    raise PrefillLost(url, f"prefill {url} failed mid-leg: {e.message}") from None
                raise
            ctx.report_success(url)
            return out

        # A member that refused the connection never saw the rid: the next member prefills for the same reservation.
        pre = await ctx.prefills.run(req.body, attempt,  # type: ignore[union-attr]
                                     retry=lambda e: isinstance(e, UpstreamError) and e.kind == "connect",
                                     exclude=lost_on)
        kvp = pre.get("kv_transfer_params")
        if leg.kind == "expresslane" and isinstance(kvp, dict) and kvp.get("expresslane_status") == "failed":
            err = str(kvp.get("expresslane_error") or "failed")
            raise NodeFailed("prefill_" + _label(err), f"the prefill could not hand the KV to {node.name}: {err}")
        leg.response_id = pre.get("id") if isinstance(pre.get("id"), str) else f"cmpl-{leg.rid}"
        if leg.kind == "tilert":
            leg.rid = derive_tilert_rid(leg.response_id)
        leg.n_prompt = prompt_tokens(pre)
        # vLLM's budget and min_tokens check; a refusal here cancels the node's reservation (closing_on_error)
        leg.max_tokens = effective_max_tokens(req.opts, await self._model_len(), leg.n_prompt,
                                              self.model_text.default_max_tokens if self.model_text else None)
        leg.first_token_id = first_token_id(pre, chat=req.kind == "chat")
        leg.prompt_ids = prompt_token_ids(pre)
        leg.constrained = node_structured_outputs(req.body, chat=req.kind == "chat",
                                                  tool_parser=cfg.tool_call_parser) is not None
        if req.opts.logprobs_k is not None:
            leg.first_lp = from_prefill(pre, leg.first_token_id, chat=req.kind == "chat")
            leg.positions = []

    def pools_kind(self, node: ExpressNode) -> str:
        for p in self.pools.values():
            if any(n is node for n in p.nodes):
                return p.kind
        raise KeyError(node.url)

    async def _model_len(self) -> int:
        """max_model_len: the config's, else asked from the prefill's /v1/models by ONE call that every request
        arriving meanwhile waits for (a burst on a fresh router once sent one GET per request to a busy prefill,
        and 69 of 128 express requests got its timeout as a 504); a failed call is tried again by the next request."""
        if self._max_model_len is None:
            fetch = self._model_len_fetch
            if fetch is None or (fetch.done() and (fetch.cancelled() or fetch.exception() is not None)):
                fetch = self._model_len_fetch = asyncio.ensure_future(self._fetch_model_len())
            await asyncio.shield(fetch)  # a client that leaves does not cancel the others' fetch
        return self._max_model_len

    async def _fetch_model_len(self) -> None:
        cfg = self.ctx.config
        models = await self.ctx.prefills.run(  # type: ignore[union-attr]  # a serving member, as a side call
            {}, lambda url: post_free_get(self.ctx, url + "/v1/models"), retry=member_failed, leg=False)
        for m in models.get("data") or []:
            if isinstance(m, dict) and m.get("id") == cfg.prefill.model and isinstance(m.get("max_model_len"), int):
                self._max_model_len = m["max_model_len"]
        if self._max_model_len is None:
            raise UpstreamError(f"cannot learn max_model_len of {cfg.prefill.model!r} from the prefill's "
                                "/v1/models; set max_model_len in the router config", stage="prefill")

    async def prefetch_model_len(self) -> None:
        """At start: learn max_model_len before the first request needs it (a failure is left to the requests)."""
        if self._max_model_len is None:
            try:
                await self._model_len()
            except RouterError as e:
                log.warning("max_model_len not learned at start (%s); the first express request asks again", e)

    def _decode_body(self, req: ClientRequest, leg: Leg) -> dict[str, Any]:
        sampling = sampling_of(req.body, self.model_text.generation_defaults if self.model_text else {}, leg.kind)
        body = {"rid": leg.rid, "first_token_id": leg.first_token_id, "max_tokens": leg.max_tokens,
                "sampling": sampling, "stream": True, "timeout_s": self.ctx.config.timeouts.kv_wait_s}
        if req.opts.logprobs_k is not None:
            body["top_logprobs"] = req.opts.logprobs_k
        if leg.kind == "expresslane":
            so = node_structured_outputs(req.body, chat=req.kind == "chat",
                                         tool_parser=self.ctx.config.tool_call_parser)
            if so is not None:
                body["structured_outputs"] = so
        if leg.kind == "expresslane" and leg.prompt_ids:
            # Our extension: a repetition penalty covers the prompt (as in vLLM), and the node's prompt-lookup
            # speculation drafts from it.
            body["prompt_token_ids"] = leg.prompt_ids
        return body

    def _logprob_out(self, req: ClientRequest) -> LogprobOut | None:
        k = req.opts.logprobs_k
        if k is None:
            return None
        if self._token_strings is None:
            assert self.model_text is not None
            self._token_strings = TokenStrings(self.model_text.tokenizer)
        as_ids = req.opts.return_tokens_as_token_ids
        if as_ids is None:
            as_ids = self.ctx.config.return_tokens_as_token_ids
        return LogprobOut(self._token_strings, k, req.kind == "chat", bool(as_ids))

    def _assembler(self, req: ClientRequest, leg: Leg) -> OutputAssembler:
        mt = self.model_text
        assert mt is not None
        o = req.opts  # skip_special_tokens is already false with tools (vLLM's hermes parser: request.py)
        detok = IncrementalDetokenizer(mt.tokenizer, leg.prompt_ids, skip_special_tokens=o.skip_special_tokens)
        return OutputAssembler(detok, max_tokens=leg.max_tokens, stop=o.stop, stop_token_ids=o.stop_token_ids,
                               eos_token_ids=mt.eos_token_ids, ignore_eos=o.ignore_eos, min_tokens=o.min_tokens,
                               include_stop_str_in_output=o.include_stop_str_in_output)

    # ---- the answer's tokens: the node's, then (mid-stream failover) the native lane's ----------------
    async def _open_after_first(self, req: ClientRequest, leg: Leg, stack: contextlib.AsyncExitStack,
                                deadline: Deadline) -> NodeTokens:
        """open_decode once the prefill's first token is already with the client: any failure is mid-stream."""
        try:
            tokens = await self.nodes.open_decode(leg, self._decode_body(req, leg), deadline)
        except (NodeFailed, NodeBusy) as e:
            reason = e.reason if isinstance(e, NodeFailed) else "node_busy"
            raise UpstreamError(f"express node {leg.node.name} could not take over after the first token: "
                                f"{reason}: {e}", stage=STAGE, kind=reason) from None
        stack.push_async_callback(tokens.aclose)
        return tokens

    def _first_position(self, leg: Leg) -> Position:
        if leg.first_lp is None:
            raise UpstreamError("the prefill reply carries no logprobs for the first token", stage="prefill",
                                kind="no_logprobs")
        return leg.first_lp

    def _note_logprobs(self, leg: Leg, ids: list[int], batch_lp: tuple[Any, Any], dropped: int) -> None:
        """One Position per id of a node batch (`dropped` leading ids were already accounted for)."""
        assert leg.positions is not None
        lp, tp = batch_lp
        if not isinstance(lp, list) or len(lp) != len(ids) or (tp is not None and (
                not isinstance(tp, list) or len(tp) != len(ids))):
            raise UpstreamError(f"express node {leg.node.name} sent no lp/tp arrays for its tokens (logprobs were "
                                "asked for)", stage=STAGE, kind="no_logprobs")
        for j in range(dropped, len(ids)):
            if lp[j] is None:  # the first token: its logprobs come from the prefill (docs/api.md, the node's `lp`)
                if leg.positions or ids[j] != leg.first_token_id:
                    raise UpstreamError(f"express node {leg.node.name} sent a null logprob for token {ids[j]}",
                                        stage=STAGE, kind="no_logprobs")
                leg.positions.append(self._first_position(leg))
            else:
                leg.positions.append(from_node(ids[j], lp[j], tp[j] if tp is not None else None))

    async def _batches(self, req: ClientRequest, pool: str, leg: Leg, tokens: NodeTokens | None,
                       asm: OutputAssembler, feed: Feed, stack: contextlib.AsyncExitStack,
                       deadline: Deadline) -> AsyncIterator[list[int]]:
        try:
            skip_first = False
            if tokens is None:  # first token at once: the prefill's token now, the node's stream after it
                if leg.positions is not None:
                    leg.positions.append(self._first_position(leg))
                yield [leg.first_token_id]
                if asm.finished:
                    return  # the first token was the whole answer: the node's rid is cancelled on close
                tokens = await self._open_after_first(req, leg, stack, deadline)
                skip_first = True
            async with contextlib.aclosing(tokens.batches()) as node_batches:
                async for ids in node_batches:
                    dropped = 0
                    if skip_first:  # the node's stream starts with the first token, already sent
                        skip_first = False
                        if ids[0] != leg.first_token_id:
                            raise UpstreamError(f"express node {leg.node.name} did not start from the first token "
                                                f"({ids[0]} != {leg.first_token_id})", stage=STAGE)
                        dropped = 1
                    if leg.positions is not None:
                        self._note_logprobs(leg, ids, tokens.batch_lp, dropped)
                    ids = ids[dropped:]
                    if ids:
                        yield ids
            feed.finish_reason = tokens.finish_reason
            return
        except UpstreamError as e:
            count_upstream_error(self.ctx, "express", e)
            self.ctx.report_error(leg.node.url, e)
            if asm.finished or len(asm.token_ids) >= leg.max_tokens:
                return  # every token is in: nothing to continue
            target = self._failover_pool(req.alias, pool)
            if (not self.ctx.config.resilience.midstream_failover_for(req.alias) or target is None
                    or not leg.prompt_ids or leg.positions is not None or leg.constrained):
                # a native continuation carries no logprobs, and cannot resume a grammar mid-way
                self.ctx.metrics.midstream_failovers.labels(pool, "disabled").inc()
                raise
            failure = e
        log.warning("express node %s failed after %d tokens (%s): continuing rid %s on native pool %s",
                    leg.node.url, len(asm.token_ids), failure.kind, leg.rid, target)
        self.ctx.background(stack.pop_all().aclose())  # cancel + release the node; the client's stream goes on
        feed.failed_over = True
        cont = Continuation(self.native, target)
        outcome = "failed"
        done = len(asm.token_ids)
        started = time.monotonic()
        try:
            async with contextlib.aclosing(cont.tokens(req.body, req.opts, leg.prompt_ids + asm.token_ids,
                                                       leg.max_tokens - done, done, deadline)) as native_batches:
                async for ids in native_batches:
                    yield ids
            outcome = "ok"
            feed.finish_reason = cont.finish_reason
        except GeneratorExit:
            outcome = "ok" if asm.finished else "client_gone"  # a stop rule ended the answer, or the client left
            raise
        except RouterError as e2:
            log.warning("the mid-stream failover of rid %s to native pool %s failed after %.2fs (%d tokens were in): "
                        "%s", leg.rid, target, time.monotonic() - started, done, e2.message)
            raise UpstreamError(f"{failure.message}; the mid-stream failover to the native lane failed too: "
                                f"{e2.message}", stage=STAGE, kind="failover_failed") from None
        finally:
            self.ctx.metrics.midstream_failovers.labels(pool, outcome).inc()

async def post_free_get(ctx: LaneContext, url: str) -> dict[str, Any]:
    try:
        resp = await ctx.client.get(url, headers=ctx.headers("vllm"),
                                    timeout=ctx.timeout(ctx.config.timeouts.connect_s))
    except httpx.HTTPError as e:
        raise map_transport_error(e, stage="prefill", url=url) from None
    if not resp.is_success:
        raise UpstreamError(f"{url} answered {resp.status_code}", stage="prefill")
    return read_json(resp, stage="prefill")
