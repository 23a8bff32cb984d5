"""OpenAI request checks and response/chunk shapes (as vLLM writes them), plus SSE framing.

Validation is light on purpose: the router rejects what it must understand itself (JSON object,
`model`, `stream`, `max_tokens`, `n`, `stop`, prompt/messages shape); everything else is vLLM's to
judge, and vLLM's 4xx reaches the client unchanged.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import BadRequest, VllmValidation
from ..server.limits import loads_object
from .request import RequestOptions, options_of

__all__ = [
    "ClientRequest",
    "SSE_DONE",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "iter_sse_data",
    "parse_request",
    "sse",
    "usage_chunk",
]

Kind = Literal["chat", "completion"]
SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class ClientRequest:
    kind: Kind
    body: dict[str, Any]
    alias: str
    stream: bool
    include_usage: bool
    opts: RequestOptions  # the typed view every lane and leg reads (request.py); `body` travels to vLLM

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"

    @property
    def max_tokens(self) -> int | None:
        return self.opts.requested_max_tokens

    def stop_strings(self) -> list[str]:
        return list(self.opts.stop)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_INT = {int}


def _all_ints(items: list) -> bool:
    """Every item an int and none a bool, for a non-empty list parsed from JSON (which makes no other int
    types): one pass in C (a token-id prompt is thousands of items)."""
    return set(map(type, items)) == _INT


def parse_request(raw: bytes, kind: Kind, *, max_depth: int = 64) -> ClientRequest:
    body = loads_object(raw, max_depth)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    for key in ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",):
        v = body.get(key)
        if v is None:
            continue
        if not _is_int(v):
            raise BadRequest(f"'{key}' must be an integer, got {json.dumps(v)}", param=key)
        if v <= 0:  # vLLM 0.32's words (SamplingParams names max_tokens for max_completion_tokens too)
            raise VllmValidation(f"max_tokens must be at least 1, got {v}.", param="max_tokens", value=v)
    for key in ("n", "best_of"):
        v = body.get(key)
        if v is not None and (not _is_int(v) or v != 1):
            raise BadRequest(f"'{key}' must be 1: disaggregated serving returns one choice per request", param=key)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest("'stop' must be a string or a list of strings", param="stop")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    if opts and not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise BadRequest("'messages' must be a non-empty list of message objects", param="messages")
    else:
        _check_prompt(body.get("prompt"))
    return ClientRequest(kind=kind, body=body, alias=model, stream=stream,
                         include_usage=bool(stream and opts and opts.get("include_usage")),
                         opts=options_of(body, kind == "chat"))


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if _all_ints(prompt):
            return
        if len(prompt) == 1 and (isinstance(prompt[0], str) or (
                isinstance(prompt[0], list) and (not prompt[0] or _all_ints(prompt[0])))):
            return
        raise BadRequest("'prompt' must be one prompt (a string or a list of token ids); batches are not supported",
                         param="prompt")
    raise BadRequest("'prompt' is required: a string or a list of token ids", param="prompt")


# ---- responses and chunks (vLLM's shapes) ---------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None,
            "completion_tokens_details": None}


def completion_response(rid: str, model: str, text: str, finish_reason: str, stop_reason: Any,
                        prompt_tokens: int, completion_tokens: int, *, token_ids: list[int] | None = None,
                        prompt_token_ids: list[int] | None = None, created: int | None = None,
                        logprobs: dict | None = None) -> dict:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                              "stop_reason": stop_reason, "prompt_logprobs": None}
    if token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": created or int(time.time()), "model": model,
            "choices": [choice], "usage": usage(prompt_tokens, completion_tokens), "system_fingerprint": None,
            "kv_transfer_params": None}


def chat_response(rid: str, model: str, text: str, finish_reason: str, stop_reason: Any,
                  prompt_tokens: int, completion_tokens: int, *, token_ids: list[int] | None = None,
                  prompt_token_ids: list[int] | None = None, created: int | None = None,
                  message: dict | None = None, logprobs: dict | None = None) -> dict:
    """`message` overrides message fields (tools.chat_message_and_finish: content, tool_calls)."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                    "function_call": None, "tool_calls": [], "reasoning_content": None, **(message or {})},
        "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    out = {"id": rid, "object": "chat.completion", "created": created or int(time.time()), "model": model,
           "choices": [choice], "service_tier": None, "system_fingerprint": None,
           "usage": usage(prompt_tokens, completion_tokens), "prompt_logprobs": None,
           "kv_transfer_params": None}
    if token_ids is not None:
        out["prompt_token_ids"] = prompt_token_ids
    return out


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None,
               stop_reason: Any = None, *, token_ids: list[int] | None = None, logprobs: dict | None = None) -> dict:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None = None,
                     stop_reason: Any = None, *, token_ids: list[int] | None = None,
                     logprobs: dict | None = None) -> dict:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                              "stop_reason": stop_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def usage_chunk(kind: Kind, rid: str, model: str, created: int, prompt_tokens: int, completion_tokens: int) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


# ---- SSE ---------------------------------------------------------------------------------------

def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def iter_sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """Yield the `data:` payload of each SSE event (multi-line data joined with newlines)."""
    buf: list[str] = []
    async for line in lines:
        line = line.rstrip("\r")
        if not line:
            if buf:
                yield "\n".join(buf)
                buf = []
            continue
        if line.startswith(":"):
            continue
        if line.startswith("data:"):
            value = line[5:]
            buf.append(value[1:] if value.startswith(" ") else value)
    if buf:
        yield "\n".join(buf)
