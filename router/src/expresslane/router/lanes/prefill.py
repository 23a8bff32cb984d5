"""The prefill leg: body rewriting for a one-token prefill, and reading what the prefill returned.

A prefill leg is the client's own body (so the chat template, sampling and validation are vLLM's)
with these changes:
  model                      -> the prefill's served model
  max_tokens = 1, stream = false, max_completion_tokens dropped
  stream_options             dropped (vLLM rejects it without stream)
  stop, include_stop_str_in_output dropped (the one token's text is never shown)
  min_tokens                 dropped on the native lane; capped at 1 on the express lane (its first
                             token is the answer's first token, so EOS must stay masked for it)
  kv_transfer_params         the lane's own (a client-sent value is never forwarded)
Native lane additionally drops what only costs work on a discarded token: logprobs, top_logprobs,
prompt_logprobs, echo, return_token_ids. Express lane asks for `return_token_ids` (prompt and first
token ids) and logprobs (the `token_id:N` fallback of TileRT's contract): the client's own k when it asks for
logprobs (at least 1: the first token's logprobs entry is taken from this reply), else 1.
"""

from __future__ import annotations

from typing import Any

from ..errors import UpstreamError

__all__ = ["derive_tilert_rid", "express_prefill_body", "first_token_id", "native_prefill_body",
           "prompt_token_ids", "prompt_tokens"]

_ALWAYS_DROP = ("max_completion_tokens", "stream_options", "stop", "include_stop_str_in_output",
                "kv_transfer_params")
_NATIVE_DROP = ("min_tokens", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "return_token_ids")


def _base(body: dict[str, Any], model: str) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in _ALWAYS_DROP}
    out.update(model=model, max_tokens=1, stream=False)
    return out


def native_prefill_body(body: dict[str, Any], model: str) -> dict[str, Any]:
    out = _base(body, model)
    for k in _NATIVE_DROP:
        out.pop(k, None)
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def express_prefill_body(body: dict[str, Any], model: str, *, chat: bool,
                         kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    out = _base(body, model)
    for k in ("prompt_logprobs", "echo"):
        out.pop(k, None)
    if out.get("min_tokens"):
        out["min_tokens"] = 1  # the first token is the answer's: EOS/stop ids stay masked for it
    else:
        out.pop("min_tokens", None)
    out["return_token_ids"] = True
    if chat:
        if out.get("logprobs") is True:  # the client's k, at least 1 (its first token's entry comes from here)
            out["top_logprobs"] = max(int(out.get("top_logprobs") or 0), 1)
        elif not out.get("top_logprobs"):  # (top_logprobs without logprobs: left for vLLM's own 400)
            out["logprobs"] = True
            out["top_logprobs"] = 1
    else:
        v = out.get("logprobs")
        out["logprobs"] = max(v, 1) if isinstance(v, int) and not isinstance(v, bool) else 1 if v is None else v
    out["kv_transfer_params"] = dict(kv_transfer_params)
    return out


def _choice(resp: dict[str, Any]) -> dict[str, Any]:
    choices = resp.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise UpstreamError("prefill reply has no choices", stage="prefill")
    return choices[0]


def _token_id(tok: Any) -> int | None:
    if isinstance(tok, str) and tok.startswith("token_id:"):
        try:
            return int(tok.split(":", 1)[1])
        except ValueError:
            return None
    return None


def first_token_id(resp: dict[str, Any], *, chat: bool) -> int:
    """The token the prefill sampled: `token_ids[0]` (return_token_ids), else the logprobs' `token_id:N`."""
    choice = _choice(resp)
    ids = choice.get("token_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], int):
        return ids[0]
    lp = choice.get("logprobs") or {}
    tok = None
    if chat:
        content = lp.get("content") or []
        tok = content[0].get("token") if content and isinstance(content[0], dict) else None
    else:
        toks = lp.get("tokens") or []
        tok = toks[0] if toks else None
    tid = _token_id(tok)
    if tid is None:
        raise UpstreamError(
            "prefill reply carries no first token id: vLLM must accept return_token_ids, or run with "
            f"--return-tokens-as-token-ids (got logprobs token {tok!r})", stage="prefill")
    return tid


def prompt_token_ids(resp: dict[str, Any]) -> list[int]:
    """vLLM puts them on the response (chat) or on the choice (completions)."""
    ids = resp.get("prompt_token_ids")
    if not isinstance(ids, list):
        ids = _choice(resp).get("prompt_token_ids")
    return [t for t in ids if isinstance(t, int)] if isinstance(ids, list) else []


def prompt_tokens(resp: dict[str, Any]) -> int:
    u = resp.get("usage")
    if isinstance(u, dict) and isinstance(u.get("prompt_tokens"), int):
        return u["prompt_tokens"]
    ids = prompt_token_ids(resp)
    if ids:
        return len(ids)
    raise UpstreamError("prefill reply has no usage.prompt_tokens", stage="prefill")


def derive_tilert_rid(response_id: str) -> str:
    """TileRT's rule: strip `chatcmpl-`/`cmpl-`, then a trailing `-<hex, <=8>`, then `-<digits, <=3>`."""
    rid = response_id
    for prefix in ("chatcmpl-", "cmpl-"):
        if rid.startswith(prefix):
            rid = rid[len(prefix):]
            break
    head, sep, tail = rid.rpartition("-")
    if sep and len(tail) <= 8 and all(c in "0123456789abcdef" for c in tail):
        rid = head
    head, sep, tail = rid.rpartition("-")
    if sep and tail.isdigit() and len(tail) <= 3:
        rid = head
    return rid
