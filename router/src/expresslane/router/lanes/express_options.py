"""What the express lane accepts from a client body: options a node cannot honour are refused loudly (400,
pointing at `X-Lane: native`), and the /pd/decode `sampling` block each node kind honours."""

from __future__ import annotations

from typing import Any

from ..errors import BadRequest

__all__ = ["SAMPLING_KEYS", "check_express_supported", "sampling_of"]

# The /pd/decode `sampling` keys each node kind honours (our engine server: more than TileRT).
SAMPLING_KEYS = {
    "expresslane": ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "frequency_penalty",
                    "ignore_eos", "seed", "stop_token_ids", "min_tokens"),
    # TileRT refuses per-request stop_token_ids (its loop uses the model's stop set): the router enforces them.
    "tilert": ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "ignore_eos", "seed"),
}


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
