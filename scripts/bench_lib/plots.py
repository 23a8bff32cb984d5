"""The bench's plots, rendered from JSON the repo's own benches write (never drawn by hand):

- `stack(report, path)`: a `scripts/bench.py` report (bench.json, schema expresslane-bench/1): per-user decode tok/s
  and TTFT by prompt length at the lowest concurrency, per-user and aggregate tok/s by concurrency, per lane;
- `engines(records, path)`: JSON lines of the decode bench (`python -m expresslane.engine.decode.bench --json F`:
  `model`, `context`, `mode`, `tok_per_s`, optional `bound_tok_per_s`; an `engine` key names another engine measured
  on the same GPU, e.g. stock vLLM): tok/s by context, one panel per model, one line per engine and mode, and the
  bandwidth bound where the records carry it.

`python scripts/bench.py --plot-from FILE --plot-out PNG` renders either from its file.
"""

from __future__ import annotations

import json
from pathlib import Path

LANES = ("express", "native", "single")
COLORS = {"express": "tab:red", "native": "tab:blue", "single": "tab:gray"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _server_or_client_tok_s(s: dict) -> float | None:
    """The decoding server's own tok/s (burst delivery cannot distort it), else the client-side p50."""
    v = ((s.get("server") or {}).get("decode") or {}).get("tok_s")
    return v if v is not None else s["user_tok_s"]["p50"]


def _series(scen: list[dict], lane: str, x_key: str, fixed: dict, value) -> list[tuple[float, float]]:
    return sorted((s[x_key], v) for s in scen
                  if s["lane"] == lane and all(s[k] == want for k, want in fixed.items())
                  and (v := value(s)) is not None)


def _finish(ax, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    handles = ax.get_legend_handles_labels()[0]
    if handles:
        ax.legend(fontsize=7, ncol=2 if len(handles) > 6 else 1)


def stack(report: dict, path) -> None:
    plt = _pyplot()
    scen = report["scenarios"]
    prompts = sorted({s["prompt_tokens"] for s in scen})
    concs = sorted({s["concurrency"] for s in scen})
    c1 = concs[0] if concs else 1
    by_conc = len(concs) > 1  # the concurrency row only when there is more than one concurrency
    fig, axes = plt.subplots(2 if by_conc else 1, 2, figsize=(12, 8.5 if by_conc else 4.5), squeeze=False)
    a_speed, a_ttft = axes[0]
    a_user_c, a_agg_c = axes[1] if by_conc else (None, None)
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
    for lane in LANES:
        pts = _series(scen, lane, "prompt_tokens", {"concurrency": c1}, _server_or_client_tok_s)
        if pts:
            a_speed.plot(*zip(*pts), "-o", color=COLORS[lane], label=lane)
        pts = _series(scen, lane, "prompt_tokens", {"concurrency": c1}, lambda s: s["ttft_ms"]["p50"])
        p90 = dict(_series(scen, lane, "prompt_tokens", {"concurrency": c1}, lambda s: s["ttft_ms"]["p90"]))
        if pts:
            xs, ys = zip(*pts)
            a_ttft.plot(xs, ys, "-o", color=COLORS[lane], label=f"{lane} p50")
            a_ttft.plot(xs, [p90.get(x, y) for x, y in pts], ":", color=COLORS[lane], label=f"{lane} p90")
        for k, p in enumerate(prompts if by_conc else []):
            style = ["-", "--", ":", "-."][k % 4]
            pts = _series(scen, lane, "concurrency", {"prompt_tokens": p}, _server_or_client_tok_s)
            if pts:
                a_user_c.plot(*zip(*pts), style, marker="o", color=COLORS[lane], label=f"{lane}, prompt {p}")
            pts = _series(scen, lane, "concurrency", {"prompt_tokens": p}, lambda s: s["aggregate_tok_s"])
            if pts:
                a_agg_c.plot(*zip(*pts), style, marker="o", color=COLORS[lane], label=f"{lane}, prompt {p}")
    _finish(a_speed, "prompt tokens", "per-user decode tok/s", f"Per-user decode speed, concurrency {c1}")
    _finish(a_ttft, "prompt tokens", "TTFT ms (client side)", f"Time to first token, concurrency {c1}")
    a_speed.set_ylim(bottom=0)
    a_ttft.set_yscale("log")
    if by_conc:
        for ax in (a_user_c, a_agg_c):
            ax.set_xticks(concs, [str(c) for c in concs])
        _finish(a_user_c, "concurrency (users)", "per-user decode tok/s", "Per-user decode speed by concurrency")
        _finish(a_agg_c, "concurrency (users)", "aggregate tok/s (all users)", "Throughput by concurrency")
    for ax in (a_speed, a_ttft):
        ax.set_xticks(prompts, [str(p) for p in prompts])
    fig.suptitle(f"expresslane bench {report['started_at']} ({report['mode']}, {report['host']['cpus']} CPUs, "
                 f"load avg {report['host']['loadavg_start'][0]:.1f} at start; decode speed: the servers' own)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label(r: dict) -> str:
    """The series of a decode-bench record: the engine, its mode, and (where the record says) the lean step's
    GEMV family and whether the engine was built without speculation (a plain node)."""
    mode = r.get("mode", "plain")
    name = r.get("engine", "expresslane")
    if r.get("speculation_k") == 0:
        name += " (no speculation)"
    if r.get("gemv"):
        name += f" [{r['gemv']}]"
    return f"{name}, {mode}" if mode != "plain" else name


def engines(records: list[dict], path, title: str = "") -> None:
    plt = _pyplot()
    models = sorted({r["model"] for r in records})
    if not models:
        raise ValueError("no decode-bench records (lines with model, context, tok_per_s) to plot")
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        ax.set_xscale("log", base=2)
        rows = [r for r in records if r["model"] == model]
        for label in sorted({_label(r) for r in rows}):
            pts = sorted((r["context"], r["tok_per_s"]) for r in rows if _label(r) == label)
            ax.plot(*zip(*pts), "-o", label=label)
        bound = sorted({(r["context"], r["bound_tok_per_s"]) for r in rows if r.get("bound_tok_per_s")})
        if bound:
            ax.plot(*zip(*bound), "k--", alpha=0.6, label="bandwidth bound")
        contexts = sorted({r["context"] for r in rows})
        ax.set_xticks(contexts, [f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts])
        ax.set_ylim(bottom=0)
        _finish(ax, "context tokens", "tokens/s, batch 1", Path(model).name)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def from_file(src: Path, out: Path) -> str:
    """Render the plot that fits the file: a bench.json report, or decode-bench JSON lines. Returns which."""
    text = Path(src).read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and doc.get("schema", "").startswith("expresslane-bench/"):
        if not doc.get("scenarios"):
            raise ValueError(f"{src}: the report has no scenarios to plot")
        stack(doc, out)
        return "stack"
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    records = [r for r in records if isinstance(r, dict) and {"model", "context", "tok_per_s"} <= r.keys()]
    engines(records, out, title=Path(src).parent.name)
    return "engines"
