"""The bench report: goals, the Markdown tables, the plot (bench_lib.plots). The JSON layout is documented key by key in
docs/performance.md; SCHEMA changes whenever a documented key changes meaning or disappears."""

from __future__ import annotations

from collections.abc import Sequence

from .plots import LANES
from .plots import stack as plot

__all__ = ["SCHEMA", "TOP_KEYS", "SCENARIO_KEYS", "GOALS", "goals", "markdown", "plot", "scenario_record"]

SCHEMA = "expresslane-bench/1"
TOP_KEYS = ("schema", "started_at", "finished_at", "complete", "command", "mode", "host", "model", "bound", "config",
            "endpoints", "scenarios", "overheads", "goals", "samples")
SCENARIO_KEYS = ("lane", "concurrency", "prompt_tokens", "output_tokens", "requests", "ok", "errors",
                 "error_samples", "short_outputs", "completion_tokens", "wall_s", "ttft_ms", "itl_ms", "e2e_ms",
                 "tokens_per_chunk", "user_tok_s", "aggregate_tok_s", "loadavg", "server")

# name -> (target text, comparison); the numbers are the project's goals (docs/performance.md)
GOALS = {
    "express_user_tok_s_vs_native": ">= 3.0x at concurrency 1 (decoding servers' own tok/s, every prompt length)",
    "express_ttft_vs_native": "<= 1.1x at concurrency 1 (p50, every prompt length)",
    "connector_unclaimed_overhead_pct": "< 1 % (overhead + noise < 1: met; overhead - noise >= 1: missed)",
    "router_p50_overhead_ms": "< 2 ms",
}


def scenario_record(lane: str, concurrency: int, prompt_tokens: int, output_tokens: int, stats: dict,
                    loadavg: Sequence[float], server: dict) -> dict:
    rec = {"lane": lane, "concurrency": concurrency, "prompt_tokens": prompt_tokens,
           "output_tokens": output_tokens, **stats, "loadavg": [round(x, 2) for x in loadavg], "server": server}
    return {k: rec[k] for k in SCENARIO_KEYS}


def _server_tok_s(s: dict) -> float | None:
    d = (s.get("server") or {}).get("decode")
    return d.get("tok_s") if d else None


def _find(scenarios: list[dict], lane: str, conc: int, prompt: int) -> dict | None:
    for s in scenarios:
        if s["lane"] == lane and s["concurrency"] == conc and s["prompt_tokens"] == prompt:
            return s
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b not in (None, 0) else None


def goals(scenarios: list[dict], overheads: dict) -> list[dict]:
    out = []
    concs = sorted({s["concurrency"] for s in scenarios})
    c1 = concs[0] if concs else None
    prompts = sorted({s["prompt_tokens"] for s in scenarios})
    tps, client_tps, ttft = {}, {}, {}
    basis = "server_decode_tok_s"
    for p in prompts:
        e, n = _find(scenarios, "express", c1, p), _find(scenarios, "native", c1, p)
        if e and n:
            es, ns = _server_tok_s(e), _server_tok_s(n)
            client_tps[str(p)] = _ratio(e["user_tok_s"]["p50"], n["user_tok_s"]["p50"])
            if es is None or ns is None:
                basis = "client_user_tok_s_p50"
            tps[str(p)] = _ratio(es, ns)
            ttft[str(p)] = _ratio(e["ttft_ms"]["p50"], n["ttft_ms"]["p50"])
    if basis != "server_decode_tok_s":
        tps = dict(client_tps)

    def worst(d: dict, fn) -> float | None:
        vals = [v for v in d.values() if v is not None]
        return fn(vals) if vals and len(vals) == len(d) else None

    m = worst(tps, min)
    out.append({"name": "express_user_tok_s_vs_native", "target": GOALS["express_user_tok_s_vs_native"],
                "measured": m, "per_prompt_tokens": tps, "basis": basis, "client_per_prompt_tokens": client_tps,
                "concurrency": c1, "met": None if m is None else m >= 3.0})
    m = worst(ttft, max)
    out.append({"name": "express_ttft_vs_native", "target": GOALS["express_ttft_vs_native"],
                "measured": m, "per_prompt_tokens": ttft, "concurrency": c1,
                "met": None if m is None else m <= 1.1})
    cu = overheads.get("connector_unclaimed") or {}
    m, noise = cu.get("overhead_pct"), cu.get("noise_pct")
    out.append({"name": "connector_unclaimed_overhead_pct", "target": GOALS["connector_unclaimed_overhead_pct"],
                "measured": m, "noise_pct": noise, "met": within_noise(m, noise, 1.0)})
    ro = overheads.get("router") or {}
    m = ro.get("overhead_p50_ms")
    out.append({"name": "router_p50_overhead_ms", "target": GOALS["router_p50_overhead_ms"], "measured": m,
                "met": None if m is None else m < 2.0})
    return out


def within_noise(measured: float | None, noise: float | None, limit: float) -> bool | None:
    """True when measured + noise < limit, False when measured - noise >= limit, None (inconclusive: the
    noise straddles the limit) otherwise or when nothing was measured."""
    if measured is None:
        return None
    n = abs(noise or 0.0)
    if measured + n < limit:
        return True
    if measured - n >= limit:
        return False
    return None


def _f(x, nd: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _g(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _decode(s: dict) -> str:
    d = (s.get("server") or {}).get("decode")
    return "-" if not d else _f(d["tok_s"])


def _handoff(s: dict) -> str:
    h = (s.get("server") or {}).get("handoff")
    if not h:
        return "-"
    return f"{_f(h['mean_ms'], 2)} ms / {_g(h['gb_per_s'])} GB/s"


def _queue(s: dict) -> str:
    q = (s.get("server") or {}).get("queue_wait_ms")
    return "-" if not q or q["mean_ms"] is None else _f(q["mean_ms"], 0)


def _spill(s: dict) -> str:
    r = (s.get("server") or {}).get("router")
    return "-" if not r else f"{r['spillover']}/{r['rejected']}"


def _placement_lines(where: dict) -> list[str]:
    if not where:
        return []
    lines = ["Placement (CPU affinity of each service's busiest process; CPU it burns with no traffic):", ""]
    for name, g in where.items():
        procs = sorted(g["processes"], key=lambda p: -p["idle_cpu_pct"])
        top = procs[0] if procs else None
        cpus = ",".join(str(c) for c in top["cpus"]) if top else "?"
        lines.append(f"* {name}: {top['name'] if top else '?'} on CPUs {cpus}; idle {_f(g['idle_cpu_pct'], 0)} % "
                     f"of one core")
    return lines + [""]


def markdown(report: dict) -> str:
    cfg, host = report["config"], report["host"]
    partial = "" if report.get("complete", True) else " (INCOMPLETE: interrupted or still running)"
    lines = [f"# expresslane bench ({report['mode']}), {report['started_at']}{partial}", "",
             f"`{report['command']}`", "",
             f"host: {host['cpus']} CPUs, load average (1 min) {host['loadavg_start'][0]:.1f} at start, "
             f"{(host.get('loadavg_end') or [float('nan')])[0]:.1f} at end; copy bandwidth {_f(host.get('copy_gb_per_s'))} GB/s "
             f"(read+write), read bandwidth {_f(host.get('read_gb_per_s'))} GB/s. "
             f"Output {cfg['output_tokens']} tokens per request (ignore_eos), token-id prompts.", "",
             *_placement_lines(host.get("placement") or {}),
             "| lane | conc | prompt | ok/err | TTFT p50 / p90 / p99 ms | ITL p50 / p99 ms | e2e p50 ms | tok/chunk "
             "| user tok/s p50 | server tok/s | aggregate tok/s | queue wait ms | handoff | spill/rej | load |",
             "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for s in report["scenarios"]:
        t, i = s["ttft_ms"], s["itl_ms"]
        lines.append(
            f"| {s['lane']} | {s['concurrency']} | {s['prompt_tokens']} | {s['ok']}/{s['errors']} "
            f"| {_f(t['p50'])} / {_f(t['p90'])} / {_f(t['p99'])} | {_f(i['p50'], 2)} / {_f(i['p99'], 2)} "
            f"| {_f((s.get('e2e_ms') or {}).get('p50'), 0)} "
            f"| {_f(s['tokens_per_chunk'], 2)} | {_f(s['user_tok_s']['p50'])} | {_decode(s)} | {_f(s['aggregate_tok_s'])} "
            f"| {_queue(s)} | {_handoff(s)} | {_spill(s)} | {_f(s['loadavg'][0])} |")
    ov = report["overheads"]
    lines += ["", "## Overheads", ""]
    cu = ov.get("connector_unclaimed")
    if cu:
        lines.append(f"* connector, unclaimed prefill traffic ({cu['prompt_tokens']}-token prompts, max_tokens=1, "
                     f"concurrency {cu['concurrency']}, {cu['rounds']} alternating rounds of {cu['requests']}): "
                     f"with connector {_f(cu['with_connector_tok_s_median'])} prompt tok/s, without "
                     f"{_f(cu['without_connector_tok_s_median'])}; overhead {_f(cu['overhead_pct'], 2)} % "
                     f"(noise {_f(cu['noise_pct'], 2)} %); baseline CPUs: {cu.get('baseline_cpus', '-')}")
        if cu.get("decode_tokens"):
            lines.append(f"* connector, unclaimed decode steps (the prefill server decoding {cu['decode_tokens']} tokens "
                         f"itself, 128-token prompts, c=1): per-user tok/s with connector "
                         f"{cu['with_connector_decode_tok_s']}, without {cu['without_connector_decode_tok_s']} "
                         f"(per round); overhead {_f(cu['decode_overhead_pct'], 2)} % "
                         f"(noise {_f(cu['decode_noise_pct'], 2)} %)")
    for c in ov.get("connector_claimed") or ():
        lines.append(f"* connector, claimed traffic, {c['prompt_tokens']}-token prompts at concurrency "
                     f"{c['concurrency']}: vLLM prefill time claimed {_f(c['claimed_prefill_ms'], 2)} ms vs "
                     f"unclaimed (native lane) {_f(c['unclaimed_prefill_ms'], 2)} ms "
                     f"({_f(c['overhead_ms'], 2)} ms, {_f(c['overhead_pct'], 1)} %); staging copy inside the "
                     f"forward {_f(c['staging_copy_ms'], 3)} ms")
    ro = ov.get("router")
    if ro:
        lines.append(f"* router ({ro['requests']} sequential non-stream max_tokens=1 requests per path, "
                     f"{ro['prompt_tokens']}-token prompts): direct prefill+decode p50 {_f(ro['direct_p50_ms'], 2)} ms, "
                     f"through the router {_f(ro['router_p50_ms'], 2)} ms: overhead {_f(ro['overhead_p50_ms'], 2)} ms "
                     f"(median of paired differences {_f(ro['paired_median_ms'], 2)} ms) "
                     f"(single vLLM call p50 {_f(ro['single_p50_ms'], 2)} ms; errors {ro['errors']}); router CPU "
                     f"{_f(ro.get('router_cpu_ms_per_request'), 2)} ms per request over the run (per request: p50 "
                     f"{_f(ro.get('router_cpu_ms_p50'), 2)} ms, p90 {_f(ro.get('router_cpu_ms_p90'), 2)} ms)")
    lines += ["", "## Goals", "", "| goal | target | measured | met |", "|---|---|---:|---|"]
    for g in report["goals"]:
        met = {True: "yes", False: "**no**", None: "n/a" if g["measured"] is None else "inconclusive"}[g["met"]]
        lines.append(f"| {g['name']} | {g['target']} | {_f(g['measured'], 3)} | {met} |")
    b = report.get("bound")
    if b:
        lines += ["", "## Batch-1 bandwidth bound", "",
                  f"weights read per token {b['weight_bytes_read_per_token'] / 1e6:.2f} MB, KV "
                  f"{b['kv_bytes_per_token']} B per context token, bandwidth {_f(b['bandwidth_gb_per_s'])} GB/s "
                  f"({b['bandwidth_kind']})", "",
                  "| context tokens | bytes per token | bound tok/s |", "|---:|---:|---:|"]
        for row in b["per_context"]:
            lines.append(f"| {row['context_tokens']} | {row['bytes_per_token'] / 1e6:.2f} MB | {_f(row['tok_s_bound'], 0)} |")
    return "\n".join(lines) + "\n"
