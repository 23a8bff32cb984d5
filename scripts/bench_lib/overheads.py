"""The three overhead measurements: our connector on unclaimed prefill traffic, our connector on claimed
traffic, and the router. Method and caveats: docs/performance.md."""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import httpx

from expresslane.router.lanes.native import decode_body
from expresslane.router.lanes.prefill import native_prefill_body

from .client import completion_body, run_closed_loop, timed_post, token_prompt
from .stats import percentile

__all__ = ["connector_unclaimed", "connector_claimed", "router_overhead", "paired_overhead_pct", "threads_cpu_ns"]


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


async def _prefill_round(url: str, bodies: list[dict], concurrency: int) -> tuple[float, int]:
    """Closed loop of non-streaming POSTs; (wall seconds, errors)."""
    errors = 0
    it = iter(bodies)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10), trust_env=False) as client:

        async def user() -> None:
            nonlocal errors
            for body in it:
                r = await client.post(url, json=body)
                if r.status_code != 200:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        return time.perf_counter() - t0, errors


def paired_overhead_pct(with_tps: list[float], without_tps: list[float]) -> tuple[float | None, float | None]:
    """(overhead %, noise %) from paired rounds: per round r = without / with - 1 (positive = the connector
    costs throughput); overhead = median of r; noise = half the range of r (None with one round)."""
    ratios = [(wo / w - 1.0) * 100 for w, wo in zip(with_tps, without_tps) if w > 0]
    if not ratios:
        return None, None
    noise = (max(ratios) - min(ratios)) / 2 if len(ratios) > 1 else None
    return statistics.median(ratios), noise


def _decode_round(url: str, model: str, vocab: int, key: str, tokens: int, n: int = 2) -> tuple[float | None, int]:
    """Median per-user tok/s of `n` sequential streaming requests (128-token prompts, `tokens` outputs)."""
    bodies = [completion_body(model, token_prompt(128, f"{key}/{i}", vocab), tokens, stream=True) for i in range(n)]
    results, _ = asyncio.run(run_closed_loop(url, bodies, 1))
    speeds = [v for r in results if r.ok and (v := r.user_tok_s) is not None]
    return (statistics.median(speeds) if speeds else None), sum(1 for r in results if not r.ok)


def connector_unclaimed(with_url: str, without_url: str, model: str, vocab: int, *, prompt_tokens: int,
                        concurrency: int, requests: int, rounds: int, nonce: str, decode_tokens: int = 0,
                        settle_s: float = 2.0) -> dict:
    """The stack's prefill (MultiConnector[Nixl, ExpressLane]) vs a prefill without our connector
    (MultiConnector[Nixl]) on plain requests, which no connector claims:
      prefill throughput: prompt tokens/s of `requests` max_tokens=1 requests at `concurrency`
      decode speed (decode_tokens > 0): per-user tok/s of two streaming 128-token-prompt requests, c=1
    Rounds alternate which server goes first; round 0 warms both up and is not recorded. Each measurement
    starts `settle_s` after the previous one ended: a vLLM worker keeps busy-polling its message queue for
    about a second after its last step, and on a small host that would slow whichever server goes second."""
    with_tps, without_tps, with_dec, without_dec, errors = [], [], [], [], 0
    for rnd in range(rounds + 1):
        order = [("with", with_url), ("without", without_url)]
        if rnd % 2:
            order.reverse()
        for which, base in order:
            bodies = [{"model": model, "prompt": token_prompt(prompt_tokens, f"{nonce}/cu/{rnd}/{which}/{i}", vocab),
                       "max_tokens": 1, "temperature": 0.0}
                      for i in range(requests if rnd else max(2, concurrency))]
            time.sleep(settle_s)
            wall, err = asyncio.run(_prefill_round(base + "/v1/completions", bodies, concurrency))
            dec, derr = (None, 0)
            if decode_tokens:
                time.sleep(settle_s)
                dec, derr = _decode_round(base + "/v1/completions", model, vocab, f"{nonce}/cud/{rnd}/{which}",
                                          decode_tokens if rnd else 8)
            if rnd == 0:
                continue
            errors += err + derr
            tps = len(bodies) * prompt_tokens / wall
            (with_tps if which == "with" else without_tps).append(tps)
            if dec is not None:
                (with_dec if which == "with" else without_dec).append(dec)
    overhead, noise = paired_overhead_pct(with_tps, without_tps)
    d_over, d_noise = paired_overhead_pct(with_dec, without_dec) if len(with_dec) == len(without_dec) else (None, None)
    return {"prompt_tokens": prompt_tokens, "concurrency": concurrency, "requests": requests, "rounds": rounds,
            "with_connector_tok_s": [round(x, 1) for x in with_tps],
            "without_connector_tok_s": [round(x, 1) for x in without_tps],
            "with_connector_tok_s_median": _r(statistics.median(with_tps), 1) if with_tps else None,
            "without_connector_tok_s_median": _r(statistics.median(without_tps), 1) if without_tps else None,
            "overhead_pct": _r(overhead), "noise_pct": _r(noise), "settle_s": settle_s,
            "decode_tokens": decode_tokens,
            "with_connector_decode_tok_s": [round(x, 1) for x in with_dec],
            "without_connector_decode_tok_s": [round(x, 1) for x in without_dec],
            "decode_overhead_pct": _r(d_over), "decode_noise_pct": _r(d_noise),
            "errors": errors}


def connector_claimed(scenarios: list[dict]) -> list[dict]:
    """Per prompt length at the lowest concurrency: the prefill server's own mean prefill time for the
    express lane's (claimed) requests vs the native lane's (unclaimed by our connector; NixlConnector's
    do_remote_decode), and the connector's staging-copy time inside the forward."""
    if not scenarios:
        return []
    c1 = min(s["concurrency"] for s in scenarios)
    out = []
    for p in sorted({s["prompt_tokens"] for s in scenarios}):
        pick = {s["lane"]: s for s in scenarios if s["concurrency"] == c1 and s["prompt_tokens"] == p}
        e, n = pick.get("express"), pick.get("native")
        if not e or not n:
            continue
        ep, np_ = (e["server"].get("prefill_server") or {}), (n["server"].get("prefill_server") or {})
        claimed, unclaimed = ep.get("prefill_mean_ms"), np_.get("prefill_mean_ms")
        conn = e["server"].get("connector") or {}
        diff = claimed - unclaimed if claimed is not None and unclaimed is not None else None
        out.append({"prompt_tokens": p, "concurrency": c1, "claimed_prefill_ms": claimed,
                    "unclaimed_prefill_ms": unclaimed, "overhead_ms": _r(diff),
                    "overhead_pct": _r(100 * diff / unclaimed) if diff is not None and unclaimed else None,
                    "claimed_ttft_ms": ep.get("ttft_mean_ms"), "unclaimed_ttft_ms": np_.get("ttft_mean_ms"),
                    "staging_copy_ms": conn.get("staging_copy_mean_ms")})
    return out


def router_overhead(router_url: str, native_alias: str, prefill_url: str, native_url: str, model: str,
                    vocab: int, *, prompt_tokens: int, requests: int, nonce: str, warmup: int = 3,
                    router_pids: list[int] | None = None, idle_s: float = 10.0) -> dict:
    """Sequential non-streaming max_tokens=1 requests, three paths interleaved request by request:
      router  POST router /v1/completions (native lane: prefill leg + decode leg)
      direct  the same two legs sent by this client itself, with the router's own body builders
      single  one plain request to the prefill server (context only)
    overhead = p50(router) - p50(direct); also the median of the per-iteration differences (robust to drift).
    With `router_pids`, the router processes' CPU time over the run / the requests sent through it: the work
    the router adds, which no wait for a shared core inflates. That gross number also holds the router's
    background work (health probes, its server's housekeeping tick) over the whole run, which lasts the three
    paths' time: so the router's CPU is also measured over `idle_s` seconds with no traffic first
    (router_idle_cpu_ms_per_s, ~10 ms resolution of /proc's CPU times over the window), and
    router_cpu_ms_per_request_net = (CPU over the run - idle rate x the run's wall time) / requests.
    Per request (requests go one at a time): the router processes' threads' CPU in ns (schedstat, not ticks)
    read right before each router request is sent and right after its reply, so router_cpu_ms_p50 / _p90 /
    _mean are that request's own CPU plus whatever background work fell inside it (measured requests only,
    no warm-up); router_cpu_ms_per_request_in_window_idle adds up the idle rate over those windows."""
    lat: dict[str, list[float]] = {"router": [], "direct": [], "single": []}
    per_req_cpu: list[float] = []  # ms of router CPU inside each measured router request (schedstat)
    per_req_wall: list[float] = []  # s: that request's wall time
    errors: list[str] = []
    idle_rate = None
    if router_pids and idle_s > 0:
        i0, t_i0 = _cpu_seconds(router_pids), time.perf_counter()
        time.sleep(idle_s)
        i1, t_i1 = _cpu_seconds(router_pids), time.perf_counter()
        if i0 is not None and i1 is not None:
            idle_rate = (i1 - i0) / (t_i1 - t_i0)
    cpu0, wall0 = _cpu_seconds(router_pids), time.perf_counter()
    with httpx.Client(timeout=httpx.Timeout(600, connect=10), trust_env=False) as client:

        def one(path: str, key: str) -> tuple[float, str | None]:
            body = {"model": model, "prompt": token_prompt(prompt_tokens, key, vocab), "max_tokens": 1,
                    "temperature": 0.0, "ignore_eos": True}
            if path == "router":
                c0 = threads_cpu_ns(router_pids)
                dt, _, err = timed_post(client, router_url + "/v1/completions", dict(body, model=native_alias))
                c1 = threads_cpu_ns(router_pids)
                if c0 is not None and c1 is not None and err is None:
                    last_cpu[:] = [(c1 - c0) / 1e6, dt]
                return dt, err
            if path == "single":
                dt, _, err = timed_post(client, prefill_url + "/v1/completions", body)
                return dt, err
            t0 = time.perf_counter()
            _, pre, err = timed_post(client, prefill_url + "/v1/completions", native_prefill_body(body, model))
            if err is None:
                kvp = (pre or {}).get("kv_transfer_params")
                _, _, err = timed_post(client, native_url + "/v1/completions",
                                       decode_body(body, model, kvp, force_usage=True))
            return time.perf_counter() - t0, err

        paths = list(lat)
        paired: list[float] = []
        last_cpu: list[float] = []  # [router CPU ms, wall s] of the last router request
        for i in range(warmup + requests):
            rot = paths[i % 3:] + paths[:i % 3]  # rotate the order so no path always runs first
            got = {}
            for path in rot:
                dt, err = one(path, f"{nonce}/router/{path}/{i}")
                if err:
                    errors.append(f"{path}: {err}")
                elif i >= warmup:
                    lat[path].append(dt)
                    got[path] = dt
                    if path == "router" and last_cpu:
                        per_req_cpu.append(last_cpu[0])
                        per_req_wall.append(last_cpu[1])
                last_cpu.clear()
            if "router" in got and "direct" in got:
                paired.append(got["router"] - got["direct"])
    cpu1, wall = _cpu_seconds(router_pids), time.perf_counter() - wall0
    sent = warmup + requests
    router_cpu_ms = _r(1e3 * (cpu1 - cpu0) / sent) if cpu0 is not None and cpu1 is not None else None
    net_ms = (_r(1e3 * (cpu1 - cpu0 - idle_rate * wall) / sent)
              if router_cpu_ms is not None and idle_rate is not None else None)
    p50 = {k: percentile(v, 50) for k, v in lat.items()}
    ms = {k: _r(None if v is None else 1e3 * v) for k, v in p50.items()}
    over = ms["router"] - ms["direct"] if ms["router"] is not None and ms["direct"] is not None else None
    return {"prompt_tokens": prompt_tokens, "requests": requests, "errors": len(errors),
            "error_samples": errors[:3], "router_p50_ms": ms["router"], "direct_p50_ms": ms["direct"],
            "single_p50_ms": ms["single"], "overhead_p50_ms": _r(over),
            "paired_median_ms": _r(1e3 * percentile(paired, 50)) if paired else None,
            "router_p90_ms": _r(1e3 * percentile(lat["router"], 90)) if lat["router"] else None,
            "direct_p90_ms": _r(1e3 * percentile(lat["direct"], 90)) if lat["direct"] else None,
            "router_cpu_ms_per_request": router_cpu_ms,  # gross: background work over the run included
            "router_idle_cpu_ms_per_s": _r(None if idle_rate is None else 1e3 * idle_rate), "idle_s": idle_s,
            "run_wall_s": _r(wall), "router_cpu_ms_per_request_net": net_ms,
            "router_cpu_ms_p50": _r(percentile(per_req_cpu, 50)) if per_req_cpu else None,
            "router_cpu_ms_p90": _r(percentile(per_req_cpu, 90)) if per_req_cpu else None,
            "router_cpu_ms_mean": _r(statistics.fmean(per_req_cpu)) if per_req_cpu else None,
            "router_cpu_ms_per_request_in_window_idle": (
                _r(idle_rate * 1e3 * statistics.fmean(per_req_wall)) if per_req_wall and idle_rate is not None
                else None),
            "router_cpu_samples": len(per_req_cpu),
            "router_cpu_ms_per_request_list": [round(x, 3) for x in per_req_cpu]}


def _cpu_seconds(pids: list[int] | None) -> float | None:
    """User + system CPU seconds of these processes so far; None without pids or when one is gone."""
    if not pids:
        return None
    import psutil

    try:
        return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)
    except psutil.Error:
        return None


def threads_cpu_ns(pids: list[int] | None) -> int | None:
    """CPU time in ns of all threads of these processes so far: the first field of each
    /proc/<pid>/task/<tid>/schedstat (the scheduler's exact runtime, not 10 ms ticks). A thread that exits
    between two readings takes its time with it (the router keeps its threads). None without pids, where
    schedstat is not there, or when a process is gone."""
    if not pids:
        return None
    total = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return None
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # the thread ended between the listing and the read
    return total
