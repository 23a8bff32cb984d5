"""Tool calling on the express lane, as vLLM 0.32's chat server does it with `--tool-call-parser hermes`.

What vLLM does (read in vllm/parser/abstract_parser.py, vllm/tool_parsers/{hermes_tool_parser,
structural_tag_registry,abstract_tool_parser}.py and entrypoints/openai/chat_completion/serving.py, checked by
tests/unit/router/test_router_tools.py against the installed vLLM):
- With `tools` and a tool_choice that needs a call (`auto` when some tool is `strict` or `parallel_tool_calls`
  is false, `required`, a named function) and VLLM_ENFORCE_STRICT_TOOL_CALLING on (its default), the request's
  structured outputs become a hermes *structural tag* (`structural_tag(...)` here): one tag per function tool in
  two spellings (`<tool_call>\\n{"name": "f", "arguments": ` ... `}\\n</tool_call>` and without the newlines),
  the arguments constrained by the tool's JSON schema only when the tool is `strict` (else any JSON);
  `required` -> tags_with_separator (at least one call), a named function -> the same with only that tool
  and stop_after_first, `auto` -> triggered_tags on `<tool_call>`. (Not the older JSON-list schema of
  `get_json_schema_from_tools`: with hermes that path is not taken in 0.32.)
- `skip_special_tokens` becomes false whenever tools are given and tool_choice is not `none`.
- The output is parsed by Hermes2ProToolParser for `auto`, `required` and named alike (`HermesParser`):
  calls -> `tool_calls` [{id: "chatcmpl-tool-<16 hex>", type: "function", function: {name, arguments (JSON
  string, ensure_ascii=False)}}]; content = the text before the first `<tool_call>` or null.
- finish_reason: non-stream "tool_calls" when `auto` found calls, or `required` ended with "stop"; a named
  function keeps "stop". Stream: "tool_calls" when a tool delta was sent, the choice is not named and the
  output ended with "stop".
Requests whose grammar would need the structural tag combined with another structured output (`auto` with a
tag plus `response_format`), and parsers other than hermes, are not carried by the express lane
(`express_unsupported` names them; capability routing sends them native).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HermesParser", "ToolChoice", "express_unsupported", "make_tool_call_id", "structural_tag",
           "tool_choice_of", "tools_active"]

START, END = "<tool_call>", "</tool_call>"
SUPPORTED_PARSERS = ("hermes",)
_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME_RE = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGS_RE = re.compile(r'"arguments"\s*:\s*')


def make_tool_call_id() -> str:
    """vLLM's `make_tool_call_id()` (random kind): `chatcmpl-tool-` + 16 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().int & ((1 << 64) - 1):016x}"


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # none | auto | required | named
    name: str | None = None


def tool_choice_of(body: dict[str, Any]) -> ToolChoice:
    """vLLM's defaulting: no tool_choice with tools -> auto; without tools -> none."""
    tc = body.get("tool_choice", "auto" if body.get("tools") else "none")
    if tc is None:
        return ToolChoice("auto" if body.get("tools") else "none")
    if isinstance(tc, dict):
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
        return ToolChoice("named", fn.get("name"))
    return ToolChoice(str(tc))


def tools_active(body: dict[str, Any]) -> bool:
    """Tools given and a tool_choice other than none (vLLM parses the output and keeps special tokens)."""
    return bool(body.get("tools")) and tool_choice_of(body).mode != "none"


def _functions(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools")
    return [t["function"] for t in (tools if isinstance(tools, list) else ())
            if isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)]  # anything else is vLLM's 400 on the prefill leg


def _tags(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    formats = ((START + '\n{"name": "', "}\n" + END), (START + '{"name": "', "}" + END))
    out = []
    for fn in functions:
        strict = fn.get("strict") is True
        schema: Any = (fn.get("parameters") if fn.get("parameters") is not None else True) if strict else True
        for begin, end in formats:
            out.append({"type": "tag", "begin": begin + fn["name"] + '", "arguments": ',
                        "content": {"type": "json_schema", "json_schema": schema, "style": "json",
                                    "any_order": False, "max_whitespace_cnt": None, "excludes": []},
                        "end": end})
    return out


def structural_tag(body: dict[str, Any]) -> dict[str, Any] | None:
    """The hermes structural tag vLLM 0.32 puts in `structured_outputs.structural_tag` (as an object; the
    caller json.dumps it), or None when vLLM sets none for this request."""
    if not body.get("tools"):
        return None
    tc = tool_choice_of(body)
    if tc.mode not in ("auto", "required", "named"):
        return None
    fns = _functions(body)
    single = body.get("parallel_tool_calls") is False
    strict_level_function = single  # vLLM raises the strict level to FUNCTION for parallel_tool_calls=false ...
    if tc.mode == "auto" and single and _has_structured(body):
        strict_level_function = False  # ... except for auto with structured outputs (format-only grammar)
    if tc.mode == "auto" and not strict_level_function and not any(f.get("strict") is True for f in fns):
        return None  # resolve_tool_strictness: no structural tag
    if tc.mode == "named":
        fns = [f for f in fns if f.get("name") == tc.name]
    tags = _tags(fns)
    if tc.mode == "auto":
        fmt: dict[str, Any] = ({"type": "triggered_tags", "triggers": [START], "tags": tags, "at_least_one": False,
                                "stop_after_first": False, "excludes": []} if tags else {"type": "any_text"})
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
               "stop_after_first": tc.mode == "named"}
    if single and "stop_after_first" in fmt:
        fmt["stop_after_first"] = True
    return {"type": "structural_tag", "format": fmt}


def _has_structured(body: dict[str, Any]) -> bool:
    rf = body.get("response_format")
    return body.get("structured_outputs") is not None or (isinstance(rf, dict) and rf.get("type") not in (None, "text"))


def express_unsupported(body: dict[str, Any], tool_parser: str | None) -> str | None:
    """Why the express lane cannot carry this request's tool use exactly as vLLM would (None: it can)."""
    if not tools_active(body):
        return None
    if tool_parser not in SUPPORTED_PARSERS:
        return f"the router parses tool calls with {', '.join(SUPPORTED_PARSERS)} only (configured: {tool_parser})"
    if tool_choice_of(body).mode == "auto" and _has_structured(body) and structural_tag(body) is not None:
        return "tool_choice auto with strict tools (or parallel_tool_calls false) combined with structured outputs"
    return None


# ---- the output: Hermes2ProToolParser ---------------------------------------------------------------

def _overlap(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _complete_json(s: str) -> bool:
    try:
        json.loads(s)
        return True
    except ValueError:
        return False


@dataclass
class HermesParser:
    """One request's parser: `extract` (the whole output) or `delta` (streamed, vLLM's delta shapes)."""

    sent_content: int = 0
    names: list[str | None] = field(default_factory=list)
    streamed_args: list[str] = field(default_factory=list)
    tools_streamed: bool = False

    @staticmethod
    def extract(text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) as Hermes2ProToolParser.extract_tool_calls + vLLM's serving layer give them."""
        if START not in text:
            return text, []
        try:
            calls = [json.loads(a if a else b) for a, b in _CALL_RE.findall(text)]
            out = [{"id": make_tool_call_id(), "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                   for c in calls]
        except Exception:  # noqa: BLE001  (vLLM: any parse error -> no tool calls, the raw text as content)
            return text, []
        content = text[:text.find(START)]
        return (content if content else None), out

    # streaming ---------------------------------------------------------------------------------
    def _content(self, text: str) -> str | None:
        idx = text.index(START) if START in text else len(text) - _overlap(text, START)
        if idx > self.sent_content:
            out = text[self.sent_content:idx]
            self.sent_content = idx
            return out
        return None

    @staticmethod
    def _jsons(text: str) -> list[tuple[str, bool]]:
        res: list[tuple[str, bool]] = []
        pos = 0
        while (start := text.find(START, pos)) != -1:
            js = start + len(START)
            je = text.find(END, js)
            if je != -1:
                res.append((text[js:je].strip(), True))
                pos = je + len(END)
                continue
            raw = text[js:]
            ov = _overlap(raw, END)
            if ov:
                raw = raw[:-ov]
            tc = raw.strip()
            res.append((tc, _complete_json(tc) if tc else False))
            break
        return res

    @staticmethod
    def _args(tc_json: str, complete: bool) -> str | None:
        m = _ARGS_RE.search(tc_json)
        if not m:
            return None
        raw = tc_json[m.end():]
        if complete:
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
        return raw

    def delta(self, current_text: str) -> dict[str, Any] | None:
        """The delta message for the output so far (`current_text`), or None when there is nothing to send."""
        try:
            content = self._content(current_text)
            deltas: list[dict[str, Any]] = []
            for i, (tc_json, complete) in enumerate(self._jsons(current_text)):
                if i >= len(self.names):
                    self.names.append(None)
                    self.streamed_args.append("")
                if self.names[i] is None:
                    m = _NAME_RE.search(tc_json)
                    if not m:
                        break
                    self.names[i] = m.group(1)
                    deltas.append({"id": make_tool_call_id(), "type": "function", "index": i,
                                   "function": {"name": m.group(1)}})
                args = self._args(tc_json, complete)
                if args is not None and len(args) > len(self.streamed_args[i]):
                    diff = args[len(self.streamed_args[i]):]
                    self.streamed_args[i] = args
                    if diff:
                        deltas.append({"index": i, "function": {"arguments": diff}})
        except Exception:  # noqa: BLE001  (vLLM logs and sends nothing for this delta)
            return None
        if content or deltas:
            self.tools_streamed = self.tools_streamed or bool(deltas)
            out: dict[str, Any] = {"content": content}
            if deltas:
                out["tool_calls"] = deltas
            return out
        return None


def chat_message_and_finish(text: str, tc: ToolChoice, finish_reason: str, *,
                            parallel_tool_calls: bool | None = None) -> tuple[dict[str, Any], str]:
    """The non-stream message fields {content, tool_calls} and finish_reason for a tools request."""
    content, calls = HermesParser.extract(text)
    if tc.mode in ("required", "named") and not calls and (content is None or not content.strip()):
        content = None
    if calls and content is not None and content.strip() == "":
        content = None
    if parallel_tool_calls is False:
        calls = calls[:1]
    if tc.mode in ("required", "named"):
        content = content or ""
    msg = {"content": content, "tool_calls": calls}
    tool_finish = (tc.mode == "auto" and bool(calls)) or (tc.mode == "required" and finish_reason == "stop")
    return msg, "tool_calls" if tool_finish else finish_reason


def stream_finish(parser: HermesParser, tc: ToolChoice, finish_reason: str) -> str:
    named = tc.mode == "named"
    return "tool_calls" if parser.tools_streamed and not named and finish_reason == "stop" else finish_reason
