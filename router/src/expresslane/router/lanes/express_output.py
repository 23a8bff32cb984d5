"""The express answer as the client sees it: token batches -> the OutputAssembler -> one OpenAI JSON reply
(`collect`) or vLLM-shaped SSE chunks (`relay`). The node is released (`stack`) before the tail is sent."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response

from ..detokenizer import OutputAssembler
from ..errors import RouterError
from ..metrics import RequestRecord
from ..openai_shapes import (SSE_DONE, ClientRequest, chat_chunk, chat_response, completion_chunk,
                             completion_response, sse, usage_chunk)
from .base import shielded
from .express_node import Leg

__all__ = ["Feed", "collect", "relay"]


class Feed:
    """How the answer's token batches ended: the node's finish reason, or the native continuation's."""

    def __init__(self) -> None:
        self.finish_reason: str | None = None
        self.failed_over = False


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
    build = chat_response if req.kind == "chat" else completion_response
    extra = {"token_ids": asm.token_ids, "prompt_token_ids": leg.prompt_ids} if req.body.get(
        "return_token_ids") else {}
    return JSONResponse(build(leg.response_id, req.alias, asm.text, asm.finish_reason, asm.stop_reason,
                              leg.n_prompt, n, **extra))

async def relay(req: ClientRequest, leg: Leg, asm: OutputAssembler, feed: Feed,
                 batches: AsyncIterator[list[int]], stack: contextlib.AsyncExitStack,
                 record: RequestRecord) -> AsyncIterator[bytes]:
    created, rid, model, chat = int(time.time()), leg.response_id, req.alias, req.kind == "chat"

    def piece(text: str, finish: str | None = None, stop_reason: Any = None) -> bytes:
        if chat:
            return sse(chat_chunk(rid, model, created, {"content": text}, finish, stop_reason))
        return sse(completion_chunk(rid, model, created, text, finish, stop_reason))

    if chat:
        yield sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
    try:
        async with contextlib.aclosing(batches) as it:
            async for ids in it:
                text = asm.push(ids)
                if text:
                    record.token_chunk()
                    yield piece(text)
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
    yield piece(tail, asm.finish_reason, asm.stop_reason)
    if req.include_usage:
        yield sse(usage_chunk(req.kind, rid, model, created, leg.n_prompt, n))
    yield SSE_DONE
    record.finish(200, n)
