#!/usr/bin/env python3
"""Benchmark the two decode lanes (and the single-server reference) through the router, plus the overheads
of the connector and the router. Method, JSON keys and numbers: docs/performance.md.

    python scripts/bench.py --start-stack --port-base 30000 --out var/bench        # start a stack, bench, stop it
    python scripts/bench.py --port-base 0 --out var/bench                          # a running dev stack
    python scripts/bench.py --quick ...                                            # CI-sized: a report, no assertion

Lanes: `express` and `native` go through a bench router the script starts over the stack's servers
(aliases bench-express / bench-native; the express alias queues without spilling, so every express request
is served by the one express node and its queue wait is reported); `single` is the prefill server answering
the whole request. `--router URL --express-alias A --native-alias B` uses an existing router instead
(spill-overs are then reported per scenario).

Artifacts in --out: bench.json (stable keys), bench.md (the tables, also printed), bench.png.

    python scripts/bench.py --plot-from var/bench/bench.json --plot-out bench.png   # re-plot a report, no servers
    python scripts/bench.py --plot-from decode.jsonl --plot-out engines.png         # decode-bench JSON lines (GPU)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import secrets
import shlex
import signal
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib import extract, overheads, plots, report  # noqa: E402
from bench_lib.client import completion_body, run_closed_loop, token_prompt  # noqa: E402
from bench_lib.prom import Snapshot, scrape  # noqa: E402
from bench_lib.servers import (EXPRESS_ALIAS, NATIVE_ALIAS, REPO, BenchRouter, DevStack, Endpoints,  # noqa: E402
                               align_forward_thread, isolated_baseline_cpus, model_facts, place_forward_thread,
                               placement, port_free, process_pids, wait_http)
from bench_lib.stats import summarize  # noqa: E402

FULL = {"concurrency": [1, 2, 4, 8], "prompts": [128, 1024, 3800], "output": 256}
QUICK = {"concurrency": [1, 2], "prompts": [128, 1024], "output": 64}


def requests_for(concurrency: int, quick: bool) -> int:
    """Closed-loop requests per scenario: every user sends at least 3 (quick: 2), and at least 8 (quick: 3)
    in all so the percentiles mean something."""
    return max(3 if quick else 8, (2 if quick else 3) * concurrency)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", file=sys.stderr, flush=True)


def memory_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> dict:
    """Best-of-`reps` GB/s of a large numpy copy (bytes read + written, as decode/bench.py counts) and of a
    read-only pass (sum)."""
    src = np.random.default_rng(0).random(nbytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best_copy = best_read = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best_copy = min(best_copy, time.perf_counter() - t0)
        t0 = time.perf_counter()
        float(src.sum())
        best_read = min(best_read, time.perf_counter() - t0)
    return {"copy_gb_per_s": round(2 * nbytes / best_copy / 1e9, 2), "read_gb_per_s": round(nbytes / best_read / 1e9, 2)}


def bound(model: dict, bw: dict, prompts: list[int], output: int) -> dict:
    """Batch-1 decode bound: bytes read per token = weights (embedding: one row) + KV of the context; the
    context is taken at the middle of the generation (prompt + output/2)."""
    gbps = bw["copy_gb_per_s"]
    rows = []
    for p in prompts:
        ctx = p + output // 2
        nbytes = model["weight_bytes_read_per_token"] + model["kv_bytes_per_token"] * ctx
        rows.append({"context_tokens": ctx, "bytes_per_token": nbytes, "tok_s_bound": round(gbps * 1e9 / nbytes, 1)})
    return {"weight_bytes_read_per_token": model["weight_bytes_read_per_token"],
            "kv_bytes_per_token": model["kv_bytes_per_token"], "bandwidth_gb_per_s": gbps,
            "bandwidth_kind": "numpy copy, read+write bytes", "per_context": rows}


def _repo_relative(path: str) -> str:
    """A path inside the repository as the reader's checkout has it (a record names no machine's repo root)."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return path


class Scrapers:
    """The /metrics URL of every source (None = not scraped)."""

    def __init__(self, urls: dict[str, str | None]):
        self.urls = urls
        self.client = httpx.Client(trust_env=False)

    def snap(self) -> dict[str, Snapshot]:
        return {k: scrape(self.client, u) for k, u in self.urls.items()}


def run_scenario(lane: str, url: str, model: str, headers: dict | None, conc: int, prompt: int, output: int,
                 n: int, vocab: int, nonce: str, scrapers: Scrapers) -> tuple[dict, list[float]]:
    bodies = [completion_body(model, token_prompt(prompt, f"{nonce}/{lane}/{conc}/{prompt}/{i}", vocab), output,
                              stream=True) for i in range(n)]
    load0 = os.getloadavg()[0]
    before = scrapers.snap()
    results, wall = asyncio.run(run_closed_loop(url, bodies, conc, headers=headers))
    after = scrapers.snap()
    deltas = {k: after[k] - before[k] for k in after}
    stats = summarize(results, expected_tokens=output, wall_s=wall).as_dict()
    rec = report.scenario_record(lane, conc, prompt, output, stats, [load0, os.getloadavg()[0]],
                                 extract.extract(lane, deltas))
    ttfts = [round(1e3 * r.ttft_s, 3) for r in results if r.ok]
    return rec, ttfts


def warmup(targets: dict, prompts: list[int], vocab: int, nonce: str) -> None:
    for lane, (url, model, headers) in targets.items():
        bodies = [completion_body(model, token_prompt(p, f"{nonce}/warm/{lane}/{p}", vocab), 8, stream=True)
                  for p in prompts]
        results, _ = asyncio.run(run_closed_loop(url, bodies, 1, headers=headers))
        bad = [r.error for r in results if not r.ok]
        if bad:
            raise SystemExit(f"warm-up of the {lane} lane failed: {bad[0]}")


def find_baseline_base(port_base: int) -> int:
    for off in range(11, 400, 7):
        if port_free(8000 + port_base + off) and port_free(5600 + port_base + off):
            return port_base + off
    raise SystemExit("no free port pair for the baseline prefill server")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "var" / "bench", help="artifact directory")
    ap.add_argument("--quick", action="store_true", help="CI size: concurrency 1,2; prompts 128,1024; 64 tokens")
    ap.add_argument("--start-stack", action="store_true", help="start a DevStack on --port-base, stop it after")
    ap.add_argument("--stack-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for the started stack and baseline prefill, e.g. PREFILL_CPU_BIND=0 (repeatable)")
    ap.add_argument("--port-base", type=int, default=0, help="the stack's port base (dev_stack.py --port-base)")
    ap.add_argument("--model-dir", type=Path, default=REPO / "var" / "models" / "smollm2-135m-instruct",
                    help="the stack's model (default: the real default model; var/models/tiny-llama: the tiny one). "
                         "With --start-stack, a model scripts/model_init.py knows is written there first")
    ap.add_argument("--served-model", default=None, help="the name vLLM serves (default: the model directory's name)")
    for name in ("prefill", "native", "express", "connector-metrics"):
        ap.add_argument(f"--{name}", help=f"override the {name} base URL derived from --port-base")
    ap.add_argument("--express-ctrl-port", type=int, help="override the express node's control port")
    ap.add_argument("--router", help="use this router instead of starting a bench router")
    ap.add_argument("--express-alias", default=None, help="with --router (default: SERVED-express)")
    ap.add_argument("--native-alias", default=None, help="with --router (default: the served model's name)")
    ap.add_argument("--vllm-api-key-file", type=Path,
                    help="vLLM's API key, for the calls that go to the prefill itself (its /v1/models, the single "
                         "lane) on a closed stack: compose's internal secret, a dev stack's <state>/secrets/vllm_api_key")
    ap.add_argument("--router-api-key-file", type=Path,
                    help="a client key of the router (ROUTER_API_KEYS), where the router is closed to clients")
    ap.add_argument("--baseline-prefill", help="a running prefill server WITHOUT our connector (else started)")
    ap.add_argument("--concurrency", help="comma list (default 1,2,4,8; quick 1,2)")
    ap.add_argument("--prompts", help="comma list of prompt lengths (default 128,1024,3800; quick 128,1024)")
    ap.add_argument("--output-tokens", type=int, help="default 256; quick 64")
    ap.add_argument("--requests", type=int, help="requests per scenario (default: requests_for(concurrency))")
    ap.add_argument("--lanes", default="express,native,single")
    ap.add_argument("--skip-overheads", action="store_true")
    ap.add_argument("--seed", help="prompt nonce (default random: prompts never repeat across runs)")
    ap.add_argument("--plot-from", type=Path, metavar="FILE",
                    help="only render a plot from FILE (a bench.json, or the decode bench's --json lines), then exit")
    ap.add_argument("--plot-out", type=Path, metavar="PNG", help="with --plot-from (default: FILE with .png)")
    args = ap.parse_args(argv)
    # The shipped router config derives its aliases from the served name (compose/config/router.yaml).
    args.served_model = args.served_model or args.model_dir.name
    args.native_alias = args.native_alias or args.served_model
    args.express_alias = args.express_alias or f"{args.native_alias}-express"
    return args


class Report:
    """The report being built; written to disk after every scenario (complete=false) and at the end, so a
    run that is interrupted (or killed) still leaves what it measured."""

    def __init__(self, out: Path, args: argparse.Namespace, argv: list[str] | None, **config):
        self.out, self.args = out, args
        self.data = {
            "schema": report.SCHEMA,
            "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "finished_at": None,
            "complete": False,
            "command": " ".join(shlex.quote(a) for a in [_repo_relative(sys.argv[0]),
                                                          *(sys.argv[1:] if argv is None else argv)]),
            "mode": "quick" if args.quick else "full",
            "host": {"cpus": os.cpu_count(), "loadavg_start": [round(x, 2) for x in os.getloadavg()],
                     "loadavg_end": None, "copy_gb_per_s": None, "read_gb_per_s": None, "placement": {}},
            "model": None, "bound": None, "config": config, "endpoints": {}, "scenarios": [],
            "overheads": {"connector_unclaimed": None, "connector_claimed": [], "router": None},
            "goals": [], "samples": {"ttft_ms": {}},
        }

    def write(self, complete: bool = False, quiet: bool = True) -> None:
        d = self.data
        d["complete"] = complete
        d["finished_at"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        d["host"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        d["overheads"]["connector_claimed"] = overheads.connector_claimed(d["scenarios"])
        d["goals"] = report.goals(d["scenarios"], d["overheads"])
        (self.out / "bench.json").write_text(json.dumps(d, indent=1) + "\n")
        md = report.markdown(d)
        (self.out / "bench.md").write_text(md)
        if d["scenarios"]:
            try:
                report.plot(d, self.out / "bench.png")
            except ImportError as e:  # matplotlib is in requirements-dev.txt; say so rather than fail the run
                log(f"no plot: {e}")
        if not quiet:
            print(md)


def _bearer(path: Path | None) -> dict | None:
    """{"Authorization": "Bearer <the file's first line>"}, or None without a file."""
    if path is None:
        return None
    text = path.read_text().strip()
    if not text:
        raise OSError(f"{path} holds no key")
    key = text.splitlines()[0].split()[0]  # ROUTER_API_KEYS lines: the key, then name= lanes= ...
    return {"Authorization": f"Bearer {key}"}


def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_from:
        out = args.plot_out or args.plot_from.with_suffix(".png")
        try:
            kind = plots.from_file(args.plot_from, out)
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"cannot plot {args.plot_from}: {e}") from None
        log(f"wrote {out} ({kind} plot)")
        return 0
    preset = QUICK if args.quick else FULL
    concs = [int(x) for x in args.concurrency.split(",")] if args.concurrency else preset["concurrency"]
    prompts = [int(x) for x in args.prompts.split(",")] if args.prompts else preset["prompts"]
    output = args.output_tokens or preset["output"]
    lanes = [x for x in args.lanes.split(",") if x]
    bad = set(lanes) - set(report.LANES)
    if bad:
        raise SystemExit(f"unknown lanes {sorted(bad)}; choose from {report.LANES}")
    nonce = args.seed or secrets.token_hex(4)
    try:  # keys go into request headers only, never into the report or the log
        vllm_auth = _bearer(args.vllm_api_key_file)
        router_auth = _bearer(args.router_api_key_file)
    except OSError as e:
        raise SystemExit(f"cannot read a key file: {e}") from None
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _sigterm)  # stop what we started and keep the partial report
    stack_env = dict(kv.split("=", 1) for kv in args.stack_env)
    use_bench_router = not args.router
    rep = Report(out, args, argv, concurrency=concs, prompt_tokens=prompts, output_tokens=output, lanes=lanes,
                 requests_per_scenario={str(c): args.requests or requests_for(c, args.quick) for c in concs},
                 nonce=nonce, max_model_len=None, stack_env=stack_env, stack_started=args.start_stack,
                 express_alias=EXPRESS_ALIAS if use_bench_router else args.express_alias,
                 native_alias=NATIVE_ALIAS if use_bench_router else args.native_alias,
                 bench_router=use_bench_router)
    D = rep.data
    log(f"out={out} nonce={nonce} lanes={lanes} concurrency={concs} prompts={prompts} output={output}")

    # a started stack leaves the shipped router out unless --router asks for one (the bench router serves)
    services = ("prefill", "decode-native", "decode-express") + (("router",) if args.router else ())
    stack = DevStack(model_dir=args.model_dir, state_dir=out / "stack", port_base=args.port_base,
                     services=services, extra_env=stack_env, served_model_name=args.served_model)
    if not args.start_stack and not (args.model_dir / "config.json").exists():
        raise SystemExit(f"{args.model_dir}: no config.json (--model-dir must be the stack's model)")
    ep = Endpoints.of_stack(stack, args.served_model)
    for name in ("prefill", "native", "express", "connector_metrics"):
        if getattr(args, name):
            setattr(ep, name, getattr(args, name).rstrip("/"))
    if args.express_ctrl_port:
        ep.express_ctrl_port = args.express_ctrl_port
    baseline: DevStack | None = None
    router_cm: BenchRouter | None = None
    try:
        if args.start_stack:
            log(f"starting the dev stack on port base {args.port_base} (logs in {stack.state_dir})")
            stack.start()  # writes the model first (model_init.py); stops what it started on failure
        model = D["model"] = model_facts(args.model_dir)
        vocab = model["vocab"]
        for name, url in (("prefill", ep.prefill), ("native", ep.native), ("express", ep.express)):
            wait_http(url + "/health", 30)
        r = httpx.get(ep.prefill + "/v1/models", timeout=10, trust_env=False, headers=vllm_auth).json()
        max_len = D["config"]["max_model_len"] = int(r["data"][0].get("max_model_len") or 4096)
        if max(prompts) + output > max_len:
            raise SystemExit(f"prompt {max(prompts)} + output {output} > max_model_len {max_len}")
        bw = memory_bandwidth()
        D["host"].update(bw)
        D["bound"] = bound(model, bw, prompts, output)
        log(f"memory bandwidth {bw}")
        where = D["host"]["placement"] = placement(
            {name: httpx.URL(url).port for name, url in (("prefill", ep.prefill), ("native", ep.native),
                                                         ("express", ep.express))})
        log("placement: " + "; ".join(f"{k} idle {v['idle_cpu_pct']}% of a core" for k, v in where.items()))

        if use_bench_router:
            router_cm = BenchRouter(ep, out, max_len).__enter__()
            router_url = router_cm.url
        else:
            router_url = args.router.rstrip("/")
        x_alias, n_alias = D["config"]["express_alias"], D["config"]["native_alias"]
        D["endpoints"] = {"router": router_url, "prefill": ep.prefill, "native": ep.native, "express": ep.express,
                          "connector_metrics": ep.connector_metrics}
        scrapers = Scrapers({"router": router_url + "/metrics", "prefill": ep.prefill + "/metrics",
                             "native": ep.native + "/metrics", "express": ep.express + "/metrics",
                             "connector": (ep.connector_metrics + "/metrics") if ep.connector_metrics else None})
        targets = {"express": (router_url + "/v1/completions", x_alias, router_auth),
                   "native": (router_url + "/v1/completions", n_alias, router_auth),
                   "single": (ep.prefill + "/v1/completions", ep.served_model, vllm_auth)}
        targets = {k: v for k, v in targets.items() if k in lanes}
        log("warm-up")
        warmup(targets, prompts, vocab, nonce)
        for p in prompts:
            for c in concs:
                for lane, (url, alias, headers) in targets.items():
                    n = args.requests or requests_for(c, args.quick)
                    rec, ttfts = run_scenario(lane, url, alias, headers, c, p, output, n, vocab, nonce, scrapers)
                    D["scenarios"].append(rec)
                    D["samples"]["ttft_ms"][f"{lane}/{c}/{p}"] = ttfts
                    rep.write()
                    log(f"{lane:7s} c={c} prompt={p}: ok {rec['ok']}/{rec['requests']} ttft p50 "
                        f"{rec['ttft_ms']['p50']} ms, user tok/s p50 {rec['user_tok_s']['p50']} "
                        f"(server {(rec['server'].get('decode') or {}).get('tok_s')}), "
                        f"aggregate {rec['aggregate_tok_s']}")
        if not args.skip_overheads:
            log("router overhead")
            D["overheads"]["router"] = overheads.router_overhead(
                router_url, n_alias, ep.prefill, ep.native, ep.served_model, vocab, prompt_tokens=128,
                requests=15 if args.quick else 60, nonce=nonce,
                router_pids=process_pids(router_cm.port) if router_cm is not None else None)
            rep.write()
        if router_cm is not None:
            router_cm.__exit__()
            router_cm = None
        if not args.skip_overheads:
            base_url, halves = args.baseline_prefill, None
            if not base_url:
                pb = find_baseline_base(args.port_base)
                base_env = {**stack_env, "EXPRESS_CONNECTOR": "0"}
                # A started stack in the halves layout: the decode servers are done with; stop them and give
                # the baseline their CPUs, so each prefill server has the same CPUs to itself (each with its
                # own stock NIXL progress thread) instead of the two sharing the prefill's.
                halves = isolated_baseline_cpus(stack.env()) if args.start_stack else None
                if halves:
                    log("stopping the decode servers; the baseline prefill takes their CPUs "
                        f"{','.join(map(str, halves[1]))}")
                    stack.stop(("decode-native", "decode-express"))
                    base_env["PREFILL_CPU_BIND"] = ",".join(map(str, halves[1]))
                baseline = DevStack(model_dir=args.model_dir, state_dir=out / "baseline-prefill", port_base=pb,
                                    services=("prefill",), extra_env=base_env, served_model_name=args.served_model)
                log(f"starting the baseline prefill (EXPRESS_CONNECTOR=0) on {baseline.prefill_url}")
                baseline.start()
                base_url = baseline.prefill_url
                # Stock NixlConnector moves a server's forward thread to the last core; ours moves the
                # prefill's back to its OpenMP core (its first bound CPU). Do the same for the baseline.
                if halves:
                    aligned = place_forward_thread(httpx.URL(base_url).port, [halves[1][0]])
                else:
                    aligned = align_forward_thread(httpx.URL(ep.prefill).port, httpx.URL(base_url).port)
                log(f"baseline forward thread placed: {aligned}")
            where["baseline_prefill"] = placement({"baseline_prefill": httpx.URL(base_url).port})["baseline_prefill"]
            if not args.baseline_prefill:
                where["baseline_prefill"]["forward_thread"] = aligned
            log("connector overhead on unclaimed traffic")
            D["overheads"]["connector_unclaimed"] = overheads.connector_unclaimed(
                ep.prefill, base_url.rstrip("/"), ep.served_model, vocab, prompt_tokens=1024,
                concurrency=4, requests=8 if args.quick else 24, rounds=2 if args.quick else 4, nonce=nonce,
                decode_tokens=32 if args.quick else 64)
            D["overheads"]["connector_unclaimed"]["baseline_cpus"] = (
                "given" if args.baseline_prefill else "own (the decode servers' CPUs)" if halves
                else "shared with the prefill")
        rep.write(complete=True, quiet=False)
    except KeyboardInterrupt as e:
        log(f"interrupted ({e}): the partial report stays in {out}")
        rep.write()
        return 130
    finally:
        if router_cm is not None:
            router_cm.__exit__()
        if baseline is not None:
            baseline.stop()
        if args.start_stack:
            log("stopping the dev stack")
            stack.stop()
    log(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
