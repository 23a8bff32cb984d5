#!/usr/bin/env python3
"""A-B-A-B of the bench's router overhead (scripts/bench_lib/overheads.router_overhead, the same function and
arguments scripts/bench.py uses: 60 sequential non-streaming max_tokens=1 requests, 128-token prompts, native lane)
on ONE dev stack, the bench router started from two source trees in turn.

    flock /tmp/expresslane-heavy.lock .venv/bin/python docs/bench/2026-12-01-router-hot-path/ab_router_overhead.py \\
        --old /tmp/old-tree --new . --rounds 2 --port-base 30000 --out var/router-ab

--old / --new: trees whose router/src (and engine/src) go on the bench router's PYTHONPATH. One JSON line per
measurement on stdout, all of them in --out/ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))

from bench_lib import overheads  # noqa: E402
from bench_lib.servers import BenchRouter, DevStack, Endpoints, model_facts, process_pids, wait_http  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--port-base", type=int, default=30000)
    ap.add_argument("--model-dir", type=Path, default=REPO / "var" / "models" / "tiny-llama")
    ap.add_argument("--out", type=Path, default=REPO / "var" / "router-ab")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    stack = DevStack(model_dir=args.model_dir, state_dir=out / "stack", port_base=args.port_base,
                     services=("prefill", "decode-native", "decode-express"))
    ep = Endpoints.of_stack(stack)
    results = []
    stack.start()
    try:
        for url in (ep.prefill, ep.native, ep.express):
            wait_http(url + "/health", 60)
        vocab = model_facts(args.model_dir)["vocab"]
        nonce = secrets.token_hex(4)
        for rnd in range(args.rounds):
            for which, tree in (("old", args.old), ("new", args.new)):
                tree = tree.resolve()
                os.environ["PYTHONPATH"] = f"{tree}/engine/src:{tree}/router/src"
                with BenchRouter(ep, out / f"router-{which}-{rnd}", 4096) as router:
                    time.sleep(2.0)
                    load0 = os.getloadavg()
                    r = overheads.router_overhead(router.url, "bench-native", ep.prefill, ep.native, ep.served_model,
                                                  vocab, prompt_tokens=128, requests=args.requests,
                                                  nonce=f"{nonce}/{which}/{rnd}", router_pids=process_pids(router.port))
                rec = {"round": rnd, "code": which, "tree": str(tree), "load_before": [round(x, 2) for x in load0],
                       "load_after": [round(x, 2) for x in os.getloadavg()], **r}
                results.append(rec)
                print(json.dumps(rec), flush=True)
                (out / "ab.json").write_text(json.dumps(results, indent=1))
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
