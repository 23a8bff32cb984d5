"""The express node's `structured_outputs`, built from a client body as vLLM 0.32's serving layer builds its
StructuredOutputsParams (docs/api.md "The express node's HTTP API"):

1. the request's own `structured_outputs` object (json / regex / choice / grammar / json_object /
   structural_tag, options disable_any_whitespace, disable_additional_properties, whitespace_pattern);
2. `response_format` overrides it (vllm/entrypoints/generate/base/protocol.py
   structured_outputs_from_response_format): `json_object` -> json_object: true, `json_schema` ->
   json: <json_schema.schema>, `text` -> nothing; the other fields of (1) are kept (dataclasses.replace);
3. chat with tools and the hermes parser: a structural tag for the tool calls replaces the whole object
   (tools.structural_tag; vLLM's Parser.adjust_request, VLLM_ENFORCE_STRICT_TOOL_CALLING on by default).

The legacy `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields were removed in vLLM 0.32:
its server ignores them (a warning in its log, 200 with unconstrained output), so this lane ignores them too
and both lanes answer alike. The prefill leg receives the client's fields unchanged, so vLLM validates them
(a malformed schema is vLLM's 400) and samples the first token under the same grammar; the node continues it.
"""

from __future__ import annotations

import json
from typing import Any

from .tools import SUPPORTED_PARSERS, structural_tag, tools_active

__all__ = ["STRUCTURED_KEYS", "node_structured_outputs", "structured_unsupported"]

# StructuredOutputsParams fields as the node takes them (docs/api.md).
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace",
                   "disable_additional_properties", "whitespace_pattern")


def structured_unsupported(body: dict[str, Any]) -> str | None:
    """A structured-output request this lane cannot reproduce exactly (None: it can)."""
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "structural_tag":
        return "response_format type structural_tag"
    so = body.get("structured_outputs")
    if so is not None and not isinstance(so, dict):
        return "structured_outputs must be an object"
    return None


def node_structured_outputs(body: dict[str, Any], *, chat: bool, tool_parser: str | None) -> dict[str, Any] | None:
    so = body.get("structured_outputs")
    out: dict[str, Any] | None = None
    if isinstance(so, dict):
        out = {k: so[k] for k in STRUCTURED_KEYS if so.get(k) is not None}
    rf = body.get("response_format")
    if isinstance(rf, dict):
        t = rf.get("type")
        if t == "json_object":
            out = {**(out or {}), "json_object": True}
        elif t == "json_schema":
            js = rf.get("json_schema") if isinstance(rf.get("json_schema"), dict) else {}
            out = {**(out or {}), "json": js.get("schema")}
    if chat and tool_parser in SUPPORTED_PARSERS and tools_active(body) and isinstance(body.get("tools"), list):
        tag = structural_tag(body)
        if tag is not None:
            out = {"structural_tag": json.dumps(tag)}
    if out is not None and not any(out.get(k) is not None for k in STRUCTURED_KEYS[:6]):
        return None  # options alone constrain nothing
    return out
