"""Structured outputs and tool calls on the express lane (fake prefill + fake node with the docs/api.md shapes):
the node's `structured_outputs` as vLLM builds StructuredOutputsParams, the prefill leg keeping the client's fields,
hermes tool calls turned into vLLM's `tool_calls` (non-stream and streamed), finish reasons per tool_choice."""

from __future__ import annotations

import json
import re

import pytest

from expresslane.router.openai import tools as T
from expresslane.router.openai.structured import node_structured_outputs

from ._kit import EXPRESS, PREFILL, make_config, parse_sse
from .test_router_express_lane import FakeNode

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CHAT = {"model": "tiny-x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "temperature": 0}


def _node(upstreams, tokenizer, text):
    n = FakeNode(upstreams, tokenizer, answer_text=text)
    n.finish_reason = "stop"
    return n


async def _post(make_client, body, path="/v1/chat/completions", config=None):
    async with make_client(config or make_config(max_model_len=512)) as (client, _):
        return await client.post(path, json=body)


@pytest.mark.parametrize("extra,want", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, {"json": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"structured_outputs": {"regex": "[ab]+", "disable_any_whitespace": True}},
     {"regex": "[ab]+", "disable_any_whitespace": True}),
    ({"structured_outputs": {"disable_any_whitespace": True}, "response_format": {"type": "json_object"}},
     {"disable_any_whitespace": True, "json_object": True}),  # response_format overrides, options kept (replace)
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": SCHEMA}, None),  # removed in vLLM 0.32: ignored there, ignored here
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_node_gets_structured_outputs_and_prefill_keeps_the_fields(make_client, upstreams, tokenizer, extra,
                                                                         want, path):
    _node(upstreams, tokenizer, ' {"a": 1}')
    base = CHAT if path.endswith("chat/completions") else {"model": "tiny-x", "prompt": "hi", "max_tokens": 400}
    r = await _post(make_client, dict(base, **extra), path)
    assert r.status_code == 200, r.text
    (dec,) = upstreams.bodies(EXPRESS, "/pd/decode")
    assert dec.get("structured_outputs") == want
    (pre,) = upstreams.bodies(PREFILL, path)
    for k, v in extra.items():
        assert pre[k] == v  # vLLM validates them and samples the first token under the same grammar


def test_structured_outputs_match_vllm_sampling_params():
    pytest.importorskip("vllm", reason="vLLM is not installed (the reference)")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError

    cases = [{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
             {"response_format": {"type": "json_object"}},
             {"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}},
             {"structured_outputs": {"grammar": 'root ::= "a"'}, "response_format": {"type": "json_object"}},
             {"structured_outputs": {"disable_any_whitespace": True}, "response_format": {"type": "json_object"}},
             {"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
             {"response_format": {"type": "text"}, "structured_outputs": {"choice": ["x"]}}, {}]
    for extra in cases:
        for chat in (True, False):
            try:
                req = (ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **extra)
                       if chat else CompletionRequest(model="m", prompt="x", **extra))
                so = req.to_sampling_params(8, {}).structured_outputs
            except (VLLMValidationError, ValueError):  # two constraints: the prefill leg answers vLLM's 400 before the node is asked
                continue
            want = None if so is None else {k: getattr(so, k) for k in (
                "json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace",
                "disable_additional_properties", "whitespace_pattern") if getattr(so, k) not in (None, False)}
            got = node_structured_outputs(extra, chat=chat, tool_parser="hermes")
            got = None if got is None else {k: v for k, v in got.items() if v not in (None, False)}
            assert got == want, extra


def _ids_ok(calls):
    return all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", c["id"]) for c in calls)


@pytest.mark.parametrize("tc,finish", [("required", "tool_calls"), ("auto", "tool_calls"),
                                       ({"type": "function", "function": {"name": "get_weather"}}, "stop")])
async def test_non_stream_tool_calls(make_client, upstreams, tokenizer, tc, finish):
    node = _node(upstreams, tokenizer, CALL)
    r = await _post(make_client, dict(CHAT, tools=TOOLS, tool_choice=tc))
    assert r.status_code == 200, r.text
    (dec,) = upstreams.bodies(EXPRESS, "/pd/decode")
    tag = T.structural_tag(dict(CHAT, tools=TOOLS, tool_choice=tc))
    assert dec.get("structured_outputs") == (None if tag is None else {"structural_tag": json.dumps(tag)})
    (pre,) = upstreams.bodies(PREFILL, "/v1/chat/completions")
    assert pre["tools"] == TOOLS and pre["tool_choice"] == tc
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == finish
    calls = ch["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"})]
    assert calls[0]["function"]["arguments"] == '{"city": "Paris"}' and _ids_ok(calls)
    assert ch["message"]["content"] == ("" if tc != "auto" else None)
    assert node.cancelled == []


async def test_auto_without_a_call_is_plain_content(make_client, upstreams, tokenizer):
    _node(upstreams, tokenizer, " hello world")
    r = await _post(make_client, dict(CHAT, tools=TOOLS))
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["message"]["tool_calls"] == []
    assert ch["message"]["content"] == " hello world"


@pytest.mark.parametrize("tc,finish", [("required", "tool_calls"), ("auto", "tool_calls"),
                                       ({"type": "function", "function": {"name": "get_weather"}}, "stop")])
async def test_streamed_tool_calls(make_client, upstreams, tokenizer, tc, finish):
    _node(upstreams, tokenizer, "ok " + CALL)
    r = await _post(make_client, dict(CHAT, tools=TOOLS, tool_choice=tc, stream=True))
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["finish_reason"] == finish
    deltas = [c["delta"] for c in chunks[1:]]
    content = "".join(d.get("content") or "" for d in deltas)
    tcs = [t for d in deltas for t in d.get("tool_calls", [])]
    assert content == "ok "
    assert tcs[0]["type"] == "function" and tcs[0]["function"] == {"name": "get_weather"} and _ids_ok(tcs[:1])
    args = "".join(t["function"].get("arguments", "") for t in tcs[1:])
    assert json.loads(args) == {"city": "Paris"}


async def test_tools_with_another_parser_are_not_carried_by_the_express_lane(make_client, upstreams, tokenizer):
    _node(upstreams, tokenizer, CALL)
    r = await _post(make_client, dict(CHAT, tools=TOOLS, tool_choice="required"),
                    config=make_config(tool_call_parser="mistral", max_model_len=512))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"  # alias tiny-x: unsupported: refuse
    assert upstreams.bodies(EXPRESS, "/pd/decode") == []


async def test_tools_keep_special_tokens_in_the_text(make_client, upstreams, tokenizer, eos_id):
    node = _node(upstreams, tokenizer, " hello")
    node.answer = node.answer + [eos_id]  # an EOS ends it (stop) and is not text either way
    r = await _post(make_client, dict(CHAT, tools=TOOLS, tool_choice="none"))
    assert r.json()["choices"][0]["message"]["content"] == " hello"


async def test_a_constrained_request_is_not_continued_natively_after_a_node_failure(make_client, upstreams,
                                                                                     tokenizer):
    node = _node(upstreams, tokenizer, ' {"a": 1}')
    node.die_after = 2  # a native continuation could not resume the grammar mid-way: an error, not a wrong answer
    body = dict(CHAT, response_format={"type": "json_object"})
    async with make_client(make_config(max_model_len=512)) as (client, app):
        r = await client.post("/v1/chat/completions", json=body)
        metrics = (await client.get("/metrics")).text
    assert r.status_code == 502 and "without a done line" in r.json()["error"]["message"]
    assert upstreams.bodies("http://native:8100", "/v1/completions") == []
    assert 'expresslane_router_midstream_failovers_total{outcome="disabled",pool="express"} 1.0' in metrics


@pytest.mark.parametrize("extra", [{"tools": 5}, {"tools": "x", "tool_choice": "required"},
                                   {"tools": [{"type": "function", "function": {"name": 3}}], "tool_choice": "auto"},
                                   {"tools": TOOLS, "tool_choice": {"type": "function", "function": "x"}},
                                   {"response_format": "json"}, {"structured_outputs": [1]}])
async def test_odd_tool_and_format_fields_are_never_a_500(make_client, upstreams, tokenizer, extra):
    _node(upstreams, tokenizer, " hello")
    r = await _post(make_client, dict(CHAT, **extra))
    assert r.status_code < 500, r.text  # vLLM (the prefill leg) or the relay check judges them
