"""Capability routing (capabilities.py): express requests that ask for what their pool cannot honour are served by
the native lane (header + metric) or refused with a 400 naming the feature; the node's /capabilities `features`
map is fetched with the node token and cached; docs/api.md's table is the same data."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from expresslane.router.fleet.capabilities import (EXPRESSLANE_ENGINE, FEATURES, NATIVE, TILERT, compat_table,
                                             features_from_node, requested_features)
from expresslane.router.server.secrets import RouterSecrets

from ._kit import EXPRESS, NATIVE as NATIVE_URL, PREFILL, make_config, ndjson

REPO = Path(__file__).resolve().parents[3]
KVP = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [1], "remote_host": "p",
       "remote_port": 5600}
NODE_TOKEN = "node-token-abcdef"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Stack:
    """Fake prefill (serves both lanes' prefill legs), native decode, and an express node with /capabilities."""

    def __init__(self, upstreams, tokenizer, features: dict | None):
        self.up = upstreams
        self.features = features
        self.cap_calls: list[str | None] = []
        self.ids = tokenizer.encode(" hello world").ids
        for path in ("/v1/completions", "/v1/chat/completions"):
            upstreams.on(PREFILL, path, self.prefill)
            upstreams.on(NATIVE_URL, path, self.native)
        upstreams.on(EXPRESS, "/pd/decode", self.decode)
        upstreams.on(EXPRESS, "/pd/cancel", lambda rq, b: httpx.Response(200, json={}))
        upstreams.on(EXPRESS, "/capabilities", self.capabilities)

    def prefill(self, rq, body):
        choice = {"index": 0, "text": "x", "finish_reason": "length", "token_ids": [self.ids[0]],
                  "prompt_token_ids": [1, 2, 3]}
        return httpx.Response(200, json={"id": "cmpl-p", "choices": [choice], "prompt_token_ids": [1, 2, 3],
                                         "usage": {"prompt_tokens": 3, "completion_tokens": 1},
                                         "kv_transfer_params": KVP})

    def native(self, rq, body):
        return httpx.Response(200, json={"id": "cmpl-native", "choices": [{"index": 0, "text": "native text",
                                                                           "finish_reason": "length"}],
                                         "usage": {"prompt_tokens": 3, "completion_tokens": 2}})

    def decode(self, rq, body):
        ids = self.ids[: body["max_tokens"]]
        if body["stream"]:
            return httpx.Response(200, content=ndjson({"t": ids}, {"done": True, "finish_reason": "length"}))
        return httpx.Response(200, json={"token_ids": ids, "finish_reason": "length"})

    def capabilities(self, rq, body):
        self.cap_calls.append(rq.headers.get("authorization"))
        if self.features is None:
            return httpx.Response(503, json={"error": "not_ready"})
        return httpx.Response(200, json={"model": "tiny", "sampling": [], "features": self.features})

    def served_by(self) -> list[str]:
        out = []
        for base, path, _ in self.up.calls:
            if base == NATIVE_URL:
                out.append("native")
            elif path == "/pd/decode":
                out.append("express")
        return out


NODE_FEATURES = {"logprobs": False, "top_logprobs": False, "structured_output": False, "tools": False, "n": False,
                 "echo": False, "prompt_logprobs": False, "logit_bias": False, "min_p": False,
                 "stop_token_ids": True, "min_tokens": True, "penalties": True, "seed": False, "speculative": False}
REQ = {"model": "tiny-xs", "prompt": "hi", "max_tokens": 2, "temperature": 0}
SECRETS = RouterSecrets(express_node_token=NODE_TOKEN)


@pytest.fixture
def stack(upstreams, tokenizer):
    return Stack(upstreams, tokenizer, dict(NODE_FEATURES))


def reroutes(app, alias: str, feature: str) -> float:
    v = app.state.metrics.registry.get_sample_value("expresslane_router_capability_reroutes_total",
                                                    {"alias": alias, "feature": feature})
    return v or 0.0


@pytest.mark.parametrize("extra,feature", [
    ({"logprobs": 2}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "structured_output"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "any_text"}}}, "structural_tag"),
    ({"logprob_token_ids": [3]}, "logprob_token_ids"),
    ({"bad_words": ["x"]}, "bad_words"),
    ({"prompt_logprobs": 0}, "prompt_logprobs"),
    ({"min_p": 0.1}, "min_p"),
    ({"seed": 7}, "seed"),  # the node says seed: false (the relay would carry it)
])
async def test_unsupported_feature_is_served_natively_with_header_and_metric(make_client, stack, extra, feature):
    async with make_client(make_config(), secrets=SECRETS) as (c, app):
        r = await c.post("/v1/completions", json=dict(REQ, **extra))
        assert r.status_code == 200, r.text
        assert r.headers["x-expresslane-lane"] == "native"
        assert feature in r.headers["x-expresslane-reroute"].split(":", 1)[1].split(",")
        assert r.json()["choices"][0]["text"] == "native text"
        assert reroutes(app, "tiny-xs", feature) == 1
    assert stack.served_by() == ["native"]


async def test_optional_sampling_keys_go_express_when_the_node_announces_them(make_client, upstreams, tokenizer):
    st = Stack(upstreams, tokenizer, dict(NODE_FEATURES, min_p=True, logit_bias=True))
    async with make_client(make_config(), secrets=SECRETS) as (c, app):
        r = await c.post("/v1/completions", json=dict(REQ, min_p=0.1, logit_bias={"5": 1.0}))
        r0 = await c.post("/v1/completions", json=dict(REQ, min_p=0, logit_bias={}))
    assert r.headers["x-expresslane-lane"] == "express" == r0.headers["x-expresslane-lane"]
    dec, dec0 = st.up.bodies(EXPRESS, "/pd/decode")
    assert (dec["sampling"]["min_p"], dec["sampling"]["logit_bias"]) == (0.1, {"5": 1.0})
    assert "min_p" not in dec0["sampling"] and "logit_bias" not in dec0["sampling"]  # neutral: not sent


async def test_legacy_guided_fields_are_ignored_as_vllm_032_ignores_them(make_client, stack):
    async with make_client(make_config(), secrets=SECRETS) as (c, app):
        r = await c.post("/v1/completions", json=dict(REQ, guided_regex="a+", guided_json={"type": "object"}))
    assert r.status_code == 200 and r.headers["x-expresslane-lane"] == "express"
    (dec,) = stack.up.bodies(EXPRESS, "/pd/decode")
    assert "structured_outputs" not in dec


async def test_tools_with_auto_go_native_and_tool_choice_none_stays_express(make_client, stack):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    chat = {"model": "tiny-xs", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools}
    async with make_client(make_config(), secrets=SECRETS) as (c, app):
        auto = await c.post("/v1/chat/completions", json=chat)
        required = await c.post("/v1/chat/completions", json=dict(chat, tool_choice="required"))
        none = await c.post("/v1/chat/completions", json=dict(chat, tool_choice="none"))
        assert reroutes(app, "tiny-xs", "tools") == 2
    assert [r.headers["x-expresslane-lane"] for r in (auto, required, none)] == ["native", "native", "express"]
    assert stack.served_by() == ["native", "native", "express"]


async def test_supported_requests_stay_express_and_say_so(make_client, stack):
    async with make_client(make_config(), secrets=SECRETS) as (c, app):
        r = await c.post("/v1/completions", json=dict(REQ, repetition_penalty=1.2, min_tokens=1,
                                                      stop_token_ids=[3], logprobs=None, seed=None))
        s = await c.post("/v1/completions", json=dict(REQ, stream=True))
    assert r.status_code == 200 and r.headers["x-expresslane-lane"] == "express"
    assert "x-expresslane-reroute" not in r.headers
    assert s.headers["x-expresslane-lane"] == "express" and s.text.endswith("data: [DONE]\n\n")
    assert stack.served_by() == ["express", "express"]


async def test_refuse_policy_is_a_400_naming_the_feature(make_client, stack):
    async with make_client(make_config(), secrets=SECRETS) as (c, app):
        r = await c.post("/v1/completions", json=dict(REQ, model="tiny-x", seed=1))
        j = await c.post("/v1/chat/completions", json={"model": "tiny-x", "messages": [{"role": "user", "content": "q"}],
                                                       "response_format": {"type": "json_object"}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("unsupported_feature", "seed") and "'seed'" in err["message"]
    assert "unsupported: refuse" in err["message"]
    assert j.status_code == 400 and j.json()["error"]["param"] == "response_format"
    assert stack.served_by() == []


async def test_explicit_x_lane_express_is_never_rerouted(make_client, stack):
    async with make_client(make_config(), secrets=SECRETS) as (c, _):
        r = await c.post("/v1/completions", json=dict(REQ, model="tiny", seed=1), headers={"X-Lane": "express"})
        ok = await c.post("/v1/completions", json=dict(REQ, model="tiny"), headers={"X-Lane": "express"})
    assert r.status_code == 400 and "X-Lane: express" in r.json()["error"]["message"]
    assert ok.status_code == 200 and ok.headers["x-expresslane-lane"] == "express"


async def test_node_capabilities_are_fetched_with_the_token_cached_and_refreshed(make_client, stack):
    clock = Clock()
    cfg = make_config(capabilities={"refresh_s": 60, "retry_s": 5})
    async with make_client(cfg, secrets=SECRETS, clock=clock) as (c, _):
        assert (await c.post("/v1/completions", json=dict(REQ, seed=1))).headers["x-expresslane-lane"] == "native"
        assert (await c.post("/v1/completions", json=dict(REQ, seed=2))).headers["x-expresslane-lane"] == "native"
        assert (await c.post("/v1/completions", json=REQ)).status_code == 200  # no optional feature: no lookup
        assert stack.cap_calls == [f"Bearer {NODE_TOKEN}"]
        stack.features["seed"] = True  # the node now honours seeds: seen after refresh_s
        clock.t += 30
        assert (await c.post("/v1/completions", json=dict(REQ, seed=3))).headers["x-expresslane-lane"] == "native"
        clock.t += 31
        assert (await c.post("/v1/completions", json=dict(REQ, seed=4))).headers["x-expresslane-lane"] == "express"
        assert len(stack.cap_calls) == 2


async def test_a_node_that_cannot_be_asked_is_taken_as_this_routers_engine_and_asked_again(make_client, stack,
                                                                                            caplog):
    stack.features = None  # /capabilities answers 503
    clock = Clock()
    async with make_client(make_config(), secrets=SECRETS, clock=clock) as (c, _):
        # EXPRESSLANE_ENGINE honours seed; logprobs never
        assert (await c.post("/v1/completions", json=dict(REQ, seed=1))).headers["x-expresslane-lane"] == "express"
        assert (await c.post("/v1/completions", json=dict(REQ, seed=1))).headers["x-expresslane-lane"] == "express"
        assert len(stack.cap_calls) == 1
        stack.features = dict(NODE_FEATURES)
        clock.t += 6  # retry_s (default 5) after a failure
        assert (await c.post("/v1/completions", json=dict(REQ, seed=1))).headers["x-expresslane-lane"] == "native"
    assert len(stack.cap_calls) == 2
    assert "capabilities unknown" in caplog.text


async def test_tilert_pools_use_the_static_table(make_client, stack):
    cfg = make_config(pools={
        "native": {"kind": "native", "nodes": [NATIVE_URL]},
        "express": {"kind": "tilert", "nodes": [{"url": EXPRESS, "ctrl_host": "h", "ctrl_port": 1}]}})
    async with make_client(cfg, secrets=SECRETS) as (c, app):
        seed = await c.post("/v1/completions", json=dict(REQ, seed=1, presence_penalty=0.5))
        mt = await c.post("/v1/completions", json=dict(REQ, min_tokens=2))
        fp = await c.post("/v1/completions", json=dict(REQ, frequency_penalty=0.5))
        assert reroutes(app, "tiny-xs", "min_tokens") == 1 and reroutes(app, "tiny-xs", "frequency_penalty") == 1
    assert [r.headers["x-expresslane-lane"] for r in (seed, mt, fp)] == ["express", "native", "native"]
    assert stack.cap_calls == []  # TileRT is never asked


async def test_metric_zeros_exist_for_express_aliases(make_client, stack):
    async with make_client(make_config(), secrets=SECRETS) as (c, _):
        text = (await c.get("/metrics")).text
    assert 'expresslane_router_capability_reroutes_total{alias="tiny-xs",feature="logprobs"} 0.0' in text
    assert 'alias="tiny",' not in text.split("capability_reroutes_total", 1)[1].split("# HELP", 1)[0]


# ---- the feature data itself ------------------------------------------------------------------------

@pytest.mark.parametrize("body,chat,want", [
    ({"logprobs": True, "top_logprobs": 3}, True, ["logprobs", "top_logprobs"]),
    ({"logprobs": False, "top_logprobs": 0}, True, []),
    ({"logprobs": 0}, False, ["logprobs"]),
    ({"logprobs": 2}, False, ["logprobs", "top_logprobs"]),
    ({"response_format": {"type": "text"}}, True, []),
    ({"response_format": {"type": "json_object"}}, True, ["structured_output"]),
    ({"structured_outputs": {"choice": ["a", "b"]}}, False, ["structured_output"]),
    ({"tools": [], "tool_choice": "auto"}, True, []),
    ({"n": 1, "best_of": 1, "seed": None, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0}, False, []),
    ({"n": 2}, False, ["n"]),
    ({"min_p": "abc"}, False, ["min_p"]),  # an odd type counts as asked: the native lane's vLLM judges it
    ({"bad_words": ["x"], "allowed_token_ids": [1]}, False, ["bad_words", "allowed_token_ids"]),
])
def test_requested_features(body, chat, want):
    assert requested_features(body, chat) == want


def test_node_features_map_to_router_features():
    f = features_from_node({"penalties": True, "seed": "yes", "unknown_key": True})
    assert f["repetition_penalty"] and f["presence_penalty"] and f["frequency_penalty"]
    assert not f["seed"] and set(f) == {x.name for x in FEATURES}  # only a JSON true counts


def _contract2_engine():
    """The engine's node app and sampler, once they implement CONTRACTS2's /pd/decode additions (api-engine's
    side of issue 13; until that side is merged into a branch, EXPRESSLANE_ENGINE is ahead of its engine)."""
    app = pytest.importorskip("expresslane.engine.server.app")
    if not hasattr(app, "MAX_TOP_LOGPROBS"):
        pytest.skip("this branch's engine predates the CONTRACTS2 node additions (api-engine's side not merged)")
    return app, pytest.importorskip("expresslane.engine.decode.sampling")


def test_expresslane_engine_table_matches_the_engines_sampler():
    _, sampling = _contract2_engine()
    honoured = set(sampling.HONOURED_SAMPLING_OPTIONS)
    for name in ("seed", "stop_token_ids", "min_tokens", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "min_p", "logit_bias", "bad_words", "allowed_token_ids"):
        assert EXPRESSLANE_ENGINE[name] == (name in honoured), name


def test_expresslane_engine_table_is_what_the_node_announces():
    app, _ = _contract2_engine()
    assert features_from_node(app.FEATURES) == EXPRESSLANE_ENGINE


def test_docs_api_md_table_is_the_capability_data():
    text = (REPO / "docs" / "api.md").read_text()
    m = re.search(r"<!-- compat-table:begin[^>]*-->\n(.*?)<!-- compat-table:end -->", text, re.S)
    assert m, "docs/api.md lacks the compat-table markers"
    assert m.group(1) == compat_table(), "docs/api.md's table is stale: paste capabilities.compat_table()"
    assert NATIVE["logprobs"] and not TILERT["logprobs"] and not NATIVE["n"]
