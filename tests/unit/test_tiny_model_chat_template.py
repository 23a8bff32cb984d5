"""The tiny model's chat template (scripts/make_tiny_model.py) renders `tools` in the hermes format Qwen2.5 uses,
so vLLM's `--tool-call-parser hermes` works on the native lane; without tools it is the plain ChatML it was.
Rendered through transformers' apply_chat_template, as vLLM renders it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_tiny_model.py"

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_tiny_model", SCRIPT)
    mtm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mtm)
    out = tmp_path_factory.mktemp("tiny-tok")
    mtm.save_tokenizer(mtm.train_tokenizer(mtm.DEFAULT_CORPUS), out)
    return transformers.AutoTokenizer.from_pretrained(str(out))


def render(tok, messages, **kw) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)


def test_without_tools_it_is_plain_chatml(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    want = ("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
    assert render(tok, msgs) == want
    assert render(tok, msgs, tools=[]) == want
    assert render(tok, msgs, tools=None) == want


def test_tools_conversation_renders_hermes_blocks(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]
    text = render(tok, msgs, tools=TOOLS)
    assert text.startswith("<|begin_of_text|><|im_start|>system\nBe brief.\n\n# Tools\n\n")
    block, rest = text.split("XML tags:\n<tools>\n", 1)[1].split("\n</tools>\n", 1)
    listed = [json.loads(line) for line in block.splitlines()]
    assert listed == TOOLS  # each tool as one JSON line, as Qwen2.5's template writes them
    assert "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" in rest
    assert text.count("Be brief.") == 1  # the system message is inside the tools block, not repeated
    assert ("<|im_start|>user\nWeather in Paris, and the time?<|im_end|>\n"
            "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
            "</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call><|im_end|>\n"
            "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in rest
    ids = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=False) == text


def test_tools_without_a_system_message(tok):
    text = render(tok, [{"role": "user", "content": "time?"}], tools=TOOLS[1:])
    assert text.startswith("<|begin_of_text|><|im_start|>system\n# Tools\n\n")
    assert text.endswith("<|im_start|>user\ntime?<|im_end|>\n<|im_start|>assistant\n")


def test_vllms_hermes_parser_reads_the_templates_tool_call_format(tok):
    """What the template teaches the model to write is what vLLM's hermes parser extracts."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]
    text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    turn = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], tools=TOOLS)
    info = Hermes2ProToolParser(tok).extract_tool_calls(turn, request)
    assert info.tools_called and info.content == "Let me check.\n"
    (call,) = info.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
