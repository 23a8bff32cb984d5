"""Native lane: prefill on the stock vLLM prefill server, decode on a stock vLLM NixlConnector node.

1. prefill leg (prefill.native_prefill_body): max_tokens=1, stream=false,
   kv_transfer_params={"do_remote_decode": true}; the reply's `kv_transfer_params` say where the KV is.
2. decode leg on the node with the fewest outstanding requests: the client's own body with `model`
   set to the served name and the returned `kv_transfer_params`. Streaming relays the node's SSE
   events, rewriting `model` to the alias; the router always asks for the usage chunk (to count
   tokens) and drops it again unless the client asked for it.
The response id is the decode's, the usage is the decode's with `prompt_tokens` from the prefill.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.responses import JSONResponse, Response

from ..config import NativePool
from ..errors import RouterError, UpstreamError
from ..metrics import RequestRecord, node_label
from ..openai_shapes import SSE_DONE, ClientRequest, iter_sse_data, sse
from ..prefill import native_prefill_body, prompt_tokens
from ..upstream import iter_lines, open_stream, post_json
from .base import LaneContext, ManagedStream, closing_on_error, count_upstream_error

__all__ = ["NativeLane", "decode_body", "fix_usage"]


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


class NativeLane:
    def __init__(self, ctx: LaneContext, pools: dict[str, NativePool]):
        self.ctx = ctx
        self.pools = pools
        self._outstanding: dict[tuple[str, str], int] = {
            (name, url): 0 for name, p in pools.items() for url in p.nodes}

    # ---- node choice -------------------------------------------------------------------------
    def pick_node(self, pool: str) -> str:
        return min(self.pools[pool].nodes, key=lambda url: self._outstanding[(pool, url)])

    def _track(self, pool: str, url: str, delta: int) -> None:
        key = (pool, url)
        self._outstanding[key] += delta
        self.ctx.metrics.inflight.labels(pool, node_label(url)).set(self._outstanding[key])

    # ---- orchestration ---------------------------------------------------------------------------
    async def handle(self, req: ClientRequest, pool: str, record: RequestRecord) -> Response:
        ctx = self.ctx
        cfg = ctx.config
        try:
            pre = await post_json(ctx.client, cfg.prefill.url + req.path,
                                  native_prefill_body(req.body, cfg.prefill.model),
                                  stage="prefill", timeout=ctx.timeout(cfg.timeouts.prefill_s))
            kvp = pre.get("kv_transfer_params")
            if not isinstance(kvp, dict):
                raise UpstreamError("prefill reply has no kv_transfer_params: is the prefill server started "
                                    "with a kv-transfer-config that includes NixlConnector?", stage="prefill")
            n_prompt = prompt_tokens(pre)
        except RouterError as e:
            count_upstream_error(ctx, "native", e)
            raise
        url = self.pick_node(pool)
        body = decode_body(req.body, cfg.native_model(pool), kvp, force_usage=True)
        if req.stream:
            return await self._stream(req, pool, url, body, n_prompt, record)
        self._track(pool, url, +1)
        try:
            out = await post_json(ctx.client, url + req.path, body, stage="decode",
                                  timeout=ctx.timeout(cfg.timeouts.decode_s))
        except RouterError as e:
            count_upstream_error(ctx, "native", e)
            raise
        finally:
            self._track(pool, url, -1)
        out["model"] = req.alias
        if "kv_transfer_params" in out:
            out["kv_transfer_params"] = None
        completion = fix_usage(out, n_prompt)
        record.finish(200, completion)
        return JSONResponse(out)

    async def _stream(self, req: ClientRequest, pool: str, url: str, body: dict[str, Any], n_prompt: int,
                      record: RequestRecord) -> Response:
        ctx = self.ctx
        stack = contextlib.AsyncExitStack()
        async with closing_on_error(stack):
            self._track(pool, url, +1)
            stack.callback(self._track, pool, url, -1)
            try:
                resp = await stack.enter_async_context(open_stream(
                    ctx.client, url + req.path, body, stage="decode", timeout=ctx.timeout(ctx.config.timeouts.decode_s)))
            except RouterError as e:
                count_upstream_error(ctx, "native", e)
                raise
        return ManagedStream(self._relay(req, resp, url, n_prompt, record), on_close=stack.aclose, record=record)

    async def _relay(self, req: ClientRequest, resp: httpx.Response, url: str, n_prompt: int,
                     record: RequestRecord) -> AsyncIterator[bytes]:
        completion = 0
        try:
            async for data in iter_sse_data(iter_lines(resp, stage="decode", url=url)):
                if data.strip() == "[DONE]":
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
        except UpstreamError as e:
            count_upstream_error(self.ctx, "native", e)
            yield sse(e.body())
            yield SSE_DONE
            record.finish(e.status, completion)
            return
        yield SSE_DONE
        record.finish(200, completion)
