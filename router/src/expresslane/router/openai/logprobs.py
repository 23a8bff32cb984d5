"""Logprobs on the express lane in exactly vLLM 0.32's chat and completions shapes.

Sources: the first token's entry comes from the prefill reply (the router asks the prefill for max(k, 1) top
logprobs), every later token's from the node's NDJSON `lp` / `tp` arrays (docs/api.md). Per position vLLM keeps
a dict in insertion order: the sampled token first, then the top-k by logprob (a sampled token that is also in
the top-k keeps its first place: `append_logprobs_for_next_position`). From that dict:
- chat (`_create_chat_logprobs`): `logprobs.content[i] = {token, logprob, bytes, top_logprobs}` with
  top_logprobs = the dict's first `top_logprobs` items, each {token, logprob, bytes};
- completions (`_create_completion_logprobs`): `tokens`, `token_logprobs`, `top_logprobs` (a {token: logprob}
  object of the dict's first logprobs + 1 items), `text_offset` (running sum of the token strings' lengths,
  continued across stream chunks).
Logprob values are floored at -9999.0 as vLLM floors them.

Token strings (`TokenStrings`) as vLLM's output processor decodes them (vllm/v1/engine/logprobs.py,
vllm/tokenizers/detokenizer_utils.py): `tokenizer.decode([id])` with special tokens kept; a SentencePiece
Metaspace marker restores leading spaces decode() stripped; a string ending in U+FFFD is re-decoded with up to 4
preceding sampled tokens as context (`_correct_decoded_token`). With `return_tokens_as_token_ids` (the request
field, else the router's `return_tokens_as_token_ids` config = the native decode servers' flag) the strings are
`token_id:N` (chat `bytes` of the sampled token still come from the decoded text, as in vLLM). A prefill that runs
with `--return-tokens-as-token-ids` hands back placeholders: they are decoded here when the answer wants text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .request import options_of

__all__ = ["Position", "TokenStrings", "chat_logprobs", "completion_logprobs", "from_node", "from_prefill",
           "wanted_k"]

FLOOR = -9999.0
_PLACEHOLDER = "token_id:"
_REPLACEMENT = "\ufffd"


def _floor(v: float) -> float:
    return max(float(v), FLOOR)


@dataclass
class Position:
    """One output position: the sampled id, its logprob, and vLLM's dict items (sampled first) as
    (token id, or a string the prefill already rendered; logprob)."""

    token_id: int
    logprob: float
    items: list[tuple[int | str, float]] = field(default_factory=list)
    text: str | None = None  # the sampled token's string as the prefill rendered it (None: decode it here)


def wanted_k(body: dict[str, Any], chat: bool) -> int | None:
    """The client's k (top alternatives per token), or None when it asked for no logprobs (request.py's rule)."""
    return options_of(body, chat).logprobs_k


def _placeholder_id(tok: Any) -> int | None:
    if isinstance(tok, str) and tok.startswith(_PLACEHOLDER):
        try:
            return int(tok[len(_PLACEHOLDER):])
        except ValueError:
            return None
    return None


def _item(tok: Any) -> int | str:
    pid = _placeholder_id(tok)
    return pid if pid is not None else str(tok)


def from_prefill(resp: dict[str, Any], token_id: int, *, chat: bool) -> Position | None:
    """The first token's Position from the prefill reply's logprobs (None when it carries none)."""
    choices = resp.get("choices") or []
    lp = choices[0].get("logprobs") if choices and isinstance(choices[0], dict) else None
    if not isinstance(lp, dict):
        return None
    if chat:
        content = lp.get("content") or []
        if not content or not isinstance(content[0], dict):
            return None
        e = content[0]
        items = [(_item(t.get("token")), float(t.get("logprob", FLOOR))) for t in e.get("top_logprobs") or []]
        tok = e.get("token")
        return Position(token_id, float(e.get("logprob", FLOOR)), items,
                        None if _placeholder_id(tok) is not None else tok)
    toks, tlps, tops = lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    if not toks or not tlps or tlps[0] is None:
        return None
    top0 = tops[0] if tops and isinstance(tops[0], dict) else {}
    items = [(_item(t), float(v)) for t, v in top0.items()]
    return Position(token_id, float(tlps[0]), items, None if _placeholder_id(toks[0]) is not None else toks[0])


def from_node(token_id: int, lp: float | None, tp: list[list[Any]] | None) -> Position:
    """A node line's entry: `lp` the sampled token's logprob, `tp` [[id, logprob], ...] sorted desc."""
    items: list[tuple[int | str, float]] = [(token_id, float(lp if lp is not None else FLOOR))]
    seen = {token_id}
    for tid, v in tp or ():
        tid = int(tid)
        if tid in seen:
            continue  # the dict keeps the sampled token's first place
        seen.add(tid)
        items.append((tid, float(v)))
    return Position(token_id, items[0][1], items)


class TokenStrings:
    """vLLM's per-token decoding for logprobs (see the module docstring)."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self._marker = self._space_marker(tokenizer)

    @staticmethod
    def _space_marker(tok: Any) -> str | None:
        try:
            pre = json.loads(tok.to_str()).get("pre_tokenizer") or {}
        except Exception:  # noqa: BLE001  (not a `tokenizers` tokenizer: no marker, as in vLLM)
            return None
        if pre.get("type") == "Metaspace":
            return pre.get("replacement", "\u2581")
        if pre.get("type") == "Sequence":
            for sub in pre.get("pretokenizers", []):
                if sub.get("type") == "Metaspace":
                    return sub.get("replacement", "\u2581")
        return None

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def one(self, token_id: int, context: list[int]) -> str:
        text = self._decode([token_id]) or ""
        if self._marker is not None:
            raw = self._tok.id_to_token(token_id) or ""
            n = len(raw) - len(raw.lstrip(self._marker))
            missing = n - (len(text) - len(text.lstrip(" ")))
            if n and missing > 0:
                text = " " * missing + text
        if text.endswith(_REPLACEMENT):
            text = self._correct(token_id, context)
        return text

    def _correct(self, token_id: int, context: list[int]) -> str:
        for n in range(1, min(len(context), 4) + 1):
            ctx = context[-n:]
            full = self._decode(ctx + [token_id])
            if full.endswith(_REPLACEMENT):
                continue
            clean_end = len(ctx)
            for j in range(len(ctx) - 1, -1, -1):
                if self._decode([ctx[j]]).endswith(_REPLACEMENT):
                    clean_end = j
                else:
                    break
            prefix = self._decode(ctx[:clean_end]) if clean_end > 0 else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0
            for a, b in zip(prefix, full):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""


@dataclass
class _Render:
    strings: TokenStrings
    as_ids: bool

    def decoded(self, pos: Position, context: list[int]) -> str:
        return pos.text if pos.text is not None else self.strings.one(pos.token_id, context)

    def token(self, item: int | str, context: list[int]) -> str:
        if isinstance(item, int):
            return f"{_PLACEHOLDER}{item}" if self.as_ids else self.strings.one(item, context)
        if self.as_ids or _placeholder_id(item) is None:
            return item
        return self.strings.one(_placeholder_id(item), context)  # type: ignore[arg-type]

    def sampled(self, pos: Position, context: list[int]) -> str:
        return f"{_PLACEHOLDER}{pos.token_id}" if self.as_ids else self.decoded(pos, context)


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))


def chat_logprobs(positions: list[Position], output_ids: list[int], start: int, k: int, strings: TokenStrings,
                  *, as_ids: bool) -> dict[str, Any]:
    """`{"content": [...]}` for output positions start.. (output_ids: all the answer's token ids so far)."""
    r = _Render(strings, as_ids)
    content = []
    for i, pos in enumerate(positions, start):
        ctx = output_ids[max(0, i - 4):i]
        decoded = r.decoded(pos, ctx)
        content.append({"token": r.sampled(pos, ctx), "logprob": _floor(pos.logprob), "bytes": _bytes(decoded),
                        "top_logprobs": [{"token": (t := r.token(item, ctx)), "logprob": _floor(v), "bytes": _bytes(t)}
                                         for item, v in pos.items[:k]]})
    return {"content": content}


def completion_logprobs(positions: list[Position], output_ids: list[int], start: int, k: int,
                        strings: TokenStrings, *, as_ids: bool, text_offset: int = 0) -> dict[str, Any]:
    r = _Render(strings, as_ids)
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = text_offset
    for i, pos in enumerate(positions, start):
        ctx = output_ids[max(0, i - 4):i]
        tok = r.sampled(pos, ctx)
        out["tokens"].append(tok)
        out["token_logprobs"].append(_floor(pos.logprob))
        out["top_logprobs"].append({r.token(item, ctx): _floor(v) for item, v in pos.items[:k + 1]})
        out["text_offset"].append(offset)
        offset += len(tok)
    return out
