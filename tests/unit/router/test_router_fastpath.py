"""fastpath.RouterApp: the two completion routes answered below Starlette must give clients the same bytes as the
Starlette path (create_app(fast_path=False)), on the wire, through the router's real HTTP server.

Two routers on one config, one with the fast path and one without, each served by serving.RouterServer (uvicorn) on
its own port, in front of the same real upstreams (aiohttp: a vLLM-shaped prefill and native decode node; a port
nobody listens on; a prefill that resets the connection). Every case is raw HTTP/1.1 bytes on a TCP socket; the
reply bytes of the two routers must be equal except the Date header (the second it was sent). The table covers both
routes, both lanes (the express lane's node is down here: its typed errors), streaming and not, every error the
front door renders (bad JSON, not an object, too deep, too large by Content-Length and by a chunked body, unknown
model, bad X-Lane, auth missing / wrong, lane not allowed, rate limit, upstream refused / reset, 404, 405, HEAD),
chunked request bodies, Expect: 100-continue, several requests on one keep-alive connection, and pipelined
requests. After the table the two routers' access lines (duration aside) and request counters must be equal too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
import time

import httptools
import pytest
import uvicorn
from aiohttp import web
from prometheus_client import CollectorRegistry

from expresslane.router.app import create_app
from expresslane.router.config import parse_config
from expresslane.router.server.secrets import RouterSecrets
from expresslane.router.server.serving import RouterServer

from ._aiohttp_server import free_port

KEY = "sk-fast-path-test"
NATIVE_ONLY = "sk-native-only"
SLOW = "sk-one-a-minute"
KEYS = f"{KEY} name=main\n{NATIVE_ONLY} name=nat lanes=native\n{SLOW} name=slow rps=0.0167 burst=1\n"


# ---- upstreams: deterministic vLLM-shaped replies --------------------------------------------------------------

def _completion(body: dict) -> dict:
    n = len(body.get("prompt") or body.get("messages") or [])
    kvp = ({"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
            "remote_engine_id": "engine-1", "remote_request_id": "cmpl-prefill", "remote_host": "127.0.0.1",
            "remote_port": 5600, "tp_size": 1}
           if (body.get("kv_transfer_params") or {}).get("do_remote_decode") else None)
    chat = "messages" in body
    choice = ({"index": 0, "message": {"role": "assistant", "content": "hello"}, "logprobs": None,
               "finish_reason": "length", "stop_reason": None} if chat else
              {"index": 0, "text": " hello", "logprobs": None, "finish_reason": "length", "stop_reason": None,
               "prompt_logprobs": None})
    return {"id": "cmpl-fixed", "object": "chat.completion" if chat else "text_completion", "created": 1,
            "model": body.get("model"), "choices": [choice],
            "usage": {"prompt_tokens": n, "total_tokens": n + 1, "completion_tokens": 1,
                      "prompt_tokens_details": None},
            "kv_transfer_params": kvp}


async def _prefill(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body.get("prompt") == "reset the prefill":
        request.transport.abort()  # RST: the connection dies under the router's leg
        return web.Response()
    return web.json_response(_completion(body))


async def _decode(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):
        return web.json_response(_completion(body))
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    chat = "messages" in body
    for i, piece in enumerate([" hel", "lo", "!"]):
        delta = {"delta": {"content": piece}} if chat else {"text": piece}
        ev = {"id": "cmpl-fixed", "object": "chat.completion.chunk" if chat else "text_completion", "created": 1,
              "model": body.get("model"), "choices": [{"index": 0, **delta, "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
    usage = {"id": "cmpl-fixed", "object": "text_completion", "created": 1, "model": body.get("model"),
             "choices": [], "usage": {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3}}
    await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    return resp


class _Loop:
    """A background event loop thread for the upstreams."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)


async def _serve_upstream(port: int) -> web.AppRunner:
    app = web.Application()
    app.add_routes([web.post("/v1/completions", _prefill), web.post("/v1/chat/completions", _prefill),
                    web.post("/decode/v1/completions", _decode), web.post("/decode/v1/chat/completions", _decode)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def _config(up: str, dead: str) -> dict:
    return {
        "prefill": {"url": up, "model": "served"},
        "tokenizer_dir": "/unused",
        "max_model_len": 64,
        "timeouts": {"connect_s": 2, "prefill_s": 5, "decode_s": 5, "kv_wait_s": 3, "cancel_s": 1},
        "health": {"enabled": False},
        "outlier": {"enabled": False},  # a failed leg does not eject (the cases stay apart)
        "limits": {"max_body_bytes": 2048, "max_json_depth": 8},
        "pools": {
            "native": {"kind": "native", "nodes": [up + "/decode"]},
            "dead": {"kind": "native", "nodes": [dead]},
            "express": {"kind": "expresslane", "nodes": [{"url": dead, "ctrl_host": "127.0.0.1",
                                                          "ctrl_port": int(dead.rsplit(":", 1)[1])}],
                        "busy_retries": 0},
        },
        "aliases": {"tiny": {"pool": "native"}, "tiny-dead": {"pool": "dead"},
                    "tiny-x": {"pool": "express", "unsupported": "refuse",
                               "queue": {"max_waiting": 0, "max_wait_s": 0, "when_full": "reject"}}},
        "lanes": {"native": "native", "express": "express"},
    }


class _Router:
    def __init__(self, config: dict, model_text, *, fast_path: bool) -> None:
        self.port = free_port()
        self.registry = CollectorRegistry()
        app = create_app(parse_config(config), secrets=RouterSecrets(api_keys_text=KEYS), registry=self.registry,
                         model_text=model_text, access_log=True, fast_path=fast_path)
        self.server = RouterServer(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                  log_config=None))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started

    def stop(self) -> None:
        self.server.should_exit = True
        self.server.handle_exit(15, None)
        self.thread.join(30)


# ---- the wire ---------------------------------------------------------------------------------------------------

class _Replies:
    def __init__(self) -> None:
        self.done = 0
        self.heads = 0

    def on_headers_complete(self) -> None:
        self.heads += 1

    def on_message_complete(self) -> None:
        self.done += 1


def exchange(port: int, parts: list[bytes], replies: int, *, head: bool = False, gap_s: float = 0.0) -> bytes:
    """Send `parts` (with `gap_s` between them) on one connection; the raw bytes of `replies` replies."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        got = b""
        counter = _Replies()
        parser = httptools.HttpResponseParser(counter)
        for i, p in enumerate(parts):
            if i and gap_s:
                time.sleep(gap_s)
            s.sendall(p)
            if i == 0 and len(parts) > 1 and b"expect: 100-continue" in p.lower():
                got = s.recv(65536)  # the interim reply comes before the body is sent
                assert got == b"HTTP/1.1 100 Continue\r\n\r\n", got
        s.settimeout(10)
        while (counter.heads if head else counter.done) < replies:
            data = s.recv(65536)
            if not data:
                break
            got += data
            if head:
                counter.heads = data.count(b"\r\n\r\n") + counter.heads
            else:
                parser.feed_data(data)
        return got


def normalize(raw: bytes) -> bytes:
    """Without the Date header (the second it was sent) and with a generated request id (uuid4 hex) as RID."""
    raw = re.sub(rb"(?im)^date: [^\r\n]*\r\n", b"", raw)
    return re.sub(rb"(?im)^(x-request-id: )[0-9a-f]{32}\r\n", rb"\1RID\r\n", raw)


def post(path: str, body: bytes | dict, *, key: str | None = KEY, extra: str = "", rid: str | None = "rid-1",
         method: str = "POST") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = f"{method} {path} HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
    if key is not None:
        head += f"authorization: Bearer {key}\r\n"
    if rid is not None:
        head += f"x-request-id: {rid}\r\n"
    head += extra
    if "transfer-encoding" not in extra.lower():
        head += f"content-length: {len(data)}\r\n"
    return head.encode() + b"\r\n" + data


def chunked(data: bytes, size: int) -> bytes:
    out = b""
    for i in range(0, len(data), size):
        piece = data[i:i + size]
        out += b"%x\r\n" % len(piece) + piece + b"\r\n"
    return out + b"0\r\n\r\n"


CMPL = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
BIG = {"model": "tiny", "prompt": "x" * 3000}

# name -> (parts, replies, {head, gap_s})
CASES: dict[str, tuple[list[bytes], int, dict]] = {
    "completion": ([post("/v1/completions", CMPL)], 1, {}),
    "chat": ([post("/v1/chat/completions", CHAT)], 1, {}),
    "completion-stream": ([post("/v1/completions", {**CMPL, "stream": True})], 1, {}),
    "chat-stream-usage": ([post("/v1/chat/completions", {**CHAT, "stream": True,
                                                         "stream_options": {"include_usage": True}})], 1, {}),
    "no-request-id": ([post("/v1/completions", CMPL, rid=None)], 1, {}),
    "insane-request-id": ([post("/v1/completions", CMPL, rid="bad id with spaces")], 1, {}),
    "two-request-ids": ([post("/v1/completions", CMPL, extra="x-request-id: second\r\n")], 1, {}),
    "bad-json": ([post("/v1/completions", b'{"model": "tiny", ')], 1, {}),
    "not-an-object": ([post("/v1/chat/completions", b"[1, 2]")], 1, {}),
    "too-deep": ([post("/v1/completions", b'{"model": "tiny", "x": [[[[[[[[[[1]]]]]]]]]]}')], 1, {}),
    "nan": ([post("/v1/completions", b'{"model": "tiny", "prompt": [1], "temperature": NaN}')], 1, {}),
    "too-large-by-length": ([post("/v1/completions", BIG)], 1, {}),
    "too-large-chunked": ([post("/v1/completions", chunked(json.dumps(BIG).encode(), 500),
                                extra="transfer-encoding: chunked\r\n")], 1, {}),
    "bad-content-length": ([b"POST /v1/completions HTTP/1.1\r\nhost: r\r\nauthorization: Bearer " + KEY.encode()
                            + b"\r\nx-request-id: r\r\ncontent-length: -1\r\n\r\n"], 1, {}),
    "chunked-body": ([post("/v1/completions", chunked(json.dumps(CMPL).encode(), 7),
                           extra="transfer-encoding: chunked\r\n")], 1, {}),
    "expect-100": ([post("/v1/completions", CMPL, extra="expect: 100-continue\r\n").split(b"\r\n\r\n")[0]
                    + b"\r\n\r\n", json.dumps(CMPL).encode()], 1, {}),
    "unknown-model": ([post("/v1/completions", {**CMPL, "model": "nope"})], 1, {}),
    "missing-model": ([post("/v1/chat/completions", {"messages": []})], 1, {}),
    "bad-messages": ([post("/v1/chat/completions", {"model": "tiny", "messages": []})], 1, {}),
    "bad-x-lane": ([post("/v1/completions", CMPL, extra="x-lane: sideways\r\n")], 1, {}),
    "no-key": ([post("/v1/completions", CMPL, key=None)], 1, {}),
    "wrong-key": ([post("/v1/completions", CMPL, key="sk-wrong")], 1, {}),
    "lane-not-allowed": ([post("/v1/completions", {**CMPL, "model": "tiny-x"}, key=NATIVE_ONLY)], 1, {}),
    "rate-limited": ([post("/v1/completions", {**CMPL, "model": "nope"}, key=SLOW),
                      post("/v1/completions", CMPL, key=SLOW)], 2, {}),
    "express-node-down": ([post("/v1/completions", {**CMPL, "model": "tiny-x"})], 1, {}),
    "express-refuses-feature": ([post("/v1/completions", {**CMPL, "model": "tiny-x", "n": 1, "best_of": 1,
                                                          "logit_bias": {"1": 2}})], 1, {}),
    "x-lane-express": ([post("/v1/completions", CMPL, extra="x-lane: express\r\n")], 1, {}),
    "decode-refused": ([post("/v1/completions", {**CMPL, "model": "tiny-dead"})], 1, {}),
    "decode-refused-stream": ([post("/v1/chat/completions", {**CHAT, "model": "tiny-dead", "stream": True})], 1, {}),
    "prefill-reset": ([post("/v1/completions", {**CMPL, "prompt": "reset the prefill"})], 1, {}),
    "get-405": ([b"GET /v1/completions HTTP/1.1\r\nhost: r\r\nx-request-id: r\r\n\r\n"], 1, {}),
    "put-405": ([post("/v1/chat/completions", CHAT, method="PUT")], 1, {}),
    "head-405": ([b"HEAD /v1/chat/completions HTTP/1.1\r\nhost: r\r\nx-request-id: r\r\n\r\n"], 1,
                 {"head": True}),
    "trailing-slash-404": ([post("/v1/completions/", CMPL)], 1, {}),
    "query-string": ([post("/v1/completions?x=1", CMPL)], 1, {}),
    "keep-alive-three": ([post("/v1/completions", CMPL), post("/v1/chat/completions", CHAT),
                          post("/v1/completions", b"{")], 3, {"gap_s": 0.05}),
    "pipelined-three": ([post("/v1/completions", CMPL) + post("/v1/completions", {**CMPL, "model": "nope"})
                         + post("/v1/chat/completions", {**CHAT, "stream": True})], 3, {}),
    "http10": ([post("/v1/completions", CMPL).replace(b"HTTP/1.1", b"HTTP/1.0", 1)], 1, {}),
    "connection-close": ([post("/v1/completions", CMPL, extra="connection: close\r\n")], 1, {}),
    "health-beside": ([b"GET /health HTTP/1.1\r\nhost: r\r\nx-request-id: r\r\n\r\n"], 1, {}),
}


@pytest.fixture(scope="module")
def routers(model_text):
    loop = _Loop()
    port, dead = free_port(), free_port()
    runner = loop.run(_serve_upstream(port))
    config = _config(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{dead}")
    fast, slow = _Router(config, model_text, fast_path=True), _Router(config, model_text, fast_path=False)
    try:
        yield fast, slow
    finally:
        fast.stop()
        slow.stop()
        loop.run(runner.cleanup())
        loop.loop.call_soon_threadsafe(loop.loop.stop)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(re.sub(r" [0-9.]+ms ", " Nms ", record.getMessage()))


def _run_table(router: "_Router") -> tuple[dict[str, bytes], list[str]]:
    handler = _Lines()
    access = logging.getLogger("expresslane.router.access")
    access.addHandler(handler)
    level = access.level
    access.setLevel(logging.INFO)
    try:
        out = {name: normalize(exchange(router.port, parts, n, **kw)) for name, (parts, n, kw) in CASES.items()}
        seen = -1
        while seen != len(handler.lines):  # the last access lines are written just after their replies
            seen = len(handler.lines)
            time.sleep(0.2)
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    return out, handler.lines


def _requests_total(router: "_Router") -> list[tuple]:
    out = []
    for fam in router.registry.collect():
        if fam.name in ("expresslane_router_requests", "expresslane_router_upstream_errors",
                        "expresslane_router_generated_tokens"):
            out += [(s.name, tuple(sorted(s.labels.items())), s.value) for s in fam.samples
                    if s.name.endswith("_total")]
    return sorted(out)


def test_the_fast_path_gives_clients_the_starlette_paths_bytes(routers):
    fast, slow = routers
    got_fast, lines_fast = _run_table(fast)
    got_slow, lines_slow = _run_table(slow)
    for name in CASES:
        assert got_fast[name] == got_slow[name], (name, got_fast[name], got_slow[name])
    assert lines_fast == lines_slow
    assert _requests_total(fast) == _requests_total(slow)
    # the table exercises what it says (and a router that answered nothing would be "equal" too)
    assert got_fast["completion"].startswith(b"HTTP/1.1 200 OK\r\n") and b'"cmpl-fixed"' in got_fast["completion"]
    assert b"x-request-id: rid-1\r\n" in got_fast["completion"]
    assert b"x-expresslane-lane: native\r\n" in got_fast["completion"]
    assert got_fast["completion-stream"].count(b"data: ") >= 4 and b"[DONE]" in got_fast["completion-stream"]
    assert got_fast["expect-100"].startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")
    assert got_fast["keep-alive-three"].count(b"HTTP/1.1 ") == 3
    assert got_fast["pipelined-three"].count(b"HTTP/1.1 ") == 3
    assert got_fast["chunked-body"].startswith(b"HTTP/1.1 200 OK\r\n")
    statuses = {name: int(raw.split(b" ", 2)[1]) for name, raw in got_fast.items()}
    assert statuses["bad-json"] == 400 and statuses["too-large-by-length"] == 413
    assert statuses["too-large-chunked"] == 413 and statuses["no-key"] == 401 and statuses["wrong-key"] == 401
    assert statuses["lane-not-allowed"] == 403 and statuses["unknown-model"] == 404
    assert statuses["decode-refused"] == 503 and statuses["prefill-reset"] == 502
    assert statuses["get-405"] == 405 and statuses["head-405"] == 405 and statuses["trailing-slash-404"] == 404
    assert b"HTTP/1.1 429 " in got_fast["rate-limited"]
    assert any(" 200 lane=native " in ln for ln in lines_fast)


def test_the_fast_path_serves_the_completion_routes_and_starlette_the_rest(routers, monkeypatch):
    """Which path served a request, seen from inside: only POSTs to the two exact paths take the fast path."""
    fast, slow = routers
    assert slow.server.config.app.fast_path is None
    fp = fast.server.config.app.fast_path
    seen: list[str] = []
    real = fp.serve

    async def spy(scope, receive, kind):
        seen.append(f"{scope['method']} {scope['path']}")
        return await real(scope, receive, kind)

    monkeypatch.setattr(fp, "serve", spy)
    exchange(fast.port, [post("/v1/completions", CMPL), post("/v1/chat/completions", CHAT),
                         b"GET /v1/completions HTTP/1.1\r\nhost: r\r\n\r\n", post("/v1/completions/", CMPL)], 4,
             gap_s=0.05)
    assert seen == ["POST /v1/completions", "POST /v1/chat/completions"]
