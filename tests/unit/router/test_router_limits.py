"""Input bounds (limits.py) and OpenAI-shaped errors for every unknown path and method."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expresslane.router.server.limits import json_depth_exceeds

from ._kit import PREFILL, make_config
from .test_router_native_lane import CLIENT, vllm  # noqa: F401

MiB = 1024 * 1024


class CountingBody:
    """An async request body of `total` bytes in `chunk`-sized pieces that records how much was pulled."""

    def __init__(self, total: int, chunk: int = 64 * 1024):
        self.total, self.chunk, self.sent = total, chunk, 0

    async def __aiter__(self):
        while self.sent < self.total:
            n = min(self.chunk, self.total - self.sent)
            self.sent += n
            yield b" " * n


def _depth(v) -> int:
    if isinstance(v, list):
        return 1 + max((_depth(x) for x in v), default=0)
    if isinstance(v, dict):
        return 1 + max((_depth(x) for x in v.values()), default=0)
    return 0


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=st.sampled_from('ab"\\[]{}:,é\n')),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        st.text(alphabet=st.sampled_from('k"\\[]{}'), max_size=4), kids, max_size=4),
    max_leaves=40)


@settings(max_examples=150, deadline=None)
@given(_json, st.integers(min_value=1, max_value=12))
def test_depth_scan_agrees_with_the_parsed_depth(value, limit):
    raw = json.dumps(value, ensure_ascii=bool(limit % 2)).encode()
    assert json_depth_exceeds(raw, limit) == (_depth(value) > limit)


def test_depth_scan_of_malformed_text():
    # shallow malformed text is left to the parser (400 "not valid JSON"); a deep run of openers is refused
    assert not json_depth_exceeds(b"[[[}", 3) and not json_depth_exceeds(b'"[[[[]]]]"', 1)
    assert json_depth_exceeds(b"[[[}", 2) and json_depth_exceeds(b"{[{[" * 20, 64)
    assert json_depth_exceeds(b"[" * 100_000 + b"]" * 100_000, 64)


async def test_declared_oversize_body_is_refused_before_reading(make_client, vllm):  # noqa: F811
    body = CountingBody(64 * MiB)
    async with make_client(make_config(limits={"max_body_bytes": MiB})) as (c, _):
        r = await c.post("/v1/completions", content=body, headers={"content-length": str(64 * MiB)})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large" and str(MiB) in r.json()["error"]["message"]
    assert body.sent <= 64 * 1024  # at most the one chunk the transport pulls on its own
    assert vllm.calls == []


async def test_chunked_64mib_body_is_cut_off_at_the_limit(make_client, vllm):  # noqa: F811
    body = CountingBody(64 * MiB)
    async with make_client(make_config(limits={"max_body_bytes": MiB})) as (c, _):
        r = await c.post("/v1/chat/completions", content=body)  # no Content-Length: chunked
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert body.sent <= MiB + 2 * 64 * 1024, body.sent  # read up to the limit, never the whole body
    assert vllm.calls == []


async def test_body_at_the_limit_is_served(make_client, vllm):  # noqa: F811
    raw = json.dumps(CLIENT).encode()
    raw = raw[:-1] + b"," + b'"pad":"' + b"x" * (2048 - len(raw) - 9) + b'"}'
    assert len(raw) == 2048
    async with make_client(make_config(limits={"max_body_bytes": 2048})) as (c, _):
        assert (await c.post("/v1/completions", content=raw)).status_code == 200
        assert (await c.post("/v1/completions", content=raw[:-2] + b'x"}')).status_code == 413
        assert (await c.post("/tokenize", content=b'{"prompt": "' + b"x" * 4096 + b'"}')).status_code == 413


@pytest.mark.parametrize("raw", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 65 + b"1" + b"}" * 65,
    b'{"model": "tiny", "prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"model": "tiny", "prompt": "x", "x": ' + b"[" * 200_000,  # deep AND unterminated
])
async def test_deep_json_is_a_400_naming_the_limit(make_client, vllm, raw):  # noqa: F811
    async with make_client() as (c, _):
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            r = await c.post(path, content=raw)
            assert r.status_code == 400, (path, r.text)
            assert "64 levels" in r.json()["error"]["message"]
    assert vllm.calls == []


async def test_depth_at_the_limit_parses(make_client, vllm):  # noqa: F811
    nested = {"k": 1}
    for _ in range(62):
        nested = {"k": nested}
    async with make_client() as (c, _):  # the body itself is level 1, `extra` and its 63 levels make 64
        r = await c.post("/v1/completions", json=dict(CLIENT, extra=nested))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/", 404), ("GET", "/v2/completions", 404), ("POST", "/v1/embeddings", 404),
    ("GET", "/v1/completions", 405), ("PUT", "/v1/chat/completions", 405), ("DELETE", "/v1/models", 405),
    ("POST", "/health", 405), ("GET", "/tokenize", 405), ("POST", "/version", 405),
    ("GET", "/v1/../../etc/passwd", 404), ("GET", "/%ff%fe", 404), ("POST", "/v1/completions/", 404),
])
async def test_unknown_paths_and_methods_are_openai_errors(make_client, vllm, method, path, status):  # noqa: F811
    async with make_client() as (c, _):
        r = await c.request(method, path)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "detail" not in r.json()
    assert err["code"] == ("not_found" if status == 404 else "method_not_allowed")
    if status == 405:
        assert r.headers["allow"]


async def test_bad_json_and_non_object_bodies_are_400(make_client, vllm):  # noqa: F811
    async with make_client() as (c, _):
        for raw in (b"", b"{", b"[1]", b'"s"', b"\xff\xfe", b"null", b"NaN]", b'{"model": "tiny", "prompt": "x", '
                    b'"temperature": NaN}', b'{"model": "tiny", "prompt": "x", "top_p": -Infinity}'):
            r = await c.post("/v1/completions", content=raw)
            assert r.status_code == 400, raw
            assert r.json()["error"]["type"] == "invalid_request_error"
    assert vllm.bodies(PREFILL, "/v1/completions") == []
