"""/pd/decode with structured_outputs and top_logprobs (docs/api.md "The express node's HTTP API"), served by uvicorn
over a real DecodeEngine of the tiny Llama (it has a tokenizer, so the node builds its xgrammar compiler)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from expresslane.engine.decode import DecodeEngine, SamplingParams
from expresslane.engine.decode.grammar import StructuredOutputSpec
from expresslane.engine.server import LocalKVSource, ServerConfig, create_app

from ._live import LiveServer
from .test_grammar_fixtures import (MAX_SEQ, PERSON, compiler, engine, first_token, prompt_ids,  # noqa: F401
                                    tiny_dir, tokenizer)


@pytest.fixture(scope="module")
def node(tiny_dir):
    served = DecodeEngine.from_pretrained(tiny_dir, max_seq_len=MAX_SEQ)  # speculation on (the default)
    source = LocalKVSource()
    app = create_app(ServerConfig(model=str(tiny_dir), max_seq_len=MAX_SEQ, kv_timeout_s=5.0), served, source)
    with LiveServer(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client, source


def ship(client, engine, source, rid, prompt, grammar=None) -> int:
    assert client.post("/pd/reserve", json={"rid": rid, "ttl_s": 5}).status_code == 200
    first = first_token(engine, prompt, grammar)
    n = len(prompt)
    assert source.put(rid, engine.cache.k[:, :n].clone(), engine.cache.v[:, :n].clone())
    return first


def expected(engine, compiler, prompt, first, spec, **sampling):
    grammar = compiler.matcher(compiler.compile(spec), engine.eos_token_ids) if spec else None
    engine.prefill(prompt)
    gen = engine.generate(first, len(prompt), SamplingParams(**sampling), grammar=grammar)
    list(gen)
    return gen


def wait_idle(client, within_s=2.0):
    t0 = time.monotonic()
    while client.get("/decode_status").json()["state"] != "idle":
        assert time.monotonic() - t0 < within_s, "node still busy"
        time.sleep(0.01)


def test_capabilities_announce_logprobs_and_structured_output(node):
    client, _ = node
    caps = client.get("/capabilities").json()
    assert caps["features"]["logprobs"] and caps["features"]["top_logprobs"] and caps["features"]["structured_output"]
    assert caps["max_top_logprobs"] == 20 and caps["structured_output_backend"] == "xgrammar"


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_with_logprobs_over_http(node, engine, compiler, tokenizer, stream):
    client, source = node
    rid = f"g-{stream}"
    prompt = prompt_ids(tokenizer)
    spec = StructuredOutputSpec.from_params(json=PERSON)
    first = ship(client, engine, source, rid, prompt, compiler.matcher(compiler.compile(spec), engine.eos_token_ids))
    body = {"rid": rid, "first_token_id": first, "max_tokens": 150, "stream": stream, "top_logprobs": 2,
            "sampling": {"temperature": 0}, "structured_outputs": {"json": PERSON}}
    want = expected(engine, compiler, prompt, first, spec, max_tokens=150, temperature=0.0, logprobs=2)
    if stream:
        with client.stream("POST", "/pd/decode", json=body) as r:
            assert r.status_code == 200
            lines = [json.loads(x) for x in r.iter_lines() if x.strip()]
        done = lines[-1]
        assert done["done"] and done["finish_reason"] == "stop"
        ids = [t for ln in lines[:-1] for t in ln["t"]]
        lps = [x for ln in lines[:-1] for x in ln["lp"]]
        tps = [x for ln in lines[:-1] for x in ln["tp"]]
        assert all(len(ln["t"]) == len(ln["lp"]) == len(ln["tp"]) for ln in lines[:-1])
    else:
        r = client.post("/pd/decode", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["finish_reason"] == "stop"
        ids, lps, tps = out["token_ids"], out["logprobs"], out["top_logprobs"]
    assert ids == want.token_ids and ids[0] == first
    assert lps[0] is None and tps[0] is None
    assert lps[1:] == pytest.approx(want.logprobs[1:], abs=1e-4)  # served with speculation: verify rows round apart
    assert [[t for t, _ in row] for row in tps[1:]] == [[t for t, _ in row] for row in want.top_logprobs[1:]]
    # masked alternatives (-inf) travel as vLLM's clamp, -9999.0: JSON has no infinity
    assert min(v for row in tps[1:] for _, v in row) == -9999.0
    json.loads(tokenizer.decode(ids[:-1]))
    wait_idle(client)


def test_no_logprobs_keys_without_top_logprobs(node, engine, tokenizer):
    client, source = node
    prompt = prompt_ids(tokenizer)
    first = ship(client, engine, source, "plain", prompt)
    out = client.post("/pd/decode", json={"rid": "plain", "first_token_id": first, "max_tokens": 5,
                                          "sampling": {"temperature": 0, "ignore_eos": True}}).json()
    assert "logprobs" not in out and "top_logprobs" not in out and len(out["token_ids"]) == 5
    wait_idle(client)


@pytest.mark.parametrize("so, needle", [
    ({"json": "{not json"}, "Invalid JSON"),
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"choice": ["yes"]}, "first_token_id"),  # the grammar refuses the first token
])
def test_bad_spec_is_400_invalid_parameter_before_the_kv_wait(node, tokenizer, so, needle):
    client, _ = node
    rid = f"bad-{needle}"
    assert client.post("/pd/reserve", json={"rid": rid, "ttl_s": 5}).status_code == 200
    first = tokenizer.encode("no", add_special_tokens=False)[0]
    t0 = time.monotonic()
    # no KV is ever shipped: an answer at all proves the node did not wait for it (kv_timeout_s is 5 s)
    r = client.post("/pd/decode", json={"rid": rid, "first_token_id": first, "max_tokens": 8, "timeout_s": 5,
                                        "structured_outputs": so})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["error"] == "invalid_parameter" and needle in err["detail"] and needle in err["message"]
    assert time.monotonic() - t0 < 4.0
    assert client.get("/decode_status").json()["state"] == "idle"  # the reservation is given up


def test_unknown_structured_output_keys_are_refused(node):
    client, _ = node
    r = client.post("/pd/decode", json={"rid": "u", "first_token_id": 1, "max_tokens": 4,
                                        "structured_outputs": {"json_schema": {"type": "object"}}})
    assert r.status_code == 400 and "json_schema" in r.json()["message"]
