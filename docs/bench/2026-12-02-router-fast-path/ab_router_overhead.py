#!/usr/bin/env python3
"""A-B(-C) of the bench's router overhead over any number of source trees, with the idle
window (scripts/bench_lib/overheads.router_overhead, idle_s: the router's CPU over idle_s seconds with no
traffic, then the gross and the idle-corrected CPU per request), and an optional cProfile run per tree.

    git archive <rev> | tar -x -C OLD_TREE
    .venv/bin/python docs/bench/2026-12-02-router-fast-path/ab_router_overhead.py \\
        --tree old=OLD_TREE --tree new=. --rounds 4 --idle-s 10 --out var/router-ab
    .venv/bin/python docs/bench/2026-12-02-router-fast-path/ab_table.py var/router-ab/ab.json

--tree NAME=DIR: a tree whose router/src (and engine/src) go on the bench router's PYTHONPATH; each round runs
every tree once, in the order given, rotated by one per round (no tree always goes first). --profile NAME: after
the rounds, one more measurement of that tree with its router under cProfile (CPU-time timer, profile_run.py);
the stats in --out/profile-NAME.prof and .txt. One JSON line per measurement on stdout, all in --out/ab.json,
`uptime` before and after in --out/uptime.txt.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pstats
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from bench_lib import overheads  # noqa: E402
from bench_lib.servers import (BenchRouter, DevStack, Endpoints, bench_router_yaml, model_facts,  # noqa: E402
                               process_pids, wait_http)


class ProfiledRouter(BenchRouter):
    """The bench router under cProfile (profile_run.py); stats written on SIGUSR1."""

    def __init__(self, *a, prof: Path, **kw) -> None:
        super().__init__(*a, **kw)
        self.prof = prof

    def __enter__(self) -> "ProfiledRouter":
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "bench-router.yaml"
        cfg.write_text(bench_router_yaml(self.ep, self.port, self.max_model_len))
        log = self.workdir / "bench-router.log"
        self.proc = subprocess.Popen([self.python, str(HERE / "profile_run.py"), str(self.prof), "--config", str(cfg),
                                      "--log-level", "warning"],
                                     stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_http(self.url + "/health", 120, self.proc, log)
        return self

    def dump(self) -> None:
        self.proc.send_signal(signal.SIGUSR1)
        for _ in range(100):
            if self.prof.exists():
                time.sleep(0.5)
                return
            time.sleep(0.1)


def _utime_stime(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process so far (/proc/PID/stat, clock ticks)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="NAME=DIR")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--profile", action="append", default=[])
    ap.add_argument("--spy-bin", help="with --profile: sample the router with this py-spy (--nonblocking, raw "
                    "stacks in --out/spy-NAME.txt) instead of running it under cProfile")
    ap.add_argument("--perf", action="store_true", help="with --profile: record the router with `perf record -g` "
                    "(cpu-clock, user and kernel) into --out/perf-NAME.data instead of cProfile")
    ap.add_argument("--port-base", type=int, default=30000)
    ap.add_argument("--model-dir", type=Path, default=REPO / "var" / "models" / "tiny-llama")
    ap.add_argument("--out", type=Path, default=REPO / "var" / "router-ab")
    args = ap.parse_args()
    trees = [(n, Path(d).resolve()) for n, d in (t.split("=", 1) for t in args.tree)]
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    ups = [f"before: {uptime()}"]
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
        runs = [(rnd, trees[rnd % len(trees):] + trees[:rnd % len(trees)]) for rnd in range(args.rounds)]
        runs += [("profile", [(n, d) for n, d in trees if n in args.profile])]
        for rnd, order in runs:
            for which, tree in order:
                os.environ["PYTHONPATH"] = f"{tree}/engine/src:{tree}/router/src"
                wd = out / f"router-{which}-{rnd}"
                prof = out / f"profile-{which}.prof"
                cprof = rnd == "profile" and not args.spy_bin and not args.perf
                router = ProfiledRouter(ep, wd, 4096, prof=prof) if cprof else BenchRouter(ep, wd, 4096)
                with router:
                    time.sleep(2.0)
                    load0 = os.getloadavg()
                    spy = None
                    if rnd == "profile" and args.spy_bin:
                        spy = subprocess.Popen([args.spy_bin, "record", "-p", str(router.proc.pid), "-r", "200",
                                                "-d", "600", "-f", "raw", "--nonblocking",
                                                "-o", str(out / f"spy-{which}.txt")],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    if rnd == "profile" and args.perf:
                        spy = subprocess.Popen(["perf", "record", "-g", "-F", "4000", "-p", str(router.proc.pid),
                                                "-o", str(out / f"perf-{which}.data")],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        time.sleep(1.0)
                    st0 = _utime_stime(router.proc.pid)
                    r = overheads.router_overhead(router.url, "bench-native", ep.prefill, ep.native, ep.served_model,
                                                  vocab, prompt_tokens=128, requests=args.requests,
                                                  nonce=f"{nonce}/{which}/{rnd}", router_pids=process_pids(router.port),
                                                  idle_s=args.idle_s)
                    st1 = _utime_stime(router.proc.pid)
                    r["router_user_s"], r["router_sys_s"] = [round(b - a, 3) for a, b in zip(st0, st1)]
                    if spy is not None:
                        spy.send_signal(signal.SIGINT)
                        spy.wait(30)
                    if cprof:
                        router.dump()
                        buf = io.StringIO()
                        st = pstats.Stats(str(prof), stream=buf)
                        st.sort_stats("cumulative").print_stats(60)
                        st.sort_stats("tottime").print_stats(40)
                        (out / f"profile-{which}.txt").write_text(buf.getvalue())
                rec = {"round": rnd, "code": which, "tree": str(tree), "load_before": [round(x, 2) for x in load0],
                       "load_after": [round(x, 2) for x in os.getloadavg()], **r}
                results.append(rec)
                print(json.dumps(rec), flush=True)
                (out / "ab.json").write_text(json.dumps(results, indent=1))
    finally:
        stack.stop()
        ups.append(f"after: {uptime()}")
        (out / "uptime.txt").write_text("\n".join(ups) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
