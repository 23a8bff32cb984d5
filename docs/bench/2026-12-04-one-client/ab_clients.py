#!/usr/bin/env python3
"""Router CPU per request with one upstream client or today's mix (issue 23 item 5), against a running dev stack.

    python docs/bench/2026-12-04-one-client/ab_clients.py --state-dir var/dev-stack [--port-base 0] [--n 150]

Variants, each a router process of its own on the dev stack's prefill + native decode (the stack's own router
config and secrets), served in turn, round after round (interleaved: the shared host's noise falls on all):
  mix       today: one-shot calls (prefill legs, the non-stream decode leg, probes) on h1_pool.H1Pool, streams on
            aiohttp under httpx, served by RouterServer (http_protocol) with the fast path below Starlette
  aiohttp   every upstream call through httpx over aiohttp_upstream.AiohttpTransport (no H1Pool)
  httpx     every upstream call through httpx's own transport (httpcore)
  plain     httpx's own transport, Starlette's routing (no fast path), stock uvicorn.Server (no http_protocol):
            what is left when the three hand-written layers are deleted
  mixplain  today's clients, Starlette's routing and stock uvicorn.Server: what the two server-side layers save
Per variant and round: `--n` sequential native-lane requests (half non-streaming max_tokens 1, half streaming
8 tokens), the router process's CPU (schedstat, all threads) read right before and after each request; printed:
p50 / mean router CPU ms per request by kind, and errors.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))

VARIANTS = ("mix", "aiohttp", "httpx", "plain", "mixplain")


def serve(variant: str, port: int) -> int:
    """The router process of one variant (run as `ab_clients.py serve VARIANT PORT`)."""
    import httpx
    import uvicorn

    from expresslane.router.__main__ import setup_logging
    from expresslane.router.aiohttp_upstream import AiohttpTransport
    from expresslane.router.app import create_app
    from expresslane.router.config import load_config
    from expresslane.router.secrets import RouterSecrets
    from expresslane.router.serving import RouterServer

    config = load_config(REPO / "compose" / "config" / "router.yaml", os.environ)
    setup_logging("warning", "text")
    keep = config.timeouts.upstream_keepalive_s
    transport = {"mix": None, "mixplain": None, "aiohttp": AiohttpTransport(keepalive_expiry_s=keep)}.get(
        variant, httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=512, max_keepalive_connections=64,
                                                              keepalive_expiry=keep)))
    app = create_app(config, secrets=RouterSecrets.from_env(os.environ), transport=transport,
                     fast_path=variant not in ("plain", "mixplain"))
    ucfg = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, log_config=None)
    server = uvicorn.Server(ucfg) if variant in ("plain", "mixplain") else RouterServer(ucfg)
    server.run()
    return 0


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except Exception:  # noqa: BLE001
        return 0


def measure(variant: str, env: dict[str, str], port: int, n: int, seed: int) -> dict:
    from bench_lib.overheads import threads_cpu_ns

    proc = subprocess.Popen([sys.executable, __file__, "serve", variant, str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        while _get(base + "/ready") != 200:
            if proc.poll() is not None or time.monotonic() - t0 > 120:
                raise RuntimeError(f"{variant}: router not ready: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
        cpu: dict[str, list[float]] = {"oneshot": [], "stream": []}
        errors = 0
        for i in range(n + 6):
            stream = i % 2 == 1
            body = {"model": "tiny-llama", "prompt": f"ab {variant} {seed} {i} the quick brown fox", "temperature": 0,
                    "max_tokens": 8 if stream else 1, "ignore_eos": True, "stream": stream}
            req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            c0 = threads_cpu_ns([proc.pid])
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    data = r.read()
                    ok = r.status == 200 and (not stream or b"[DONE]" in data)
            except Exception:  # noqa: BLE001
                ok = False
            c1 = threads_cpu_ns([proc.pid])
            if i < 6:
                continue  # warm-up: connections, first-use paths
            if not ok or c0 is None or c1 is None:
                errors += 1
                continue
            cpu["stream" if stream else "oneshot"].append((c1 - c0) / 1e6)
        return {k: (statistics.median(v), statistics.mean(v)) for k, v in cpu.items() if v} | {"errors": errors}
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        return serve(sys.argv[2], int(sys.argv[3]))
    from dev_stack import DevStack

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", type=Path, default=REPO / "var" / "dev-stack")
    ap.add_argument("--port-base", type=int, default=0)
    ap.add_argument("--n", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args()
    stack = DevStack(state_dir=a.state_dir, port_base=a.port_base, secure=(a.state_dir / "secrets").is_dir())
    env = stack.env()
    port = stack.ports["ROUTER_PORT"] + 7
    results: dict[str, list[dict]] = {v: [] for v in a.variants.split(",")}
    for rnd in range(a.rounds):
        for v in results:
            r = measure(v, env, port, a.n, rnd)
            results[v].append(r)
            print(f"round {rnd + 1} {v:8s} " + " ".join(
                f"{k}: p50 {x[0]:.2f} ms mean {x[1]:.2f} ms" for k, x in r.items() if k != "errors")
                  + f" errors {r['errors']}", flush=True)
    print("median over rounds of the per-round p50 (router CPU ms per request):")
    for v, rs in results.items():
        line = " ".join(f"{k} {statistics.median(r[k][0] for r in rs if k in r):.2f}" for k in ("oneshot", "stream"))
        print(f"  {v:8s} {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
