"""Where a step over several users' rows spends its time, by row count (GPU).

Why: on an H100 at the 8B shape a step of 4 users at 1k context took 6.46 ms against 5.72 ms alone (0.885x per
user), while its bytes grow by 3 % (docs/bench/2026-12-07-seats/). At 8k every further user costs what its K/V
reads cost; at 1k the step jumps between 2 and 4 rows and then hardly grows to 8. This probe splits that time:

    PYTHONPATH=engine/src:/tmp/site python3 docs/bench/2026-12-07-seats-profile/probe_seats_step.py \
        --shape llama-8b --contexts 1024,8192 --rows 1,2,3,4,5,6,8 --out OUT

For each context and row count R (R users of one row each, seats 0 .. R-1, no speculation) it prints:
- `sched_ms`: wall time of one scheduler step (decode/batch.py: host planning, the graph replay, the argmax sync),
  best of 3 runs of 64 steps;
- `graph_ms`: GPU time of one graph replay of runner.forward_rows (CUDA events over 64 replays of one plan);
- the kernels of one eager lean forward_seats by family (torch.profiler; us a step): the GEMVs by projection,
  the split-KV attention's partial and merge kernels, the norms, the rest.
The bound is the step's bytes (the weights once plus each row's live K/V) at the device's copy bandwidth.
One JSON line per (context, R) goes to OUT/probe.jsonl; the table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections import defaultdict

import torch

from expresslane.engine.decode.bench import build_engine, copy_bandwidth
from expresslane.engine.decode.bench_users import prefill_seats, run_users, user_prompts
from expresslane.engine.models import fused_dot


def kernel_family(name: str) -> str:
    n = name.lower()
    for key, fam in (("qkv_rope", "qkv_rope"), ("gate_up", "gate_up_silu"), ("gemv_residual", "gemv_residual"),
                     ("norm_tail", "norm"), ("rms", "norm"), ("split_kv_partial", "attn_partial"),
                     ("split_kv_merge", "attn_merge"), ("_gemv_kernel", "lm_head"), ("index_select", "embed"),
                     ("memcpy", "copy"), ("memset", "memset")):
        if key in n:
            return fam
    return "other:" + re.sub(r"[^a-z0-9_]+", "_", n)[:40]


def profile_eager(lean, tokens: torch.Tensor, rows: torch.Tensor, reps: int) -> dict[str, float]:
    """us a step by kernel family of the eager forward_seats (the graph replays the same kernels)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        lean.forward_seats(tokens, rows)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            lean.forward_seats(tokens, rows)
        torch.cuda.synchronize()
    fam: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0.0)
        if not t:
            continue
        f = kernel_family(ev.key)
        fam[f] += t / reps
        count[f] += ev.count // reps
    return {f: round(v, 1) for f, v in sorted(fam.items(), key=lambda kv: -kv[1])} | {
        "_launches": sum(count.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--rows", default="1,2,3,4,5,6,8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    seats = max(rows_list)
    t0 = time.perf_counter()
    from expresslane.engine.decode.speculative import SpeculationConfig
    engine = build_engine(None, args.shape, dtype="bfloat16", device="cuda", seats=seats,
                          max_seq_len=max(contexts) + 3 * args.steps + 64, speculation=SpeculationConfig(k=4))
    engine.warmup()
    bw = copy_bandwidth(engine.device)
    runner = engine.runner
    lean = runner._lean
    kv_token = engine.geometry.token_bytes()
    weights = engine.weight_bytes()
    print(f"shape={args.shape} seats={engine.seats} gemv={runner.lean_gemv_choice} step={runner.mode.value} "
          f"weights={weights / 1e9:.2f}GB bw={bw / 1e9:.0f}GB/s build+warmup={time.perf_counter() - t0:.0f}s",
          flush=True)
    out = open(os.path.join(args.out, "probe.jsonl"), "a")
    for ctx in contexts:
        prompts = user_prompts(seats, ctx, engine.vocab_size, None)
        firsts = prefill_seats(engine, prompts)
        for r in rows_list:
            best = min((run_users(engine, prompts[:r], firsts, args.steps, False) for _ in range(3)),
                       key=lambda x: x["seconds"])
            sched_ms = 1e3 * best["seconds"] / best["steps"]
            # graph replays of one fixed plan: each row at position ctx + 2 * steps of its seat (scratch rows)
            pos = ctx + 2 * args.steps
            plan = [(s, pos, [firsts[s]]) for s in range(r)]
            runner.forward_rows(plan, False)
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(args.steps):
                runner.forward_rows(plan, False)
            b.record()
            torch.cuda.synchronize()
            graph_ms = a.elapsed_time(b) / args.steps
            # the eager kernels of the same step
            tokens = torch.tensor(firsts[:r], dtype=torch.long, device="cuda")
            rows = torch.zeros(2 * fused_dot.RP, dtype=torch.long, device="cuda")
            rows[:r] = pos
            rows[fused_dot.RP:fused_dot.RP + r] = torch.tensor(
                [runner.cache.seat_start(s) + pos for s in range(r)], dtype=torch.long)
            try:
                kernels = profile_eager(lean, tokens, rows, 8)
            except Exception as e:  # noqa: BLE001 - a diagnosis: say it failed and go on
                kernels = {"_error": repr(e)[:200]}
            bound_ms = 1e3 * (weights + r * (ctx + args.steps) * kv_token) / bw
            row = {"shape": args.shape, "context": ctx, "rows": r, "sched_ms": round(sched_ms, 4),
                   "graph_ms": round(graph_ms, 4), "bound_ms": round(bound_ms, 4), "kernels_us": kernels}
            out.write(json.dumps(row) + "\n")
            out.flush()
            top = ", ".join(f"{k} {v}" for k, v in kernels.items() if not k.startswith("_"))
            print(f"ctx={ctx} R={r}: sched {sched_ms:.3f} ms, graph {graph_ms:.3f} ms, bound {bound_ms:.3f} ms | "
                  f"kernels us: {top} | launches {kernels.get('_launches')}", flush=True)


if __name__ == "__main__":
    main()
