"""The express answer as the client sees it: token batches -> the OutputAssembler -> one OpenAI JSON reply
(`collect`) or vLLM-shaped SSE chunks (`relay`). The node is released (`stack`) before the tail is sent."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from ..openai.detokenizer import OutputAssembler
from ..errors import RouterError, UpstreamError
from ..json_codec import CompactJSONResponse
from ..openai.logprobs import TokenStrings, chat_logprobs, completion_logprobs
from ..metrics import RequestRecord
from ..openai.tools import HermesParser, chat_message_and_finish, stream_finish
from ..openai.shapes import (SSE_DONE, ClientRequest, chat_chunk, chat_response, completion_chunk,
                             completion_response, sse, usage_chunk)
from .base import shielded
from .express_node import Leg

__all__ = ["Feed", "collect", "relay"]


class Feed:
    """How the answer's token batches ended: the node's finish reason, or the native continuation's; and the
    logprobs shaper when the client asked for logprobs."""

    def __init__(self, logprobs: "LogprobOut | None" = None) -> None:
        self.finish_reason: str | None = None
        self.failed_over = False
        self.logprobs = logprobs


@dataclass
class LogprobOut:
    """Turns leg.positions into vLLM's logprobs objects, chunk by chunk (`take`: the tokens not sent yet)."""

    strings: TokenStrings
    k: int
    chat: bool
    as_ids: bool
    sent: int = 0
    offset: int = 0  # completions text_offset, continued across chunks

    def take(self, leg: Leg, asm: OutputAssembler) -> dict[str, Any]:
        n = len(asm.token_ids)
        positions = (leg.positions or [])[self.sent:n]
        if len(positions) != n - self.sent:
            raise UpstreamError(f"logprobs for {len(positions)} of {n - self.sent} tokens", stage="express_decode",
                                kind="no_logprobs")
        start, self.sent = self.sent, n
        if self.chat:
            return chat_logprobs(positions, asm.token_ids, start, self.k, self.strings, as_ids=self.as_ids)
        out = completion_logprobs(positions, asm.token_ids, start, self.k, self.strings, as_ids=self.as_ids,
                                  text_offset=self.offset)
        if out["tokens"]:
            self.offset = out["text_offset"][-1] + len(out["tokens"][-1])
        return out


async def collect(req: ClientRequest, leg: Leg, asm: OutputAssembler, feed: Feed,
                   batches: AsyncIterator[list[int]], stack: contextlib.AsyncExitStack,
                   record: RequestRecord) -> Response:
    try:
        async with contextlib.aclosing(batches) as it:
            async for ids in it:
                asm.push(ids)
                if asm.finished and asm.finish_reason != "length":
                    break
    finally:
        await shielded(stack.aclose())
    asm.finish(feed.finish_reason)
    n = len(asm.token_ids)
    record.finish(200, n)
    extra: dict[str, Any] = ({"token_ids": asm.token_ids, "prompt_token_ids": leg.prompt_ids}
                             if req.opts.return_token_ids else {})
    finish = asm.finish_reason
    if feed.logprobs is not None:
        extra["logprobs"] = feed.logprobs.take(leg, asm)
    if req.kind != "chat":
        return CompactJSONResponse(completion_response(leg.response_id, req.alias, asm.text, finish,
                                                       asm.stop_reason, leg.n_prompt, n, **extra))
    if req.opts.tools_active:
        extra["message"], finish = chat_message_and_finish(asm.text, req.opts.tool_choice, finish,
                                                           parallel_tool_calls=req.opts.parallel_tool_calls)
    return CompactJSONResponse(chat_response(leg.response_id, req.alias, asm.text, finish, asm.stop_reason,
                                             leg.n_prompt, n, **extra))

async def relay(req: ClientRequest, leg: Leg, asm: OutputAssembler, feed: Feed,
                 batches: AsyncIterator[list[int]], stack: contextlib.AsyncExitStack,
                 record: RequestRecord) -> AsyncIterator[bytes]:
    created, rid, model, chat = int(time.time()), leg.response_id, req.alias, req.kind == "chat"
    tools = HermesParser() if req.opts.tools_active else None
    single = req.opts.parallel_tool_calls is False

    def piece(text: str, finish: str | None = None, stop_reason: Any = None) -> bytes | None:
        lp = feed.logprobs.take(leg, asm) if feed.logprobs is not None else None
        if not chat:
            if not text and finish is None and not (lp and lp["tokens"]):
                return None
            return sse(completion_chunk(rid, model, created, text, finish, stop_reason, logprobs=lp))
        if tools is None:
            if not text and finish is None and not (lp and lp["content"]):
                return None
            return sse(chat_chunk(rid, model, created, {"content": text}, finish, stop_reason, logprobs=lp))
        delta = tools.delta(asm.text[:sent[0] + len(text)]) if (text or finish) else None
        sent[0] += len(text)
        if delta is not None and single and "tool_calls" in delta:  # vLLM: maybe_filter_parallel_tool_calls
            delta["tool_calls"] = [d for d in delta["tool_calls"] if d["index"] == 0]
            if not delta["tool_calls"]:
                del delta["tool_calls"]
        if finish is None:
            if delta is None and not (lp and lp["content"]):
                return None
            return sse(chat_chunk(rid, model, created, delta or {}, logprobs=lp))
        return sse(chat_chunk(rid, model, created, delta or {}, stream_finish(tools, req.opts.tool_choice, finish), stop_reason,
                              logprobs=lp))

    sent = [0]  # characters of asm.text handed to the tool parser

    if chat:
        yield sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
    try:
        async with contextlib.aclosing(batches) as it:
            async for ids in it:
                text = asm.push(ids)
                if (chunk := piece(text)) is not None:
                    record.token_chunk()
                    yield chunk
                if asm.finished and asm.finish_reason != "length":
                    break  # stop string / stop id / EOS seen here: cancel the node below
    except RouterError as e:
        await stack.aclose()
        yield sse(e.body())
        yield SSE_DONE
        record.finish(e.status, len(asm.token_ids))
        return
    await stack.aclose()  # cancel (if we stopped early) and release the node before the tail is sent
    tail = asm.finish(feed.finish_reason)
    n = len(asm.token_ids)
    if tail:
        record.token_chunk()
    last = piece(tail, asm.finish_reason, asm.stop_reason)
    assert last is not None
    yield last
    if req.include_usage:
        yield sse(usage_chunk(req.kind, rid, model, created, leg.n_prompt, n))
    yield SSE_DONE
    record.finish(200, n)
