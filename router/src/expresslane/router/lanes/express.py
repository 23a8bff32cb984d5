"""Express lane: stock vLLM prefill -> single-user decode node speaking TileRT's HTTP contract.

Per request:
1. Gate: take a free node of the pool (at most ONE request in flight per node), else wait in the
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
   the node's message; anything else -> 502. Options the pool's node kind cannot honour (logprobs,
   echo, guided decoding, ...; for TileRT also min_tokens, frequency_penalty) are refused with 400
   before any work. `kind: expresslane` nodes also get `prompt_token_ids` when a repetition penalty
   applies (so it covers the prompt, as in vLLM).
4. The node is released on every exit. If the router stops early (stop string, client gone, error)
   it first POSTs /pd/cancel {rid} (bounded by timeouts.cancel_s), then releases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.responses import JSONResponse, Response

from ..config import ExpressNode, ExpressPool, QueueConfig
from ..detokenizer import IncrementalDetokenizer, ModelText, OutputAssembler
from ..errors import BadRequest, LaneBusy, RouterError, UpstreamError, UpstreamTimeout, UpstreamUnavailable
from ..gate import Lease, NodeGate, QueueFull, QueueTimeout
from ..metrics import RequestRecord, node_label
from ..openai_shapes import (SSE_DONE, ClientRequest, chat_chunk, chat_response, completion_chunk,
                             completion_response, sse, usage_chunk)
from ..prefill import derive_tilert_rid, express_prefill_body, first_token_id, prompt_token_ids, prompt_tokens
from ..upstream import iter_lines, loads_line, map_transport_error, post_json, read_json
from .base import LaneContext, ManagedStream, closing_on_error, count_upstream_error
from .native import NativeLane

__all__ = ["ExpressLane", "NodeBusy", "check_express_supported", "sampling_of"]

log = logging.getLogger("expresslane.router.express")

# The /pd/decode `sampling` keys each node kind honours (our engine server: more than TileRT).
SAMPLING_KEYS = {
    "expresslane": ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "frequency_penalty",
                    "ignore_eos", "seed", "stop_token_ids", "min_tokens"),
    # TileRT refuses per-request stop_token_ids (its loop uses the model's stop set): the router enforces them.
    "tilert": ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "ignore_eos", "seed"),
}
STAGE = "express_decode"


class NodeBusy(Exception):
    """The node answered 429: another client holds it (e.g. a second router)."""


def _set(v: Any) -> bool:
    return v not in (None, False, 0, 0.0, "", [], {})


# Request fields an express decode node cannot honour: refused loudly instead of ignored.
_UNSUPPORTED = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "logit_bias", "min_p", "bad_words",
                "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                "allowed_token_ids")
_UNSUPPORTED_BY_KIND = {"expresslane": (), "tilert": ("min_tokens", "frequency_penalty")}


def check_express_supported(body: dict[str, Any], kind: str = "expresslane") -> None:
    for key in _UNSUPPORTED + _UNSUPPORTED_BY_KIND[kind]:
        if _set(body.get(key)):
            raise BadRequest(f"'{key}' is not supported on the express lane; send 'X-Lane: native' to use it",
                             param=key)
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        raise BadRequest("'response_format' is not supported on the express lane; send 'X-Lane: native'",
                         param="response_format")


def sampling_of(body: dict[str, Any], defaults: dict[str, Any], kind: str = "expresslane") -> dict[str, Any]:
    """The sampling block of /pd/decode: the client's values, vLLM's generation-config defaults otherwise."""
    out = {k: body[k] for k in SAMPLING_KEYS[kind] if body.get(k) is not None}
    for k, v in defaults.items():
        out.setdefault(k, v)
    return out


@dataclass
class _Leg:
    """What the prefill leg produced, plus the node call's state."""

    node: ExpressNode
    rid: str
    response_id: str
    first_token_id: int
    prompt_ids: list[int]
    n_prompt: int
    max_tokens: int
    settled: bool = False  # the node finished or refused on its own: no /pd/cancel needed


class ExpressLane:
    def __init__(self, ctx: LaneContext, pools: dict[str, ExpressPool], native: NativeLane,
                 model_text: ModelText | None):
        self.ctx = ctx
        self.pools = pools
        self.native = native
        self.model_text = model_text
        self.gates: dict[str, NodeGate[ExpressNode]] = {
            name: NodeGate(p.nodes, on_change=self._gauges(name), available=lambda n: ctx.healthy(n.url))
            for name, p in pools.items()}
        if ctx.health is not None:
            ctx.health.on_change(lambda: [g.poke() for g in self.gates.values()])
        self._max_model_len: int | None = ctx.config.max_model_len

    def _gauges(self, pool: str):
        m = self.ctx.metrics

        def update(gate: NodeGate[ExpressNode]) -> None:
            m.queue_depth.labels(pool).set(gate.waiting)
            for n in gate.nodes:
                m.inflight.labels(pool, node_label(n.url)).set(1 if gate.is_busy(n) else 0)
        return update

    # ---- admission -----------------------------------------------------------------------------
    async def handle(self, req: ClientRequest, pool: str, record: RequestRecord, queue: QueueConfig) -> Response:
        check_express_supported(req.body, self.pools[pool].kind)
        if self.model_text is None:
            raise RouterError("express lane has no tokenizer loaded (tokenizer_dir)")
        gate, busy_retries = self.gates[pool], self.pools[pool].busy_retries
        attempt = 0
        while True:
            try:
                lease = await gate.acquire(max_waiting=queue.max_waiting, max_wait_s=queue.max_wait_s)
            except (QueueFull, QueueTimeout) as e:
                return await self._when_full(req, pool, queue, e.reason, str(e), record)
            self.ctx.metrics.queue_wait.labels("express").observe(lease.waited_s)
            try:
                return await self._serve(req, lease, record)
            except NodeBusy:
                attempt += 1
                log.info("express node %s busy (attempt %d)", lease.node.url, attempt)
                if attempt > busy_retries:
                    return await self._when_full(req, pool, queue, "node_busy",
                                                 f"express nodes stayed busy after {attempt} tries", record)
                await asyncio.sleep(min(0.05 * attempt, 0.5))

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

    # ---- one attempt on one node ------------------------------------------------------------------
    async def _serve(self, req: ClientRequest, lease: Lease[ExpressNode], record: RequestRecord) -> Response:
        stack = contextlib.AsyncExitStack()
        stack.callback(lease.release)
        async with closing_on_error(stack):
            try:
                leg = await self._prefill(req, lease.node)
                stack.push_async_callback(self._cancel_unless_settled, leg)
                if req.stream:
                    resp = await self._open_decode(leg, req, stream=True)
                    stack.push_async_callback(resp.aclose)
                    return ManagedStream(self._relay(req, leg, resp, stack, record), on_close=stack.aclose,
                                         record=record)
                resp = await self._open_decode(leg, req, stream=False)
                reply = read_json(resp, stage=STAGE)
            except RouterError as e:
                count_upstream_error(self.ctx, "express", e)
                raise
        leg.settled = True
        await stack.aclose()
        asm = self._assembler(req, leg)
        ids = reply.get("token_ids")
        if not isinstance(ids, list):
            raise UpstreamError("express node reply has no token_ids", stage=STAGE)
        text = asm.push(ids)
        timing = reply.get("timing_ms") if isinstance(reply.get("timing_ms"), dict) else {}
        text += asm.finish(reply.get("finish_reason") or timing.get("finish_reason"))
        n = len(asm.token_ids)
        record.finish(200, n)
        build = chat_response if req.kind == "chat" else completion_response
        extra = {"token_ids": asm.token_ids, "prompt_token_ids": leg.prompt_ids} if req.body.get(
            "return_token_ids") else {}
        return JSONResponse(build(leg.response_id, req.alias, text, asm.finish_reason, asm.stop_reason,
                                  leg.n_prompt, n, **extra))

    async def _prefill(self, req: ClientRequest, node: ExpressNode) -> _Leg:
        ctx, cfg = self.ctx, self.ctx.config
        kind = self.pools_kind(node)
        rid = uuid.uuid4().hex
        if kind == "tilert":
            marker = {"tilert_host": node.ctrl_host, "tilert_ctrl_port": node.ctrl_port}
        else:
            marker = {"expresslane_host": node.ctrl_host, "expresslane_ctrl_port": node.ctrl_port,
                      "expresslane_rid": rid}
        body = express_prefill_body(req.body, cfg.prefill.model, chat=req.kind == "chat", kv_transfer_params=marker)
        pre = await post_json(ctx.client, cfg.prefill.url + req.path, body, stage="prefill",
                              timeout=ctx.timeout(cfg.timeouts.prefill_s))
        response_id = pre.get("id") if isinstance(pre.get("id"), str) else f"cmpl-{rid}"
        if kind == "tilert":
            rid = derive_tilert_rid(response_id)
        n_prompt = prompt_tokens(pre)
        max_tokens = req.max_tokens or await self._default_max_tokens(n_prompt)
        return _Leg(node=node, rid=rid, response_id=response_id, first_token_id=first_token_id(pre, chat=req.kind == "chat"),
                    prompt_ids=prompt_token_ids(pre), n_prompt=n_prompt, max_tokens=max_tokens)

    def pools_kind(self, node: ExpressNode) -> str:
        for p in self.pools.values():
            if any(n is node for n in p.nodes):
                return p.kind
        raise KeyError(node.url)

    async def _default_max_tokens(self, n_prompt: int) -> int:
        if self._max_model_len is None:
            cfg = self.ctx.config
            models = await post_free_get(self.ctx, cfg.prefill.url + "/v1/models")
            for m in models.get("data") or []:
                if isinstance(m, dict) and m.get("id") == cfg.prefill.model and isinstance(m.get("max_model_len"), int):
                    self._max_model_len = m["max_model_len"]
            if self._max_model_len is None:
                raise UpstreamError(f"cannot learn max_model_len of {cfg.prefill.model!r} from the prefill's "
                                    "/v1/models; set max_model_len in the router config", stage="prefill")
        return max(1, self._max_model_len - n_prompt)

    async def _open_decode(self, leg: _Leg, req: ClientRequest, *, stream: bool) -> httpx.Response:
        cfg = self.ctx.config
        kind = self.pools_kind(leg.node)
        sampling = sampling_of(req.body, self.model_text.generation_defaults if self.model_text else {}, kind)
        body = {"rid": leg.rid, "first_token_id": leg.first_token_id, "max_tokens": leg.max_tokens,
                "sampling": sampling, "stream": stream, "timeout_s": cfg.timeouts.kv_wait_s}
        if kind == "expresslane" and sampling.get("repetition_penalty", 1.0) != 1.0 and leg.prompt_ids:
            body["prompt_token_ids"] = leg.prompt_ids  # our extension: the penalty covers the prompt, like vLLM
        url = leg.node.url + "/pd/decode"
        timeout = httpx.Timeout(cfg.timeouts.decode_s + cfg.timeouts.kv_wait_s, connect=cfg.timeouts.connect_s)
        try:
            resp = await self.ctx.client.send(self.ctx.client.build_request("POST", url, json=body, timeout=timeout),
                                              stream=stream)
        except httpx.HTTPError as e:
            raise map_transport_error(e, stage=STAGE, url=url) from None
        if resp.is_success:
            return resp
        content = (await resp.aread())[:300].decode("utf-8", "replace")
        await resp.aclose()
        leg.settled = True
        if resp.status_code == 429:
            raise NodeBusy(content)
        if resp.status_code == 504:
            raise UpstreamTimeout(f"express node {leg.node.name}: the KV cache never arrived ({content})",
                                  stage=STAGE, kind="kv_timeout")
        if resp.status_code in (400, 422, 501):  # the node refuses a parameter it cannot honour
            self.ctx.metrics.upstream_errors.labels("express", STAGE, f"http_{resp.status_code}").inc()
            raise BadRequest(f"express node {leg.node.name} refused the request: {content}; "
                             "send 'X-Lane: native' to use the native lane")
        if resp.status_code == 503:
            raise UpstreamUnavailable(f"express node {leg.node.name} is unavailable: {content}", stage=STAGE,
                                      kind="http_503")
        raise UpstreamError(f"express node {leg.node.name} answered {resp.status_code}: {content}", stage=STAGE,
                            kind=f"http_{resp.status_code}")

    async def _cancel_unless_settled(self, leg: _Leg) -> None:
        if leg.settled:
            return
        leg.settled = True
        t = self.ctx.config.timeouts.cancel_s
        try:
            r = await self.ctx.client.post(leg.node.url + "/pd/cancel", json={"rid": leg.rid},
                                           timeout=httpx.Timeout(t, connect=min(t, self.ctx.config.timeouts.connect_s)))
            log.info("cancel %s on %s -> %d", leg.rid, leg.node.url, r.status_code)
        except httpx.HTTPError as e:
            log.warning("cancel %s on %s failed: %s", leg.rid, leg.node.url, e)

    def _assembler(self, req: ClientRequest, leg: _Leg) -> OutputAssembler:
        mt = self.model_text
        assert mt is not None
        b = req.body
        detok = IncrementalDetokenizer(mt.tokenizer, leg.prompt_ids,
                                       skip_special_tokens=b.get("skip_special_tokens", True) is not False)
        return OutputAssembler(detok, max_tokens=leg.max_tokens, stop=req.stop_strings(),
                               stop_token_ids=b.get("stop_token_ids") or (), eos_token_ids=mt.eos_token_ids,
                               ignore_eos=bool(b.get("ignore_eos")), min_tokens=int(b.get("min_tokens") or 0),
                               include_stop_str_in_output=bool(b.get("include_stop_str_in_output")))

    # ---- streaming ------------------------------------------------------------------------------
    async def _relay(self, req: ClientRequest, leg: _Leg, resp: httpx.Response, stack: contextlib.AsyncExitStack,
                     record: RequestRecord) -> AsyncIterator[bytes]:
        asm = self._assembler(req, leg)
        created, rid, model, chat = int(time.time()), leg.response_id, req.alias, req.kind == "chat"

        def piece(text: str, finish: str | None = None, stop_reason: Any = None) -> bytes:
            if chat:
                return sse(chat_chunk(rid, model, created, {"content": text}, finish, stop_reason))
            return sse(completion_chunk(rid, model, created, text, finish, stop_reason))

        if chat:
            yield sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
        node_reason: str | None = None
        try:
            done = False
            async for line in iter_lines(resp, stage=STAGE, url=leg.node.url):
                if not line.strip():
                    continue
                msg = loads_line(line, stage=STAGE)
                if "t" in msg:
                    text = asm.push(msg["t"] if isinstance(msg["t"], list) else [])
                    if text:
                        record.token_chunk()
                        yield piece(text)
                    if asm.finished and asm.finish_reason != "length":
                        break  # stop string / stop id / EOS seen here: cancel the node below
                elif msg.get("done"):
                    node_reason, done = msg.get("finish_reason"), True
                    break
                elif "error" in msg:
                    leg.settled = True
                    raise UpstreamError(f"express node {leg.node.name} failed mid-stream: {msg.get('error')}",
                                        stage=STAGE, kind="stream_error")
            if not done and not asm.finished:
                raise UpstreamError(f"express node {leg.node.name} ended the stream without a done line",
                                    stage=STAGE, kind="truncated")
            leg.settled = leg.settled or done
        except UpstreamError as e:
            count_upstream_error(self.ctx, "express", e)
            await stack.aclose()
            yield sse(e.body())
            yield SSE_DONE
            record.finish(e.status, len(asm.token_ids))
            return
        await stack.aclose()  # cancel (if we stopped early) and release the node before the tail is sent
        tail = asm.finish(node_reason)
        n = len(asm.token_ids)
        if tail:
            record.token_chunk()
        yield piece(tail, asm.finish_reason, asm.stop_reason)
        if req.include_usage:
            yield sse(usage_chunk(req.kind, rid, model, created, leg.n_prompt, n))
        yield SSE_DONE
        record.finish(200, n)


async def post_free_get(ctx: LaneContext, url: str) -> dict[str, Any]:
    try:
        resp = await ctx.client.get(url, timeout=ctx.timeout(ctx.config.timeouts.connect_s))
    except httpx.HTTPError as e:
        raise map_transport_error(e, stage="prefill", url=url) from None
    if not resp.is_success:
        raise UpstreamError(f"{url} answered {resp.status_code}", stage="prefill")
    return read_json(resp, stage="prefill")
