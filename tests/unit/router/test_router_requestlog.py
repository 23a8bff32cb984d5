"""X-Request-Id (requestlog.py): accepted or made, returned, passed to both legs of both lanes, in access logs;
the JSON log format."""

from __future__ import annotations

import asyncio
import re
import json
import logging

import httpx

from expresslane.router.server.requestlog import JsonFormatter, RequestIdFilter

from ._kit import EXPRESS, NATIVE, PREFILL, make_config, ndjson

KVP = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [1], "remote_host": "p",
       "remote_port": 5600}


def fake(upstreams, tokenizer, seen: list):
    ids = tokenizer.encode(" hello").ids

    async def prefill(rq, body):
        seen.append(("prefill", rq.headers.get("x-request-id")))
        await asyncio.sleep(0.01)  # let concurrent requests interleave
        choice = {"index": 0, "text": "x", "finish_reason": "length", "token_ids": [ids[0]], "prompt_token_ids": [1]}
        return httpx.Response(200, json={"id": "cmpl-p", "choices": [choice], "prompt_token_ids": [1],
                                         "usage": {"prompt_tokens": 1, "completion_tokens": 1},
                                         "kv_transfer_params": KVP})

    async def native(rq, body):
        seen.append(("native", rq.headers.get("x-request-id")))
        return httpx.Response(200, json={"id": "cmpl-n", "choices": [{"index": 0, "text": "n"}],
                                         "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    def decode(rq, body):
        seen.append(("express", rq.headers.get("x-request-id")))
        if body["stream"]:
            return httpx.Response(200, content=ndjson({"t": ids}, {"done": True, "finish_reason": "length"}))
        return httpx.Response(200, json={"token_ids": ids, "finish_reason": "length"})

    for path in ("/v1/completions", "/v1/chat/completions"):
        upstreams.on(PREFILL, path, prefill)
        upstreams.on(NATIVE, path, native)
    upstreams.on(EXPRESS, "/pd/decode", decode)


REQ = {"prompt": "hi", "max_tokens": 1}


async def test_request_id_is_made_returned_and_sent_to_both_legs(make_client, upstreams, tokenizer):
    seen: list = []
    fake(upstreams, tokenizer, seen)
    async with make_client() as (c, _):
        r = await c.post("/v1/completions", json=dict(REQ, model="tiny"))
        rid = r.headers["x-request-id"]
        assert len(rid) == 32 and int(rid, 16) >= 0
        assert seen == [("prefill", rid), ("native", rid)]
        seen.clear()
        # max_tokens > 1: with the first token at once, a 1-token express request never reaches the node
        r = await c.post("/v1/completions", json=dict(REQ, model="tiny-x", stream=True, max_tokens=3),
                         headers={"X-Request-Id": "client-id:42"})
        assert r.headers["x-request-id"] == "client-id:42"  # the client gets its own id back
        internal = seen[0][1]  # ... the legs carry a unique one that starts with it
        assert re.fullmatch(r"client-id:42-[0-9a-f]{16}", internal)
        assert seen == [("prefill", internal), ("express", internal)]
        for bad in ("has space", "x" * 129, "a/b", "<script>", ""):
            r = await c.get("/health", headers={"X-Request-Id": bad})
            assert r.headers["x-request-id"] != bad and len(r.headers["x-request-id"]) == 32
        assert "x-request-id" in (await c.get("/nope")).headers  # errors carry it too


async def test_concurrent_requests_keep_their_own_ids(make_client, upstreams, tokenizer):
    seen: list = []
    fake(upstreams, tokenizer, seen)
    async with make_client() as (c, _):
        rs = await asyncio.gather(*[c.post("/v1/completions", json=dict(REQ, model="tiny"),
                                           headers={"X-Request-Id": f"r{i}"}) for i in range(8)])
    assert [r.headers["x-request-id"] for r in rs] == [f"r{i}" for i in range(8)]
    legs: dict[str, list[str]] = {}
    for leg, rid in seen:
        legs.setdefault(rid, []).append(leg)
    assert sorted(rid.rsplit("-", 1)[0] for rid in legs) == sorted(f"r{i}" for i in range(8))
    assert all(sorted(v) == ["native", "prefill"] for v in legs.values())  # both legs of a request: one id


async def test_clients_reusing_an_id_get_unique_internal_ids(make_client, upstreams, tokenizer):
    """Two requests with the same X-Request-Id (two clients, or one client's retry) never share an internal id:
    vLLM names its request after it, and a `kind: tilert` node its rid."""
    seen: list = []
    fake(upstreams, tokenizer, seen)
    async with make_client() as (c, _):
        rs = await asyncio.gather(*[c.post("/v1/completions", json=dict(REQ, model="tiny"),
                                           headers={"X-Request-Id": "same"}) for _ in range(4)])
    assert [r.headers["x-request-id"] for r in rs] == ["same"] * 4
    prefill_ids = [rid for leg, rid in seen if leg == "prefill"]
    assert len(prefill_ids) == 4 and len(set(prefill_ids)) == 4 and all(i.startswith("same-") for i in prefill_ids)


async def test_access_log_line_per_request(make_client, upstreams, tokenizer, caplog):
    fake(upstreams, tokenizer, [])
    caplog.set_level(logging.INFO, logger="expresslane.router.access")
    async with make_client(make_config(), access_log=True) as (c, _):
        await c.post("/v1/completions", json=dict(REQ, model="tiny-xs", prompt_logprobs=1),
                     headers={"X-Request-Id": "req-7", "authorization": "Bearer not-logged-anywhere"})
        await c.get("/v1/models/none")
    lines = [r.getMessage() for r in caplog.records if r.name == "expresslane.router.access"]
    assert len(lines) == 2
    assert lines[0].startswith("POST /v1/completions 200 lane=native ") and "client=" in lines[0]
    assert lines[1].startswith("GET /v1/models/none 404 lane=- ")
    assert "not-logged-anywhere" not in caplog.text


def test_json_formatter_writes_one_object_per_line():
    rec = logging.LogRecord("expresslane.router", logging.WARNING, __file__, 1, "node %s down", ("n1",), None)
    RequestIdFilter().filter(rec)
    out = json.loads(JsonFormatter().format(rec))
    assert out["level"] == "warning" and out["msg"] == "node n1 down" and out["logger"] == "expresslane.router"
    assert out["ts"].endswith("Z") and "request_id" not in out  # outside a request
