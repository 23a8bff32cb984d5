"""The router's hermes tool handling (tools.py) against vLLM 0.32's own code in the dev venv: the structural tag
vLLM's Parser.adjust_request puts in structured_outputs, Hermes2ProToolParser's non-stream extraction and its
streamed deltas, over a corpus of requests and model outputs."""

from __future__ import annotations

import json
import re

import pytest

from expresslane.router.openai import tools as T

vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this environment (the reference for tools.py)")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "w",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "noargs"}},
    {"type": "function", "function": {"name": "strict_one", "strict": True,
                                      "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
REQUESTS = [
    {"tool_choice": tc, "tools": tools, **extra}
    for tc in ("auto", "required", NAMED, "none", None)
    for tools in (TOOLS[:2], TOOLS)
    for extra in ({}, {"parallel_tool_calls": False}, {"parallel_tool_calls": True},
                  {"response_format": {"type": "json_object"}})
]
OUTPUTS = [
    "plain answer, no call",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "noargs", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by max_tokens
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',  # no closing tag
    "<tool_call>not json</tool_call>",
    "text with a < sign and <tool but no call",
    '   <tool_call>{"name": "noargs", "arguments": {"a": [1, 2, {"b": null}]}}</tool_call>',
    "",
]


@pytest.fixture(scope="module")
def vllm_parser(tiny_model_dir):
    from vllm.parser import ParserManager
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(tiny_model_dir))
    return tok, ParserManager.get_parser(tool_parser_name="hermes", enable_auto_tools=True, tokenizer=tok)


def _vllm_request(body):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    b = {k: v for k, v in body.items() if v is not None}
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **b)


def _ids_away(obj):
    return json.loads(re.sub(r"chatcmpl-tool-[0-9a-f]{16}", "ID", json.dumps(obj)))


@pytest.mark.parametrize("i", range(len(REQUESTS)))
def test_structured_outputs_match_vllm_adjust_request(vllm_parser, i):
    tok, P = vllm_parser
    body = REQUESTS[i]
    req = _vllm_request(body)
    req = P(tok, req.tools).adjust_request(req)
    so = req.to_sampling_params(8, {}).structured_outputs
    if T.express_unsupported(body, "hermes") is not None:
        assert so is not None and so.structural_tag is not None  # the combination we hand to the native lane
        return
    mine = T.structural_tag(body)
    if mine is None:
        assert so is None or so.structural_tag is None
    else:
        assert so is not None and so.structural_tag is not None
        assert json.loads(so.structural_tag) == mine
    assert req.skip_special_tokens is (not T.tools_active(body))


@pytest.mark.parametrize("tc", ["auto", "required", NAMED])
@pytest.mark.parametrize("j", range(len(OUTPUTS)))
def test_non_stream_extraction_matches_vllm(vllm_parser, tc, j):
    tok, P = vllm_parser
    body = {"tools": TOOLS, "tool_choice": tc}
    req = _vllm_request(body)
    p = P(tok, req.tools)
    req = p.adjust_request(req)
    _, content, calls = p.parse(OUTPUTS[j], req, enable_auto_tools=True)
    msg, _ = T.chat_message_and_finish(OUTPUTS[j], T.tool_choice_of(body), "stop")
    want_calls = [{"id": "ID", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                  for c in calls or []]
    assert _ids_away(msg["tool_calls"]) == want_calls
    # vLLM's serving layer: required/named -> content or "", auto -> content
    want_content = (content or "") if T.tool_choice_of(body).mode in ("required", "named") else content
    assert msg["content"] == want_content
    for c in msg["tool_calls"]:
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", c["id"])


def _pieces(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    out, acc = [], ""
    for i in range(len(ids)):
        full = tok.decode(ids[:i + 1])
        if full.endswith("\ufffd"):
            continue
        out.append(full[len(acc):])
        acc = full
    if acc != text:
        out.append(text[len(acc):])
    return out


@pytest.mark.parametrize("tc", ["auto", "required", NAMED])
@pytest.mark.parametrize("j", range(len(OUTPUTS)))
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_deltas_match_vllm(vllm_parser, tc, j, chunk):
    tok, P = vllm_parser
    body = {"tools": TOOLS, "tool_choice": tc}
    req = _vllm_request(body)
    p = P(tok, req.tools)
    req = p.adjust_request(req)
    pieces = _pieces(tok, OUTPUTS[j])
    groups = ["".join(pieces[k:k + chunk]) for k in range(0, len(pieces), chunk)] or [""]
    mine = T.HermesParser()
    acc = ""
    for n, g in enumerate(groups):
        last = n == len(groups) - 1
        dm = p.parse_delta(g, [0], req, prompt_token_ids=[1], finished=last)
        want = None if dm is None else json.loads(dm.model_dump_json(exclude_unset=True))
        acc += g
        got = mine.delta(acc)
        assert _ids_away(got) == _ids_away(want), (n, g)
