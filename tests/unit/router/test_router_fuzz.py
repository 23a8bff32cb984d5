"""Property test: random and malformed requests (paths, methods, headers, bodies) thrown at the router app
in-process never get a 5xx, never hang, and every error is an OpenAI-shaped JSON body.

The fake upstreams answer like vLLM refusing the request (400), or serve it (native and express replies), so
the router's own parsing, limits, auth, lane and capability code are what is exercised."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from expresslane.router.app import create_app
from expresslane.router.server.secrets import RouterSecrets

from ._kit import EXPRESS, NATIVE, PREFILL, make_config, ndjson

KEY = "sk-fuzz-0123456789"
SCALE = float(os.environ.get("EXPRESSLANE_FUZZ_SCALE", "1"))  # e.g. 10 for a deeper run: more examples each
KVP = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [1], "remote_host": "p",
       "remote_port": 5600}


def _upstream(request: httpx.Request) -> httpx.Response:
    try:
        body = json.loads(request.content) if request.content else {}
    except ValueError:
        body = {}
    path = request.url.path
    if request.url.host == "prefill":
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served", "max_model_len": 64}]})
        if path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if path in ("/tokenize", "/detokenize") or body.get("temperature") == 0.5:
            return httpx.Response(400, json={"error": {"message": "vllm says no", "type": "BadRequestError",
                                                       "param": None, "code": 400}})
        choice = {"index": 0, "text": "x", "finish_reason": "length", "token_ids": [5], "prompt_token_ids": [1, 2]}
        return httpx.Response(200, json={"id": "cmpl-1", "choices": [choice], "prompt_token_ids": [1, 2],
                                         "usage": {"prompt_tokens": 2, "completion_tokens": 1},
                                         "kv_transfer_params": KVP})
    if request.url.host == "native":
        if body.get("stream"):
            return httpx.Response(200, content=b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n',
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"id": "cmpl-n", "choices": [{"text": "a"}],
                                         "usage": {"prompt_tokens": 2, "completion_tokens": 1}})
    if path == "/pd/decode":
        if body.get("stream"):
            return httpx.Response(200, content=ndjson({"t": [5, 6]}, {"done": True, "finish_reason": "length"}))
        return httpx.Response(200, json={"token_ids": [5, 6], "finish_reason": "length"})
    if path == "/capabilities":
        return httpx.Response(200, json={"features": {"seed": True, "penalties": True}})
    return httpx.Response(200, json={})


_scalar = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20)
_json = st.recursive(_scalar, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                                       max_size=4), max_leaves=20)
_fields = st.sampled_from(["model", "prompt", "messages", "stream", "max_tokens", "max_completion_tokens", "n",
                           "stop", "stream_options", "logprobs", "top_logprobs", "echo", "response_format", "tools",
                           "tool_choice", "seed", "temperature", "min_p", "logit_bias", "stop_token_ids",
                           "min_tokens", "repetition_penalty", "frequency_penalty", "guided_json", "best_of",
                           "return_token_ids", "skip_special_tokens", "include_stop_str_in_output", "ignore_eos"])
_values = st.sampled_from(["tiny", "tiny-x", "tiny-xs", "nope", 0.5, 0, 1, 2, -1, True, False, None, "hi", [1, 2],
                           ["a"], {"type": "json_object"}, {"include_usage": True}, [{"role": "user", "content": "q"}],
                           [{"type": "function", "function": {"name": "f"}}], "none", 1e300, {}]) | _json
_request_dict = st.dictionaries(_fields, _values, max_size=8)
_body = st.one_of(
    st.binary(max_size=300),
    _json.map(lambda v: json.dumps(v).encode()),
    _request_dict.map(lambda d: json.dumps(d).encode()),
    st.tuples(_request_dict, st.integers(1, 200)).map(
        lambda t: json.dumps(t[0]).encode()[:-1] + b', "z": ' + b"[" * t[1] + b"]" * t[1] + b"}" if t[0] else b"{}"),
    st.integers(0, 30).map(lambda n: b'{"model": "tiny", "prompt": "' + b"\\u" * n + b'"}'),
)
_known_paths = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/tiny",
                                "/v1/models/nope/x", "/tokenize", "/detokenize", "/version", "/v1/responses",
                                "/v1/responses/r1", "/health", "/metrics", "/", "/v1", "/v1/completions/",
                                "//v1//completions", "/v1/embeddings"])
_paths = st.one_of(_known_paths, _known_paths, _known_paths, st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#"), max_size=30).map(
    lambda p: "/" + p))
_methods = st.sampled_from(["POST", "POST", "GET", "GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
_header_value = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
_auth = st.one_of(st.just(f"Bearer {KEY}"), st.just(f"Bearer {KEY}"), st.sampled_from(
    ["Bearer", "bearer  " + KEY, "Basic x", "", f"Bearer {KEY}x"]), _header_value)
_headers = st.fixed_dictionaries({"authorization": _auth}, optional={
    "content-type": st.sampled_from(["application/json", "text/plain", "multipart/form-data; boundary=x"])
    | _header_value,
    "x-lane": st.sampled_from(["native", "express", "EXPRESS ", "fast", ""]) | _header_value,
    "content-length": st.sampled_from(["0", "5", "-1", "abc", "99999999999", "1e3"]),
    "accept": _header_value,
    "transfer-encoding": st.sampled_from(["chunked", "gzip", "identity"]),
})


class _Harness:
    """One app (lifespan running) on one event loop for all examples."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer, models, pre_tokenizers

        from expresslane.router.openai.detokenizer import ModelText

        tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3, "d": 4, "x": 5, "y": 6},
                                         unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        cfg = make_config(limits={"max_body_bytes": 4096, "max_json_depth": 32})
        self.app = create_app(cfg, transport=httpx.MockTransport(_upstream), registry=CollectorRegistry(),
                              model_text=ModelText(tok, frozenset({0}), {}),
                              secrets=RouterSecrets(api_keys_text=f"{KEY}\nsk-fuzz-slow-00000 rps=1000"))
        self.loop = asyncio.new_event_loop()
        self._lifespan = self.app.router.lifespan_context(self.app)
        self.loop.run_until_complete(self._lifespan.__aenter__())
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://router")

    def request(self, method: str, path: str, headers: dict, body: bytes) -> httpx.Response:
        async def go() -> httpx.Response:
            req = self.client.build_request(method, path, headers=headers, content=body)
            # the Content-Length a client claims is part of what is fuzzed
            if "content-length" in headers:
                req.headers["content-length"] = headers["content-length"]
            return await asyncio.wait_for(self.client.send(req), timeout=10)
        return self.loop.run_until_complete(go())

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.run_until_complete(self._lifespan.__aexit__(None, None, None))
        self.loop.close()


_H: _Harness | None = None


def harness() -> _Harness:
    global _H
    if _H is None:
        _H = _Harness()
    return _H


def teardown_module() -> None:
    if _H is not None:
        _H.close()


def _check(r: httpx.Response, method: str) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400 and method != "HEAD":
        body = r.json()
        assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
        assert "detail" not in body


@settings(max_examples=int(400 * SCALE), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_methods, _paths, _headers, _body)
def test_random_requests_never_get_a_5xx_or_hang(method, path, headers, body):
    r = harness().request(method, path, headers, body)
    _check(r, method)


@settings(max_examples=int(300 * SCALE), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]), _body,
       st.sampled_from([None, "native", "express", "bogus"]))
def test_random_bodies_with_a_valid_key_never_get_a_5xx(path, body, x_lane):
    headers = {"authorization": f"Bearer {KEY}"}
    if x_lane:
        headers["x-lane"] = x_lane
    r = harness().request("POST", path, headers, body)
    _check(r, "POST")


@settings(max_examples=int(300 * SCALE), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), _request_dict,
       st.sampled_from([None, "native", "express"]), st.booleans())
def test_random_completion_requests_with_a_valid_key_never_get_a_5xx(path, body, x_lane, chat_shape):
    if chat_shape:
        body.setdefault("messages", [{"role": "user", "content": "a b"}])
    else:
        body.setdefault("prompt", "a b")
    body.setdefault("model", "tiny-x")
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    if x_lane:
        headers["x-lane"] = x_lane
    r = harness().request("POST", path, headers, json.dumps(body).encode())
    _check(r, "POST")
