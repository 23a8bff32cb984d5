"""The router's front door against the real stack (stock vLLM prefill + native decode, our express node):
capability routing serves an express request that asks for a feature the node lacks on the native lane, exactly; model cards carry
vLLM's own max_model_len; /tokenize, /detokenize, /version pass through; unknown paths are OpenAI errors;
X-Request-Id comes back."""

from __future__ import annotations

import time

from exactness import EXPRESS_ALIAS, MAX_TOKENS, NATIVE_ALIAS, token_prompt


def _router_ready(http, router_url: str, bound_s: float = 30.0) -> dict:
    """The router's /ready once every upstream is up (a node that answered its first probe before it was ready
    stays ejected until a half-open probe re-admits it); the last body if it never says so within bound_s."""
    end, body = time.monotonic() + bound_s, {}
    while time.monotonic() < end:
        r = http.get(f"{router_url}/ready")
        body = r.json()
        if r.status_code == 200:
            break
        time.sleep(0.25)
    return body


def test_a_feature_the_express_node_lacks_is_served_natively_and_exactly(live_stack, http):
    """`bad_words` is native-only (vLLM takes words, the node takes ids): with `unsupported: native` the express
    alias serves it on the native lane, says so in headers and the reroute metric, and equals a single server.
    logprobs, which the express node now honours, stay on the express lane with the same tokens."""
    ready = _router_ready(http, live_stack.router_url)
    assert ready.get("status") == "ok" or all(u.get("healthy") for u in (ready.get("upstreams") or {}).values()), ready
    prompt = token_prompt(40, salt=31)
    body = {"model": EXPRESS_ALIAS, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "bad_words": ["zqzqzq"]}
    ref = http.post(f"{live_stack.prefill_url}/v1/completions",
                    json=dict(body, model="tiny-llama", logprobs=2)).json()["choices"][0]
    r = http.post(f"{live_stack.router_url}/v1/completions", json=body, headers={"X-Request-Id": "fd-int-1"})
    assert r.status_code == 200, r.text
    assert r.headers["x-expresslane-lane"] == "native"
    assert r.headers["x-expresslane-reroute"].startswith("unsupported_feature:bad_words")
    assert r.headers["x-request-id"] == "fd-int-1"
    assert r.json()["choices"][0]["text"] == ref["text"]
    metrics = http.get(f"{live_stack.router_url}/metrics").text
    assert f'expresslane_router_capability_reroutes_total{{alias="{EXPRESS_ALIAS}",feature="bad_words"}} 1.0' in metrics
    plain = {k: v for k, v in body.items() if k != "bad_words"}
    lp = http.post(f"{live_stack.router_url}/v1/completions", json=dict(plain, logprobs=2))
    assert lp.status_code == 200 and lp.headers["x-expresslane-lane"] == "express", lp.text
    assert lp.json()["choices"][0]["text"] == ref["text"]
    assert lp.json()["choices"][0]["logprobs"]["tokens"] == ref["logprobs"]["tokens"]


def test_model_cards_tokenizer_and_version_pass_through(live_stack, http):
    served = http.get(f"{live_stack.prefill_url}/v1/models").json()["data"][0]
    card = http.get(f"{live_stack.router_url}/v1/models/{EXPRESS_ALIAS}")
    assert card.status_code == 200 and card.json()["max_model_len"] == served["max_model_len"]
    assert card.json()["lane"] == "express"
    missing = http.get(f"{live_stack.router_url}/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    t = http.post(f"{live_stack.router_url}/tokenize", json={"model": NATIVE_ALIAS, "prompt": "hello world"})
    ref = http.post(f"{live_stack.prefill_url}/tokenize", json={"model": "tiny-llama", "prompt": "hello world"})
    assert t.status_code == 200 and t.json()["tokens"] == ref.json()["tokens"]
    d = http.post(f"{live_stack.router_url}/detokenize", json={"model": NATIVE_ALIAS, "tokens": t.json()["tokens"]})
    assert d.status_code == 200 and "hello world" in d.json()["prompt"]
    v = http.get(f"{live_stack.router_url}/version").json()
    assert v["version"] == http.get(f"{live_stack.prefill_url}/version").json()["version"]


def test_unknown_paths_and_the_responses_api_are_openai_errors(live_stack, http):
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("POST", "/v1/responses", 400)):
        r = http.request(method, f"{live_stack.router_url}{path}", json={"model": NATIVE_ALIAS, "input": "x"})
        assert r.status_code == status
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
