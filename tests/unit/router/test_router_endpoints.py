"""Endpoints beside completions (endpoints.py): model cards with vLLM's max_model_len, /tokenize, /detokenize and
/version passed to the prefill with the vLLM api key, the Responses API answered with a clear error."""

from __future__ import annotations

import asyncio

import httpx

from expresslane.router.server.secrets import RouterSecrets

from ._kit import PREFILL, make_config

VLLM_KEY = "vllm-secret-key-1"
SERVED = {"id": "served", "object": "model", "owned_by": "vllm", "root": "/models/tiny", "max_model_len": 4096}


def vllm_side(upstreams, seen_auth: list, base: str = PREFILL):
    def models(rq, body):
        seen_auth.append(rq.headers.get("authorization"))
        return httpx.Response(200, json={"object": "list", "data": [{"id": "other", "max_model_len": 1}, SERVED]})

    def tokenize(rq, body):
        seen_auth.append(rq.headers.get("authorization"))
        if body.get("model") != "served":
            return httpx.Response(404, json={"error": {"message": "model not found", "type": "NotFoundError",
                                                       "param": None, "code": 404}})
        if "prompt" not in body and "messages" not in body:
            return httpx.Response(400, json={"error": {"message": "prompt missing", "type": "BadRequestError",
                                                       "param": None, "code": 400}})
        return httpx.Response(200, json={"count": 2, "max_model_len": 4096, "tokens": [7, 8], "token_strs": None})

    def detokenize(rq, body):
        seen_auth.append(rq.headers.get("authorization"))
        return httpx.Response(200, json={"prompt": "hi" if body.get("tokens") == [7, 8] else "?"})

    def version(rq, body):
        seen_auth.append(rq.headers.get("authorization"))
        return httpx.Response(200, json={"version": "0.32.0"})

    upstreams.on(base, "/v1/models", models)
    upstreams.on(base, "/tokenize", tokenize)
    upstreams.on(base, "/detokenize", detokenize)
    upstreams.on(base, "/version", version)


SECRETS = RouterSecrets(vllm_api_key=VLLM_KEY)


async def test_models_list_and_retrieve_carry_max_model_len(make_client, upstreams):
    auth: list = []
    vllm_side(upstreams, auth)
    async with make_client(make_config(), secrets=SECRETS) as (c, _):
        listing = (await c.get("/v1/models")).json()
        card = await c.get("/v1/models/tiny-x")
        missing = await c.get("/v1/models/gpt-4")
    assert [m["id"] for m in listing["data"]] == ["tiny", "tiny-x", "tiny-xs"]
    assert {m["max_model_len"] for m in listing["data"]} == {4096}
    assert card.status_code == 200
    c_ = card.json()
    assert (c_["id"], c_["object"], c_["lane"], c_["max_model_len"], c_["root"]) == (
        "tiny-x", "model", "express", 4096, "served")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert "tiny-x" in missing.json()["error"]["message"]
    assert auth == [f"Bearer {VLLM_KEY}"]  # asked once, cached, with the vLLM key


async def test_retrieve_through_the_openai_sdk(make_client, upstreams):
    openai = __import__("pytest").importorskip("openai")
    vllm_side(upstreams, [])
    async with make_client(make_config(), secrets=SECRETS) as (c, app):
        sdk = openai.AsyncOpenAI(base_url="http://router/v1", api_key="unused", http_client=c, max_retries=0)
        m = await sdk.models.retrieve("tiny")
        assert m.id == "tiny" and m.model_extra["max_model_len"] == 4096
        try:
            await sdk.models.retrieve("nope")
            raise AssertionError("no error")
        except openai.NotFoundError as e:
            assert e.body["code"] == "model_not_found"


async def test_model_card_needs_the_prefill_but_the_listing_does_not(make_client, upstreams):
    upstreams.on(PREFILL, "/v1/models", lambda rq, b: httpx.Response(503, text="starting"))
    async with make_client() as (c, _):
        listing = await c.get("/v1/models")
        card = await c.get("/v1/models/tiny")
    assert listing.status_code == 200 and "max_model_len" not in listing.json()["data"][0]
    assert card.status_code == 503 and card.json()["error"]["type"] == "service_unavailable"


async def test_tokenize_and_detokenize_pass_through_with_the_served_name(make_client, upstreams):
    auth: list = []
    vllm_side(upstreams, auth)
    async with make_client(make_config(), secrets=SECRETS) as (c, _):
        t = await c.post("/tokenize", json={"model": "tiny-x", "prompt": "hi"})
        t_default = await c.post("/tokenize", json={"prompt": "hi"})
        d = await c.post("/detokenize", json={"model": "tiny", "tokens": [7, 8]})
        bad = await c.post("/tokenize", json={"model": "tiny"})
        unknown = await c.post("/tokenize", json={"model": "nope", "prompt": "hi"})
        not_obj = await c.post("/detokenize", content=b"[1, 2]")
    assert t.status_code == 200 and t.json()["tokens"] == [7, 8] and t_default.json()["count"] == 2
    assert d.json() == {"prompt": "hi"}
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "prompt missing"  # vLLM's own 4xx
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert not_obj.status_code == 400
    assert [b["model"] for b in upstreams.bodies(PREFILL, "/tokenize")] == ["served", "served", "served"]
    assert set(auth) == {f"Bearer {VLLM_KEY}"}


async def test_version_is_the_prefills_plus_the_routers(make_client, upstreams):
    vllm_side(upstreams, [])
    async with make_client() as (c, _):
        v = (await c.get("/version")).json()
    assert v["version"] == "0.32.0" and "router_version" in v


async def test_upstream_down_is_a_typed_503(make_client, upstreams):
    def refuse(rq, b):
        raise httpx.ConnectError("refused", request=rq)

    upstreams.on(PREFILL, "/tokenize", refuse)
    async with make_client() as (c, _):
        r = await c.post("/tokenize", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


# ---- with a prefill pool: a serving member, chosen and failed over as for prefill legs -----------------------------

P1, P2 = "http://prefill-a:8000", "http://prefill-b:8000"
SIDE_PATHS = ("/v1/models", "/tokenize", "/detokenize", "/version")


def refuse(rq, b):
    raise httpx.ConnectError("refused", request=rq)


async def test_side_calls_go_to_a_serving_pool_member_and_fail_over(make_client, upstreams):
    vllm_side(upstreams, [], base=P2)
    for path in SIDE_PATHS:
        upstreams.on(P1, path, refuse)  # member a is gone
    cfg = make_config(prefill={"model": "served", "nodes": [P1, P2]})
    async with make_client(cfg) as (c, app):
        toks = [await c.post("/tokenize", json={"model": "tiny", "prompt": f"prompt number {i}"}) for i in range(8)]
        card = await c.get("/v1/models/tiny")
        version = await c.get("/version")
        detok = await c.post("/detokenize", json={"tokens": [7, 8]})
        legs = app.state.metrics.registry.get_sample_value("expresslane_router_prefill_requests_total",
                                                           {"member": "prefill-b:8000", "choice": "affinity"})
    assert [t.status_code for t in toks] == [200] * 8, toks[0].text
    assert card.status_code == 200 and card.json()["max_model_len"] == 4096
    assert version.json()["version"] == "0.32.0" and detok.json()["prompt"] == "hi"
    assert len(upstreams.bodies(P2, "/tokenize")) == 8
    assert upstreams.bodies(P1, "/tokenize")  # some keys preferred a, were refused there and went on to b
    assert legs == 0  # side calls are not prefill legs


async def test_side_calls_with_no_serving_member_are_a_typed_503(make_client, upstreams):
    for base in (P1, P2):
        vllm_side(upstreams, [], base=base)
        upstreams.on(base, "/health", lambda rq, b: httpx.Response(503, json={"status": "down"}))
    upstreams.on("http://native:8100", "/health", lambda rq, b: httpx.Response(200, json={}))
    upstreams.on("http://express:5557", "/health", lambda rq, b: httpx.Response(200, json={}))
    cfg = make_config(prefill={"model": "served", "nodes": [P1, P2]},
                      health={"enabled": True, "interval_s": 0.02, "timeout_s": 0.5, "unhealthy_threshold": 1,
                              "healthy_panic_threshold": 0})
    async with make_client(cfg) as (c, app):
        for _ in range(200):
            if not any(app.state.health.healthy(u) for u in (P1, P2)):
                break
            await asyncio.sleep(0.01)
        answers = [await c.post("/tokenize", json={"prompt": "x"}), await c.post("/detokenize", json={"tokens": [1]}),
                   await c.get("/v1/models/tiny"), await c.get("/version")]
    for r in answers:
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        assert r.json()["error"]["type"] == "service_unavailable" and "prefill" in r.json()["error"]["message"]
    assert not any(p in SIDE_PATHS for _, p, _ in upstreams.calls)  # nothing was sent to a member known down


async def test_responses_api_is_a_clear_openai_error(make_client, upstreams):
    async with make_client() as (c, _):
        for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"),
                             ("DELETE", "/v1/responses/resp_1")):
            r = await c.request(method, path, json={"model": "tiny", "input": "hi"})
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["code"] == "unsupported_endpoint" and "/v1/chat/completions" in err["message"]
    assert upstreams.calls == []



async def test_a_silent_prefill_costs_a_model_card_the_connect_budget_not_prefill_s(model_text):
    """A real socket that accepts and never answers: the card fails with a typed 504 after timeouts.connect_s."""
    import socket
    import time

    from prometheus_client import CollectorRegistry

    from expresslane.router.app import create_app

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    try:
        cfg = make_config(prefill={"url": f"http://127.0.0.1:{port}", "model": "served"},
                          timeouts={"connect_s": 0.3, "prefill_s": 60, "decode_s": 60, "kv_wait_s": 3, "cancel_s": 1})
        app = create_app(cfg, registry=CollectorRegistry(), model_text=model_text)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
                t = time.monotonic()
                r = await c.get("/v1/models/tiny", timeout=30)
                took = time.monotonic() - t
    finally:
        silent.close()
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout", r.text
    assert took < 20  # bounded by connect_s (0.3 s), far from prefill_s (60 s)
