"""What the express lane accepts from a client body: options a node cannot honour are refused loudly (400,
pointing at `X-Lane: native`), and the /pd/decode `sampling` block each node kind honours."""

from __future__ import annotations

from typing import Any

from ..errors import BadRequest
from ..openai.structured import structured_unsupported
from ..openai.tools import express_unsupported

__all__ = ["SAMPLING_KEYS", "check_express_supported", "sampling_of"]

# The /pd/decode `sampling` keys each node kind honours (our engine server: more than TileRT).
SAMPLING_KEYS = {
    # min_p, logit_bias, allowed_token_ids: forwarded when the client sets them; capability routing sends such a
    # request here only when the node's /capabilities features announce them (docs/api.md).
    "expresslane": ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "frequency_penalty",
                    "ignore_eos", "seed", "stop_token_ids", "min_tokens", "min_p", "logit_bias", "allowed_token_ids"),
    # TileRT refuses per-request stop_token_ids (its loop uses the model's stop set): the router enforces them.
    "tilert": ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "ignore_eos", "seed"),
}


_OPTIONAL_KEYS = ("min_p", "logit_bias", "allowed_token_ids")


def _set(v: Any) -> bool:
    return v not in (None, False, 0, 0.0, "", [], {})


# Request fields an express decode node cannot honour: refused loudly instead of ignored. (The legacy guided_*
# fields are ignored by vLLM 0.32 itself, on both lanes: structured.py.)
# bad_words: vLLM takes words (strings) and tokenizes them its own way; the node takes token ids: not carried.
_UNSUPPORTED = ("prompt_logprobs", "echo", "bad_words", "logprob_token_ids")
_UNSUPPORTED_BY_KIND = {"expresslane": (),
                        "tilert": ("min_tokens", "frequency_penalty", "structured_outputs", "logprobs", "top_logprobs",
                                   "logit_bias", "min_p", "allowed_token_ids")}


def _refuse(key: str, why: str = "", feature: str | None = None) -> BadRequest:
    err = BadRequest(f"'{key}' is not supported on the express lane{' (' + why + ')' if why else ''}; "
                     "send 'X-Lane: native' to use it", param=key)
    err.feature = feature  # type: ignore[attr-defined]  (capability routing's feature name, when not the field's)
    return err


def check_express_supported(body: dict[str, Any], kind: str = "expresslane", *,
                            tool_parser: str | None = "hermes") -> None:
    for key in _UNSUPPORTED + _UNSUPPORTED_BY_KIND[kind]:
        if _set(body.get(key)):
            raise _refuse(key)
    rf = body.get("response_format")
    if kind == "tilert":
        if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
            raise _refuse("response_format")
        if _set(body.get("tools")) and body.get("tool_choice") != "none":
            raise _refuse("tools")
        return
    why = structured_unsupported(body)
    if why:
        if "structural_tag" in why:
            raise _refuse("response_format", why, feature="structural_tag")
        raise _refuse("structured_outputs", why, feature="structured_output")
    why = express_unsupported(body, tool_parser)
    if why:
        raise _refuse("tools", why)


def sampling_of(body: dict[str, Any], defaults: dict[str, Any], kind: str = "expresslane") -> dict[str, Any]:
    """The sampling block of /pd/decode: the client's values, vLLM's generation-config defaults otherwise (only
    the keys this node kind takes: a TileRT node applies its own model's config)."""
    keys = SAMPLING_KEYS[kind]
    out = {k: body[k] for k in keys if body.get(k) is not None
           and not (k in _OPTIONAL_KEYS and not _set(body[k]))}  # a neutral optional key is not sent at all
    for k, v in defaults.items():
        if k in keys:
            out.setdefault(k, v)
    return out
