"""Does packing the CUDA-core GEMVs' accumulators make a verify cheap? (a probe: it prints numbers and writes
JSON lines; the engine uses what it decides through models/fused.py's candidate lists).

The lean step's CUDA-core kernels (models/fused.py) keep one float32 accumulator per weight element of a tile and
row, BLOCK_N x BLOCK_K of them; a verify of five rows keeps five, and the block shapes that do not spill run at a
few warps per SM (241 registers a thread at 4x1024p, five rows, sm_90 ptxas). A packed block shape (the fifth
element of a candidate: fused._fma) adds each group of 8 columns, one vector load in one thread, into one
accumulator as a chain of FMAs: the same FMAs, an eighth of the accumulators (4x1024p packed: 40 registers at one
row, 80 at five). The hypothesis: a five-row verify is latency-bound at low occupancy, not issue-bound, so packing
brings it towards one row's cost without slowing the one-row step.

For each projection of the 8B (and 1B) shape and each candidate block shape, packed or not, it times the kernel at
one row and at five (CUDA-graph replay, median), reads what the five-row kernel spills. That a packed
shape's rows are the one-row launch's bits is the tests' (tests/unit/engine/test_fused_kernels.py).

    python3 docs/bench/2026-12-05-h200-hint-packed/probe_packed_gemv.py --json OUT.jsonl [--model 8b|1b|both]     # on a CUDA machine
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

from expresslane.engine.models import fused
from expresslane.engine.models.precompile import precompile
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "2026-12-04-tensor-core-verify"))
from probe_verify_kernels import SHAPES_1B, SHAPES_8B  # noqa: E402  (that lab note's probe)

ROWS = 5
PACKED_SINGLE = [(4, 1024, 1, 4, 8), (4, 2048, 0, 4, 8), (4, 2048, 1, 4, 8), (8, 1024, 0, 4, 8),
                 (8, 1024, 1, 4, 8), (8, 512, 1, 4, 8), (16, 512, 1, 4, 8), (4, 1024, 1, 8, 8),
                 (8, 1024, 1, 8, 8), (16, 1024, 1, 8, 8), (4, 2048, 0, 8, 8), (8, 2048, 0, 8, 8),
                 (4, 512, 1, 4, 8), (4, 1024, 0, 4, 4)]
PACKED_PAIR = [(2, 2048, 0, 4, 8), (4, 1024, 0, 4, 8), (4, 1024, 1, 4, 8), (4, 512, 1, 4, 8), (8, 512, 1, 4, 8),
               (8, 256, 1, 4, 8), (4, 512, 1, 8, 8), (8, 512, 1, 8, 8), (16, 256, 1, 8, 8), (4, 1024, 1, 8, 8),
               (8, 1024, 0, 8, 8), (2, 1024, 1, 4, 8), (4, 256, 1, 4, 8), (8, 256, 1, 8, 8)]
# (name, N, K, the lean step's kernel, whether its input is normalised in the kernel): the other probe's lists
SHAPES = {"8b": SHAPES_8B, "1b": SHAPES_1B}
PAIRED = {"norm_qkv_rope", "norm_gate_up_silu"}  # the kernels that own two row sets (PAIR_CONFIGS)
HEADS = {6144: (128, 32, 8), 3072: (64, 32, 8)}


def make_case(n, k, launcher, device, dtype=torch.bfloat16):
    """A launcher call `run(rows, cfg, compile_only=False)` over fixed random weights and ROWS input rows."""
    from expresslane.engine.models.config import RopeConfig
    from expresslane.engine.models.rope import rope_tables

    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(dtype).to(device)  # noqa: E731
    w = rnd(n, k)
    nw = (1 + rnd(k)).contiguous()
    x = torch.randn(ROWS, k, generator=g).to(dtype).to(device)
    if launcher == "gemv_residual":
        res0 = rnd(ROWS, n)
        res = res0.clone()

        def run(r, cfg, compile_only=False):
            res.copy_(res0)
            return fused.gemv_residual(x[:r] if r > 1 else x[0], w, None, res[:r] if r > 1 else res[0],
                                       config=cfg, compile_only=compile_only)
        return run
    if launcher == "norm_gemv":
        out = torch.empty(ROWS, n, dtype=torch.float32, device=device)

        def run(r, cfg, compile_only=False):
            return fused.norm_gemv(x[:r] if r > 1 else x[0], nw, 1e-5, w, out[:r] if r > 1 else out[0], config=cfg,
                                   compile_only=compile_only)
        return run
    if launcher == "norm_gate_up_silu":
        out = torch.empty(ROWS, n // 2, dtype=dtype, device=device)

        def run(r, cfg, compile_only=False):
            return fused.norm_gate_up_silu(x[:r] if r > 1 else x[0], nw, 1e-5, w, None,
                                           out[:r] if r > 1 else out[0], config=cfg, compile_only=compile_only)
        return run
    d, nh, nkv = HEADS[n]
    cos, sin = rope_tables(RopeConfig(), d, 64, dtype, device)
    q = torch.empty(ROWS, nh * d, dtype=dtype, device=device)
    kc = torch.zeros(64, nkv, d, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    start = torch.tensor([3], device=device)

    def run(r, cfg, compile_only=False):
        return fused.norm_qkv_rope(x[:r] if r > 1 else x[0], nw, 1e-5, w, None, cos, sin, start,
                                   q[:r] if r > 1 else q[0], kc, vc, nh, nkv, d, config=cfg,
                                   compile_only=compile_only)
    return run


def fits(cfg, n, k, launcher):
    half = HEADS.get(n, (0,))[0] // 2
    if launcher == "norm_qkv_rope" and half % cfg[0]:
        return False
    return fused._fits(cfg, k, None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--model", default="both", choices=("8b", "1b", "both"))
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    models = ["8b", "1b"] if args.model == "both" else [args.model]
    t_start = time.perf_counter()
    with open(args.json, "a") as out:
        for model in models:
            for name, n, k, launcher, _ in SHAPES[model]:
                pair = launcher in PAIRED
                base = fused.PAIR_CONFIGS if pair else fused.GEMV_CONFIGS
                packed = PACKED_PAIR if pair else PACKED_SINGLE
                cands = [c for c in dict.fromkeys(list(base) + packed) if fits(c, n, k, launcher)]
                run = make_case(n, k, launcher, device)
                t0 = time.perf_counter()
                precompile([functools.partial(run, r, c, compile_only=True) for c in cands for r in (1, ROWS)])
                compile_s = time.perf_counter() - t0
                rows = []
                for c in cands:
                    compiled = {r: run(r, c, compile_only=True) for r in (1, ROWS)}  # compiled above: the cache's
                    spill5 = fused.spilled_bytes(compiled[ROWS]) if compiled[ROWS] is not None else -1
                    regs = [getattr(compiled[r], "n_regs", -1) for r in (1, ROWS)]
                    if spill5 >= 1 << 30:
                        rows.append({"cfg": list(c), "label": fused._label(c), "runnable": False})
                        continue
                    us = {r: 1e3 * triton.testing.do_bench_cudagraph(functools.partial(run, r, c), rep=30,
                                                                     return_mode="median") for r in (1, ROWS)}
                    rows.append({"cfg": list(c), "label": fused._label(c), "us1": round(us[1], 2),
                                 "us5": round(us[ROWS], 2), "ratio": round(us[ROWS] / us[1], 3), "spill5": spill5,
                                 "regs": regs, "packed": bool(fused._pack(c))})
                live = [r for r in rows if r.get("us1")]

                def best(pred, key):
                    return min((r for r in live if pred(r)), key=lambda r: r[key], default=None)
                plain = best(lambda r: True, "us1")
                spec_now = best(lambda r: not r["packed"] and r["spill5"] <= 0, "us1")
                packed_best = best(lambda r: r["packed"], "us1")
                packed_t5 = best(lambda r: r["packed"], "us5")
                rec = {"model": model, "shape": name, "n": n, "k": k, "kernel": launcher,
                       "compile_s": round(compile_s, 1), "candidates": rows, "device": torch.cuda.get_device_name(),
                       "triton": triton.__version__, "torch": torch.__version__}
                out.write(json.dumps(rec) + "\n")
                out.flush()

                def fmt(r):
                    return "-" if r is None else f"{r['label']:>14} {r['us1']:8.2f} {r['us5']:8.2f} {r['ratio']:5.2f}"
                print(f"{model} {name:8} one-row best {fmt(plain)} | spec pick now {fmt(spec_now)} | packed T1 best "
                      f"{fmt(packed_best)} | packed T5 best {fmt(packed_t5)}  (compile {compile_s:.0f} s)",
                      flush=True)
    print(f"{time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
