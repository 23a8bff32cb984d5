#!/usr/bin/env python3
"""One upstream client, decided fairly: the router's CPU per request and wall time with each upstream client, every
variant served with the same server settings (issue 42 item 6).

    PYTHONPATH=router/src:scripts .venv/bin/python docs/bench/2026-12-07-one-client/ab_router.py \
        --rounds 3 --out docs/bench/2026-12-07-one-client/run1.json

What is measured: a router process of each variant in turn (interleaved round after round, so the shared host's
noise falls on all of them), in front of fake upstreams in a process of their own that answer as vLLM's prefill and
native decode do (the bodies the unit tests use: a prefill reply with kv_transfer_params, a non-streamed decode
reply, a streamed one of 8 SSE chunks + [DONE]) and at once: the router's own work is all there is to measure, and
no vLLM spins the host's two cores meanwhile. Native lane, two kinds of request: `oneshot` (non-streaming,
max_tokens 1: two one-shot legs) and `stream` (streaming, 8 tokens: a one-shot prefill leg and a streamed decode
leg). Each batch: 50 warm-up requests, then `--n` requests by `--concurrency` closed-loop clients (aiohttp, a process
of their own); the router's CPU is the sum of its threads' schedstat runtime over the batch (no per-request window,
no tick: every variant runs RouterServer, whose housekeeping tick is gone, with gc.freeze; health probes are off in
every variant, so no probe falls in a window either); CPU per request = batch CPU / n; wall = the batch's duration.

Variants (the server side is RouterServer + RouterHttpProtocol + the fast path unless named):
  mix           today: one-shot legs on h1_pool.H1Pool, streams on httpx over upstream/aiohttp_transport
  aiohttp       plain aiohttp for both (one ClientSession; no httpx objects anywhere on the path)
  h1+aiohttp    one-shot legs on H1Pool, streams on plain aiohttp
  httpx+aiohttp every call through httpx over aiohttp_transport (HttpxOneShot)
  httpx         every call through httpx's own transport (httpcore)
  mix-stock     today's clients served by RouterServer with uvicorn's stock httptools protocol and Starlette's
                routing (no http_protocol.RouterHttpProtocol, no fastpath): what those two layers save, with the
                tick removal and gc.freeze kept (the earlier A/B dropped those too, confounding the 0.3 ms)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "router" / "src"))

VARIANTS = ("mix", "aiohttp", "h1+aiohttp", "httpx+aiohttp", "httpx", "mix-stock")
KVP = {"do_remote_decode": False, "remote_engine_id": "e", "remote_block_ids": [1, 2, 3], "remote_host": "h",
       "remote_port": 5600}


# ---- the fake upstreams (a process of their own) ----------------------------------------------------------------
def upstreams(port: int) -> int:
    from aiohttp import web

    prefill = json.dumps({"id": "cmpl-prefill", "object": "text_completion", "model": "served",
                          "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                          "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8},
                          "kv_transfer_params": KVP}).encode()
    decode = json.dumps({"id": "cmpl-decode", "object": "text_completion", "model": "served",
                         "choices": [{"index": 0, "text": "Hello", "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8},
                         "kv_transfer_params": None}).encode()
    chunks = [{"id": "cmpl-decode", "object": "text_completion", "model": "served",
               "choices": [{"index": 0, "text": f" tok{i}", "logprobs": None,
                            "finish_reason": "length" if i == 7 else None}]} for i in range(8)]
    chunks.append({"id": "cmpl-decode", "object": "text_completion", "model": "served", "choices": [],
                   "usage": {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15}})
    sse = [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            return web.Response(body=prefill, content_type="application/json")
        if not body.get("stream"):
            return web.Response(body=decode, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for c in sse:
            await resp.write(c)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/health", health)])
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)
    return 0


# ---- plain aiohttp as the router's client (bench-local: what a switch to it would be) --------------------------
class AiohttpOneShot:
    """upstream.calls.OneShotCalls over one plain aiohttp.ClientSession."""

    def __init__(self) -> None:
        self._session = None

    def session(self):
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=512, keepalive_timeout=2.0), cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=True, trust_env=False, skip_auto_headers=("User-Agent",))
        return self._session

    async def post_json(self, url, body, *, stage, timeout, headers=None):
        import aiohttp

        from expresslane.router.json_codec import dumps_compact
        from expresslane.router.server.requestlog import current_request_id
        from expresslane.router.upstream.errors import json_object, status_error

        h = {"Content-Type": "application/json", **(headers or {})}
        rid = current_request_id()
        if rid:
            h["X-Request-Id"] = rid
        async with self.session().post(url, data=dumps_compact(body).encode(), headers=h,
                                       timeout=aiohttp.ClientTimeout(total=timeout.read, connect=timeout.connect)) as r:
            content = await r.read()
            err = status_error(r.status, content, r.headers.get("Content-Type"), stage=stage)
        if err is not None:
            raise err
        return json_object(content, stage=stage)

    async def get_status(self, url, *, timeout, headers=None):
        async with self.session().get(url, headers=headers) as r:
            await r.read()
            return r.status

    async def aclose(self):
        if self._session is not None:
            await self._session.close()


class _AiohttpLines:
    """What LineReader reads of a streamed reply: aiter_lines()."""

    def __init__(self, resp) -> None:
        self._resp = resp

    async def aiter_lines(self):
        async for raw in self._resp.content:
            yield raw.decode("utf-8").rstrip("\r\n")


def plain_aiohttp_open_stream(oneshot: AiohttpOneShot):
    import aiohttp

    from expresslane.router.server.requestlog import current_request_id
    from expresslane.router.upstream.errors import status_error

    @contextlib.asynccontextmanager
    async def open_stream(client, url, body, *, stage, timeout, headers=None):
        h = {"Content-Type": "application/json", **(headers or {})}
        rid = current_request_id()
        if rid:
            h["X-Request-Id"] = rid
        resp = await oneshot.session().post(url, data=json.dumps(body).encode(), headers=h,
                                            timeout=aiohttp.ClientTimeout(connect=timeout.connect,
                                                                          sock_read=timeout.read))
        try:
            if resp.status >= 300:
                err = status_error(resp.status, await resp.read(), resp.headers.get("Content-Type"), stage=stage)
                if err is not None:
                    raise err
            yield _AiohttpLines(resp)
        finally:
            resp.release()
    return open_stream


# ---- one router process ---------------------------------------------------------------------------------------------
def router(variant: str, port: int, upstream: str) -> int:
    import httpx
    import uvicorn

    import expresslane.router.app as app_module
    import expresslane.router.lanes.native as native_module
    from expresslane.router.__main__ import setup_logging
    from expresslane.router.app import create_app
    from expresslane.router.config import parse_config
    from expresslane.router.server.serving import RouterServer, server_config
    from expresslane.router.upstream.aiohttp_transport import AiohttpTransport

    config = parse_config({"listen": {"host": "127.0.0.1", "port": port},
                           "prefill": {"url": upstream, "model": "served"}, "health": {"enabled": False},
                           "pools": {"native": {"kind": "native", "nodes": [upstream]}},
                           "aliases": {"tiny": {"pool": "native"}}})
    setup_logging("warning", "text")
    keep = config.timeouts.upstream_keepalive_s
    transport = None
    if variant == "httpx+aiohttp":
        transport = AiohttpTransport(keepalive_expiry_s=keep)
    elif variant == "httpx":
        transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=512, max_keepalive_connections=64,
                                                                 keepalive_expiry=keep))
    if variant in ("aiohttp", "h1+aiohttp"):
        oneshot = AiohttpOneShot()
        native_module.open_stream = plain_aiohttp_open_stream(oneshot)
        if variant == "aiohttp":
            app_module.H1Pool = lambda **kw: oneshot  # type: ignore[assignment]  (the one-shot client)
    app = create_app(config, transport=transport, fast_path=variant != "mix-stock")
    ucfg = server_config(app, host="127.0.0.1", port=port, log_level="warning", keepalive_s=75.0)
    if variant == "mix-stock":
        class StockProtocolServer(RouterServer):  # RouterServer's tick removal and gc.freeze, uvicorn's protocol
            def __init__(self, config: uvicorn.Config) -> None:
                uvicorn.Server.__init__(self, config)
                self._loop = self._wake = None
                self._date_second = -1
        ucfg.http = "httptools"
        server = StockProtocolServer(ucfg)
    else:
        server = RouterServer(ucfg)
    server.run()
    return 0


# ---- the load (a process of its own) --------------------------------------------------------------------------------
async def _load(base: str, kind: str, n: int, concurrency: int, warmup: int) -> tuple[int, float]:
    import aiohttp

    body = {"model": "tiny", "prompt": "the quick brown fox", "temperature": 0, "ignore_eos": True,
            "max_tokens": 8 if kind == "stream" else 1, "stream": kind == "stream"}
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def one() -> None:
            nonlocal errors
            async with s.post(base + "/v1/completions", json=body) as r:
                data = await r.read()
                if r.status != 200 or (kind == "stream" and b"[DONE]" not in data):
                    errors += 1

        for _ in range(warmup):
            await one()
        sys.stdout.write("warm\n")
        sys.stdout.flush()
        sys.stdin.readline()  # the parent read the router's CPU: go
        t0 = time.perf_counter()
        todo = iter(range(n))

        async def worker() -> None:
            for _ in todo:
                await one()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return errors, time.perf_counter() - t0


def load(base: str, kind: str, n: int, concurrency: int, warmup: int) -> int:
    errors, wall = asyncio.run(_load(base, kind, n, concurrency, warmup))
    print(json.dumps({"errors": errors, "wall_s": wall}), flush=True)
    return 0


# ---- the driver -------------------------------------------------------------------------------------------------------
def _wait_port(port: int, proc: subprocess.Popen, what: str) -> None:
    import socket

    t0 = time.monotonic()
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None or time.monotonic() - t0 > 60:
            raise RuntimeError(f"{what} did not start: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        time.sleep(0.05)


def batch(router_pid: int, base: str, kind: str, n: int, concurrency: int) -> dict:
    from bench_lib.overheads import threads_cpu_ns

    p = subprocess.Popen([sys.executable, __file__, "load", base, kind, str(n), str(concurrency), "50"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdin is not None
    assert p.stdout.readline().strip() == "warm"
    c0 = threads_cpu_ns([router_pid])
    p.stdin.write("go\n")
    p.stdin.flush()
    out = json.loads(p.stdout.readline())
    c1 = threads_cpu_ns([router_pid])
    p.wait(30)
    return {"cpu_ms_per_request": (c1 - c0) / 1e6 / n, "wall_s": out["wall_s"], "rps": n / out["wall_s"],
            "errors": out["errors"]}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in ("upstreams", "router", "load"):
        cmd, args = sys.argv[1], sys.argv[2:]
        if cmd == "upstreams":
            return upstreams(int(args[0]))
        if cmd == "router":
            return router(args[0], int(args[1]), args[2])
        return load(args[0], args[1], int(args[2]), int(args[3]), int(args[4]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--n1", type=int, default=300, help="requests per batch at concurrency 1")
    ap.add_argument("--n32", type=int, default=1200, help="requests per batch at higher concurrency")
    ap.add_argument("--base-port", type=int, default=18700)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "router" / "src"), str(REPO / "scripts")])}
    up_port = a.base_port
    up = subprocess.Popen([sys.executable, __file__, "upstreams", str(up_port)], env=env, stderr=subprocess.PIPE)
    results: list[dict] = []
    print(f"host: {os.cpu_count()} CPUs, load average at start {os.getloadavg()}", flush=True)
    try:
        _wait_port(up_port, up, "the fake upstreams")
        upstream = f"http://127.0.0.1:{up_port}"
        for rnd in range(a.rounds):
            for i, v in enumerate(a.variants.split(",")):
                port = a.base_port + 1 + i
                r = subprocess.Popen([sys.executable, __file__, "router", v, str(port), upstream], env=env,
                                     stderr=subprocess.PIPE)
                try:
                    _wait_port(port, r, f"router {v}")
                    for c in (int(x) for x in a.concurrency.split(",")):
                        for kind in ("oneshot", "stream"):
                            n = a.n1 if c == 1 else a.n32
                            res = batch(r.pid, f"http://127.0.0.1:{port}", kind, n, c)
                            res.update(round=rnd + 1, variant=v, kind=kind, concurrency=c, n=n,
                                       loadavg=os.getloadavg()[0])
                            results.append(res)
                            print(f"round {rnd + 1} {v:13s} c={c:<3d} {kind:7s} {res['cpu_ms_per_request']:6.3f} ms "
                                  f"CPU/req  {res['rps']:7.1f} req/s  errors {res['errors']}  "
                                  f"(load {res['loadavg']:.1f})", flush=True)
                finally:
                    r.terminate()
                    r.wait(10)
    finally:
        up.terminate()
        up.wait(10)
    print("\nmedian over rounds: router CPU ms per request (req/s)")
    keys = sorted({(x["concurrency"], x["kind"]) for x in results})
    base = {}
    print(f"  {'variant':13s} " + " ".join(f"c={c} {k:7s}        " for c, k in keys))
    for v in a.variants.split(","):
        cells = []
        for c, k in keys:
            rs = [x for x in results if x["variant"] == v and x["concurrency"] == c and x["kind"] == k]
            cpu = statistics.median(x["cpu_ms_per_request"] for x in rs)
            rps = statistics.median(x["rps"] for x in rs)
            base.setdefault((c, k), cpu)
            cells.append(f"{cpu:6.3f} ({rps:6.0f}) {100 * (cpu / base[(c, k)] - 1):+5.0f}%")
        print(f"  {v:13s} " + " ".join(cells))
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
