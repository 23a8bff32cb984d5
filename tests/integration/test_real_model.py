"""The real model (SmolLM2-135M-Instruct, scripts/model_init.py) through the whole stack: greedy answers identical on
the express lane, the native lane and a single vLLM server (the prefill alone), on real prompts: chat, a code edit,
JSON through structured outputs, a forced tool call, a completion; streamed and not.

Its own stack on ports EXPRESSLANE_TEST_PORT_BASE + 700, started the way a user serves their own checkpoint
(scripts/dev_stack.py --model-dir: the directory as it is, no model-init in the start): scripts/model_init.py writes
the model first, and the stack serves it through a link named `own-smollm2`, so the served name and the router's
aliases (own-smollm2, own-smollm2-express) come from the directory's name. Express
requests are pinned with `X-Lane: express` and each non-stream answer must say it was served there (a feature the
node lacked would be a 400, never a silent native answer). Float32 on every engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from dev_stack import DevStack  # noqa: E402

MODEL = "smollm2-135m-instruct"
SERVED = "own-smollm2"  # the name of the directory the stack serves
EXPRESS = {"X-Lane": "express"}
MAX_TOKENS = 64

CODE = '''def total(xs):
    t = 0
    for x in xs:
        t = t + x
    return t
'''
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"]}}}

# name -> (path, body without model); every one greedy.
CASES = {
    "chat": ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]}),
    "chat-multi-turn": ("/v1/chat/completions",
                        {"messages": [{"role": "system", "content": "You are a concise assistant."},
                                      {"role": "user", "content": "Name three primary colors."},
                                      {"role": "assistant", "content": "Red, blue and yellow."},
                                      {"role": "user", "content": "Which of them is the color of the sky?"}]}),
    "code-edit": ("/v1/chat/completions",
                  {"messages": [{"role": "user", "content": "Rename the variable t to acc in this Python function "
                                                            "and return the whole function:\n\n" + CODE}]}),
    "json-schema": ("/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "Describe a person called Ada who is 36, as JSON."}],
                     "response_format": {"type": "json_schema",
                                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}}}),
    "tool-call": ("/v1/chat/completions",
                  {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                   "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    "completion": ("/v1/completions",
                   {"prompt": "The three laws of thermodynamics are"}),
}


@pytest.fixture(scope="module")
def real_stack(tmp_path_factory):
    base = int(os.environ.get("EXPRESSLANE_TEST_PORT_BASE", "20000")) + 700
    model_dir = REPO / "var" / "models" / MODEL
    init = subprocess.run([sys.executable, str(REPO / "scripts" / "model_init.py"), str(model_dir), "--model", MODEL],
                          capture_output=True, text=True, timeout=900)  # once; later runs verify the checksums
    assert init.returncode == 0, init.stderr
    own = tmp_path_factory.mktemp("models") / SERVED
    own.symlink_to(model_dir, target_is_directory=True)
    stack = DevStack(model_dir=own, state_dir=tmp_path_factory.mktemp("real-stack"), port_base=base)
    assert stack.model is None and stack.aliases == (SERVED, f"{SERVED}-express")  # served as it is
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()
        if os.environ.get("EXPRESSLANE_TEST_SHOW_LOGS"):
            for name in stack.services:
                print(f"\n===== {name} log tail =====\n{stack.log_tail(name, 40)}")


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=5.0), trust_env=False) as c:
        yield c


def _answer(path: str, out: dict) -> dict:
    """What must be identical: the text (or tool calls), the finish reason and the token count."""
    choice = out["choices"][0]
    if path.endswith("/completions") and "message" in choice:
        msg = choice["message"]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls") or []]
        return {"text": msg.get("content") or "", "tool_calls": calls, "finish_reason": choice["finish_reason"],
                "tokens": out["usage"]["completion_tokens"]}
    return {"text": choice["text"], "finish_reason": choice["finish_reason"], "tokens": out["usage"]["completion_tokens"]}


def _streamed(http: httpx.Client, url: str, body: dict, headers: dict) -> dict:
    """The same request streamed: text and tool-call deltas merged, the finish reason, SSE framing checked."""
    text, calls, finish, done = [], {}, None, False
    with http.stream("POST", url, json=dict(body, stream=True), headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                done = True
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                delta = choice.get("delta", choice)
                text.append(delta.get("content") or delta.get("text") or "")
                for call in delta.get("tool_calls") or []:
                    slot = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                    fn = call.get("function") or {}
                    slot["name"] += fn.get("name") or ""
                    slot["arguments"] += fn.get("arguments") or ""
                finish = choice.get("finish_reason") or finish
    assert done, "no data: [DONE]"
    return {"text": "".join(text), "tool_calls": [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
            "finish_reason": finish}


def _lanes(stack: DevStack):
    native, express = stack.aliases
    return {"single": (stack.prefill_url, SERVED, {}), "native": (stack.router_url, native, {}),
            "express": (stack.router_url, express, EXPRESS)}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_answers_are_identical_on_every_lane(real_stack, http, case):
    path, body = CASES[case]
    answers, express_lane = {}, None
    for lane, (base, model, headers) in _lanes(real_stack).items():
        r = http.post(base + path, json={**body, "model": model, "max_tokens": MAX_TOKENS, "temperature": 0},
                      headers=headers)
        assert r.status_code == 200, f"{lane}: {r.status_code} {r.text}"
        answers[lane] = _answer(path, r.json())
        if lane == "express":
            express_lane = r.headers.get("x-expresslane-lane")
    assert express_lane == "express"
    assert answers["express"] == answers["single"], answers
    assert answers["native"] == answers["single"], answers
    got = answers["single"]
    assert got["text"].strip() or got.get("tool_calls"), f"{case}: an empty answer: {got}"
    if case == "chat":
        assert "Paris" in got["text"], got  # a real model answers the question
    if case == "code-edit":
        assert "acc" in got["text"] and "def total" in got["text"], got
    if case == "json-schema":
        person = json.loads(got["text"])
        assert set(person) == {"name", "age"} and isinstance(person["age"], int), person
    if case == "tool-call":
        assert [name for name, _ in got["tool_calls"]] == ["get_weather"] and "city" in got["tool_calls"][0][1], got


@pytest.mark.parametrize("case", ["chat", "code-edit", "json-schema", "tool-call", "completion"])
def test_streamed_answers_equal_the_single_servers(real_stack, http, case):
    path, body = CASES[case]
    lanes = _lanes(real_stack)
    base, model, headers = lanes["single"]
    ref = _answer(path, http.post(base + path, json={**body, "model": model, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0}).json())
    for lane in ("native", "express"):
        base, model, headers = lanes[lane]
        got = _streamed(http, base + path, {**body, "model": model, "max_tokens": MAX_TOKENS, "temperature": 0},
                        headers)
        assert got["text"] == ref["text"], (lane, got, ref)
        assert got["tool_calls"] == ref.get("tool_calls", []), (lane, got, ref)
        assert got["finish_reason"] == ref["finish_reason"], (lane, got, ref)
