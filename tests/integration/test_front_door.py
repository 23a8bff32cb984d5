"""The router's front door against the real stack (stock vLLM prefill + native decode, our express node):
capability routing serves an express request that asks for logprobs on the native lane, exactly; model cards carry
vLLM's own max_model_len; /tokenize, /detokenize, /version pass through; unknown paths are OpenAI errors;
X-Request-Id comes back."""

from __future__ import annotations

from exactness import EXPRESS_ALIAS, MAX_TOKENS, NATIVE_ALIAS, token_prompt


def test_express_request_with_logprobs_is_served_natively_and_exactly(live_stack, http):
    prompt = token_prompt(40, salt=31)
    body = {"model": EXPRESS_ALIAS, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2}
    ref = http.post(f"{live_stack.prefill_url}/v1/completions", json=dict(body, model="tiny-llama")).json()
    r = http.post(f"{live_stack.router_url}/v1/completions", json=body, headers={"X-Request-Id": "fd-int-1"})
    assert r.status_code == 200, r.text
    assert r.headers["x-expresslane-lane"] == "native"
    assert r.headers["x-expresslane-reroute"].startswith("unsupported_feature:logprobs")
    assert r.headers["x-request-id"] == "fd-int-1"
    got = r.json()["choices"][0]
    assert got["text"] == ref["choices"][0]["text"]
    assert got["logprobs"]["tokens"] == ref["choices"][0]["logprobs"]["tokens"]
    metrics = http.get(f"{live_stack.router_url}/metrics").text
    assert f'expresslane_router_capability_reroutes_total{{alias="{EXPRESS_ALIAS}",feature="logprobs"}} 1.0' in metrics
    plain = http.post(f"{live_stack.router_url}/v1/completions", json={k: v for k, v in body.items() if k != "logprobs"})
    assert plain.headers["x-expresslane-lane"] == "express"
    assert plain.json()["choices"][0]["text"] == got["text"]


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
