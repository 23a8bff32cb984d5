"""Native lane end to end: router -> stock vLLM prefill (MultiConnector) -> stock vLLM NixlConnector decode.

Reference for exactness: the prefill server's own greedy answer to the whole request.
"""

from __future__ import annotations

import httpx
import pytest

from exactness import (
    MAX_TOKENS,
    NATIVE_ALIAS,
    PROMPT_LENGTHS,
    chat,
    chat_messages,
    completion,
    stream_text,
    token_prompt,
)


def _reference_completion(http, stack, prompt):
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    return completion(http, stack.prefill_url, body)["choices"][0]


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_native_completions_match_single_server(live_stack, http, length):
    prompt = token_prompt(length)
    ref = _reference_completion(http, live_stack, prompt)
    body = {"model": NATIVE_ALIAS, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    got = completion(http, live_stack.router_url, body)
    assert got["model"] == NATIVE_ALIAS
    assert got["choices"][0]["text"] == ref["text"]
    assert got["choices"][0].get("token_ids") == ref["token_ids"]
    assert got["usage"]["prompt_tokens"] == length
    assert got["usage"]["completion_tokens"] == len(ref["token_ids"])
    streamed, chunks = stream_text(http, live_stack.router_url, "/v1/completions", body)
    assert streamed == ref["text"]
    assert all(c["model"] == NATIVE_ALIAS for c in chunks)


@pytest.mark.parametrize("words", [1, 30, 200, 450])
def test_native_chat_matches_single_server(live_stack, http, words):
    messages = chat_messages(words, salt=words)
    ref = chat(http, live_stack.prefill_url,
               {"model": "tiny-llama", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
    ref_text = ref["choices"][0]["message"]["content"]
    body = {"model": NATIVE_ALIAS, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    got = chat(http, live_stack.router_url, body)
    assert got["choices"][0]["message"]["content"] == ref_text
    assert got["usage"] == ref["usage"]
    streamed, chunks = stream_text(
        http, live_stack.router_url, "/v1/chat/completions",
        dict(body, stream_options={"include_usage": True}))
    assert streamed == ref_text
    assert chunks[-1]["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
    assert chunks[-1]["choices"] == []


def test_models_lists_every_alias_with_its_lane(live_stack, http):
    r = http.get(f"{live_stack.router_url}/v1/models")
    assert r.status_code == 200
    lanes = {m["id"]: m["lane"] for m in r.json()["data"]}
    assert lanes.get("tiny-llama") == "native"
    assert lanes.get("tiny-llama-express") == "express"


def test_openai_sdk_works_unchanged(live_stack):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{live_stack.router_url}/v1", api_key="unused", max_retries=0)
    models = [m.id for m in client.models.list()]
    assert NATIVE_ALIAS in models
    chat_resp = client.chat.completions.create(
        model=NATIVE_ALIAS, messages=[{"role": "user", "content": "hello there"}], max_tokens=8, temperature=0)
    assert chat_resp.choices[0].message.content
    assert chat_resp.usage.completion_tokens == 8
    comp = client.completions.create(model=NATIVE_ALIAS, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert comp.choices[0].text
    assert comp.usage.total_tokens == comp.usage.prompt_tokens + comp.usage.completion_tokens
    pieces, usage = [], None
    for chunk in client.chat.completions.create(
            model=NATIVE_ALIAS, messages=[{"role": "user", "content": "hello there"}], max_tokens=8,
            temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == chat_resp.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 8


@pytest.mark.parametrize(
    "path,raw,status,needle",
    [
        ("/v1/completions", b"{not json", 400, "json"),
        ("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": "many"}', 400, "max_tokens"),
        ("/v1/completions", b'{"model": "no-such-model", "prompt": "hi"}', 404, "no-such-model"),
        ("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
        ("/v1/chat/completions", b'{"model": "tiny-llama", "messages": "not a list"}', 400, "messages"),
    ],
)
def test_bad_input_gets_openai_style_4xx(live_stack, http, path, raw, status, needle):
    r = http.post(f"{live_stack.router_url}{path}", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower()
    assert isinstance(err["type"], str) and err["type"]


def test_prompt_longer_than_context_is_a_clear_400(live_stack, http):
    body = {"model": NATIVE_ALIAS, "prompt": token_prompt(5000), "max_tokens": 4}
    r = http.post(f"{live_stack.router_url}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "context" in err["message"].lower() or "length" in err["message"].lower()
