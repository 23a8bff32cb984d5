"""One typed view of the client's request, parsed once (shapes.parse_request) and read by every lane and leg.

The raw body still travels to vLLM unchanged where vLLM is the one to judge it (the prefill legs, the native
decode leg); what the router itself acts on (stop rules, output budget, logprobs, tools, special tokens) is read
here once, with vLLM 0.32's defaults:
- `requested_max_tokens` / `max_tokens_param`: chat `max_completion_tokens`, else `max_tokens`; completions
  `max_tokens`, default 16 when absent (CompletionRequest); explicit null = no limit (the context decides);
- `logprobs_k`: chat `top_logprobs` when `logprobs` is true (0 when unset), completions `logprobs`; None = none;
- `tool_choice`: `auto` when tools are given without one, `none` without tools (ChatCompletionRequest);
- `skip_special_tokens`: false whenever tools are in play (the hermes parser's adjust_request), else the client's
  value (default true).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .tools import ToolChoice, tool_choice_of, tools_active

__all__ = ["COMPLETIONS_DEFAULT_MAX_TOKENS", "RequestOptions", "options_of"]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _int(v: Any, default: int = 0) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _list(v: Any) -> list:
    return v if isinstance(v, list) else []  # an odd type is vLLM's to refuse (the prefill leg carries it)


@dataclass(frozen=True)
class RequestOptions:
    chat: bool
    requested_max_tokens: int | None
    max_tokens_param: str
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    logprobs_k: int | None = None
    return_tokens_as_token_ids: bool | None = None
    tool_choice: ToolChoice = ToolChoice("none")
    tools_active: bool = False
    parallel_tool_calls: bool | None = None


def _logprobs_k(body: dict[str, Any], chat: bool) -> int | None:
    v = body.get("logprobs")
    if chat:
        return _int(body.get("top_logprobs")) if v is True else None
    return None if v is None or v is False else _int(v)


def options_of(body: dict[str, Any], chat: bool) -> RequestOptions:
    if chat and body.get("max_completion_tokens") is not None:
        requested, param = body["max_completion_tokens"], "max_completion_tokens"
    elif chat:
        requested, param = body.get("max_tokens"), "max_tokens"
    else:
        requested, param = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS), "max_tokens"
    stop = body.get("stop")
    tools = chat and tools_active(body)
    rt = body.get("return_tokens_as_token_ids")
    ptc = body.get("parallel_tool_calls")
    return RequestOptions(
        chat=chat, requested_max_tokens=_int(requested, None) if requested is not None else None,  # type: ignore[arg-type]
        max_tokens_param=param,
        stop=(stop,) if isinstance(stop, str) else tuple(s for s in _list(stop) if isinstance(s, str)),
        stop_token_ids=tuple(t for t in _list(body.get("stop_token_ids")) if _int(t, -1) >= 0),
        min_tokens=_int(body.get("min_tokens")), ignore_eos=bool(body.get("ignore_eos")),
        skip_special_tokens=body.get("skip_special_tokens", True) is not False and not tools,
        include_stop_str_in_output=bool(body.get("include_stop_str_in_output")),
        return_token_ids=bool(body.get("return_token_ids")), logprobs_k=_logprobs_k(body, chat),
        return_tokens_as_token_ids=rt if isinstance(rt, bool) else None,
        tool_choice=tool_choice_of(body) if chat else ToolChoice("none"), tools_active=tools,
        parallel_tool_calls=ptc if isinstance(ptc, bool) else None)
