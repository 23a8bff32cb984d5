"""logprobs / top_logprobs on the express lane against a fake prefill and a fake node sending the node's
`lp` / `tp` arrays (docs/api.md): the first token's entry from the prefill reply, the rest from the node, vLLM's
chat and completions shapes, stream and non-stream."""

from __future__ import annotations

import httpx
import pytest

from ._kit import EXPRESS, PREFILL, make_config, ndjson, parse_sse
from .test_router_express_lane import PROMPT_IDS, FakeNode

TEXT = " hello world, hello router"


class LpNode(FakeNode):
    """The node answers with lp/tp when top_logprobs is set; the prefill with a logprobs entry for token 0."""

    def __init__(self, upstreams, tokenizer, *, send_lp: bool = True):
        super().__init__(upstreams, tokenizer, answer_text=TEXT)
        self.send_lp = send_lp
        self.finish_reason = "length"

    def lp_of(self, i: int) -> float:
        return -0.1 * (i + 1)

    def tp_of(self, i: int, k: int) -> list[list]:
        return [[self.answer[i], self.lp_of(i)]] + [[200 + j, self.lp_of(i) - 1 - j] for j in range(k - 1)]

    def prefill(self, request, body):
        resp = super().prefill(request, body)
        out = resp.json() if hasattr(resp, "json") else None
        chat = request.url.path.endswith("chat/completions")
        k = body["top_logprobs"] if chat else body["logprobs"]
        t0 = f"token_id:{self.answer[0]}"  # as a prefill run with --return-tokens-as-token-ids answers
        if chat:
            top = [{"token": f"token_id:{i}", "logprob": v, "bytes": []} for i, v in self.tp_of(0, k)]
            out["choices"][0]["logprobs"] = {"content": [{"token": t0, "logprob": self.lp_of(0), "bytes": [],
                                                          "top_logprobs": top}]}
        else:
            out["choices"][0]["logprobs"] = {"tokens": [t0], "token_logprobs": [self.lp_of(0)], "text_offset": [0],
                                             "top_logprobs": [{f"token_id:{i}": v for i, v in self.tp_of(0, k + 1)}]}
        return httpx.Response(200, json=out)

    async def decode(self, request, body):
        ids = self.answer[: body["max_tokens"]]
        k = body.get("top_logprobs")
        lines = []
        for i, t in enumerate(ids):
            line = {"t": [t]}
            if k is not None and self.send_lp:
                line["lp"] = [None if i == 0 else self.lp_of(i)]
                line["tp"] = [None if i == 0 else self.tp_of(i, k)]
            lines.append(line)
        lines.append({"done": True, "n": len(ids), "finish_reason": "length"})
        return httpx.Response(200, content=ndjson(*lines))


def _s(tokenizer, tid):
    return tokenizer.decode([tid], skip_special_tokens=False)


CHAT = {"model": "tiny-x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
        "logprobs": True, "top_logprobs": 2}
COMP = {"model": "tiny-x", "prompt": "hi", "max_tokens": 4, "temperature": 0, "logprobs": 2}


async def test_chat_non_stream_logprobs(make_client, upstreams, tokenizer):
    node = LpNode(upstreams, tokenizer)
    async with make_client() as (c, _):
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    (pre,) = upstreams.bodies(PREFILL, "/v1/chat/completions")
    assert (pre["logprobs"], pre["top_logprobs"]) == (True, 2)
    (dec,) = upstreams.bodies(EXPRESS, "/pd/decode")
    assert dec["top_logprobs"] == 2
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [_s(tokenizer, t) for t in node.answer[:4]]
    assert [e["logprob"] for e in content] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    for i, e in enumerate(content):
        assert e["bytes"] == list(e["token"].encode())
        assert [t["token"] for t in e["top_logprobs"]] == [_s(tokenizer, node.answer[i]), _s(tokenizer, 200)]
        assert e["top_logprobs"][1]["logprob"] == pytest.approx(node.lp_of(i) - 1)


async def test_completion_non_stream_and_stream_logprobs_agree(make_client, upstreams, tokenizer):
    node = LpNode(upstreams, tokenizer)
    async with make_client() as (c, _):
        r = await c.post("/v1/completions", json=COMP)
        rs = await c.post("/v1/completions", json=dict(COMP, stream=True))
    lp = r.json()["choices"][0]["logprobs"]
    toks = [_s(tokenizer, t) for t in node.answer[:4]]
    assert lp["tokens"] == toks
    assert lp["text_offset"] == [sum(len(t) for t in toks[:i]) for i in range(4)]
    # vLLM: the dict {sampled, top-k}: the sampled token is the top-1 here, so k entries (k + 1 when it is not)
    assert list(lp["top_logprobs"][1]) == [toks[1], _s(tokenizer, 200)]
    events = [e for e in parse_sse(rs.text) if e != "[DONE]"]
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events:
        for key in merged:
            merged[key] += (e["choices"][0]["logprobs"] or {}).get(key, [])
    assert merged == lp
    assert "".join(e["choices"][0]["text"] for e in events) == r.json()["choices"][0]["text"]


async def test_chat_stream_logprobs_cover_every_token(make_client, upstreams, tokenizer):
    node = LpNode(upstreams, tokenizer)
    async with make_client() as (c, _):
        r = await c.post("/v1/chat/completions", json=dict(CHAT, stream=True))
    events = [e for e in parse_sse(r.text) if e != "[DONE]"]
    entries = [x for e in events[1:] for x in (e["choices"][0]["logprobs"] or {}).get("content", [])]
    assert [x["token"] for x in entries] == [_s(tokenizer, t) for t in node.answer[:4]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_return_tokens_as_token_ids_names_tokens_by_id(make_client, upstreams, tokenizer):
    node = LpNode(upstreams, tokenizer)
    async with make_client(make_config(return_tokens_as_token_ids=True)) as (c, _):
        r = await c.post("/v1/completions", json=COMP)
        r2 = await c.post("/v1/completions", json=dict(COMP, return_tokens_as_token_ids=False))
    assert r.json()["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in node.answer[:4]]
    assert r2.json()["choices"][0]["logprobs"]["tokens"] == [_s(tokenizer, t) for t in node.answer[:4]]


async def test_a_node_without_lp_arrays_is_an_error_not_a_silent_gap(make_client, upstreams, tokenizer):
    LpNode(upstreams, tokenizer, send_lp=False)
    async with make_client(make_config(resilience={"midstream_failover": False})) as (c, _):
        r = await c.post("/v1/completions", json=COMP)
    assert r.status_code >= 500 and "lp" in r.json()["error"]["message"]


async def test_tilert_pool_does_not_carry_logprobs(make_client, upstreams, tokenizer):
    LpNode(upstreams, tokenizer)
    cfg = make_config(pools={"native": {"kind": "native", "nodes": ["http://native:8100"]},
                             "express": {"kind": "tilert", "nodes": [{"url": EXPRESS, "ctrl_host": "h",
                                                                      "ctrl_port": 1}]}})
    async with make_client(cfg) as (c, _):
        r = await c.post("/v1/completions", json=COMP)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert PROMPT_IDS  # (the kit's prompt ids, unused here)


_TOO_MANY = {"error": {"message": "Requested sample logprobs of 21, which is greater than max allowed: 20",
                       "type": "BadRequestError", "param": "logprobs", "code": 400}}


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_checked_logprobs_refusal_is_in_stream_when_streaming(make_client, upstreams, tokenizer, stream):
    """vLLM checks max_logprobs in its engine's input processor: a streamed request gets 200 + the error event
    (+ [DONE]), a plain one the 400. The express prefill leg is never streamed, so the lane relays the prefill's
    400 the way vLLM streams it; the node's reservation is cancelled either way."""
    node = LpNode(upstreams, tokenizer)
    upstreams.on(PREFILL, "/v1/chat/completions", lambda request, body: httpx.Response(400, json=_TOO_MANY))
    async with make_client() as (c, _):
        r = await c.post("/v1/chat/completions", json=dict(CHAT, top_logprobs=21, stream=stream))
    if stream:
        assert r.status_code == 200
        assert parse_sse(r.text) == [_TOO_MANY, "[DONE]"]
    else:
        assert r.status_code == 400 and r.json() == _TOO_MANY
    assert node.cancelled == node.reserved[:1]


async def test_other_prefill_refusals_stay_400_when_streaming(make_client, upstreams, tokenizer):
    """Checks made before the engine (e.g. max_tokens past the context, a bad schema) are 400 on a stream too."""
    LpNode(upstreams, tokenizer)
    body = {"error": {"message": "bad schema", "type": "BadRequestError", "param": "response_format", "code": 400}}
    upstreams.on(PREFILL, "/v1/chat/completions", lambda request, b: httpx.Response(400, json=body))
    async with make_client() as (c, _):
        r = await c.post("/v1/chat/completions", json=dict(CHAT, stream=True))
    assert r.status_code == 400 and r.json() == body
