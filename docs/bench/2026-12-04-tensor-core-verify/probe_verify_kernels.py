"""Where the row-invariant verify's time goes, and whether a tensor-core GEMV would make it cheap (a probe: it
prints numbers and writes JSON lines; nothing here is used by the engine).

The lean step's GEMVs (models/fused.py) accumulate w * x elementwise in float32 on the CUDA cores, each row of a
verify with its own accumulators and its own normalised input chunk. On the H200 at the 8B shape a verify of R rows
costs about 1.5 ms more per row over the T = 1 step's 4.0 ms (docs/bench/2026-12-04-row-invariant-verify): compute
that grows with the rows while the weight reads do not.

This probe times, per 8B projection shape (qkv, o, gate_up, down, lm_head):
* `fused`: the lean step's kernels at R = 1..5 rows (block shapes picked for a step of at most 5 rows, as a
  speculating engine picks them) and at R = 1 with the one-row pick (a plain engine's);
* `dot`: one GEMV written on tl.dot (tensor cores), "swap AB": acc[BLOCK_N, 16] += W[BLOCK_N, BLOCK_K] @ X^T
  [BLOCK_K, 16], the R <= 16 input rows padded to 16 and the row count a runtime argument, so a T = 1 launch and a
  verify's launch are the same binary and a row's sums cannot depend on the others (checked here with torch.equal:
  row r of an R = 5 launch against an R = 1 launch over that row alone). With the RMSNorm folded in (norm=1: the
  statistic of every row first, then each K tile normalised as the lean step normalises it) or over an input
  normalised beforehand (norm=0).

    python3 docs/bench/2026-12-04-tensor-core-verify/probe_verify_kernels.py --json OUT.jsonl          # on a CUDA machine
    TRITON_INTERPRET=1 python3 docs/bench/2026-12-04-tensor-core-verify/probe_verify_kernels.py --tiny  # anywhere: the kernels' results only
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
import triton.language as tl
import triton.testing

RP = 16  # rows a dot launch computes (tl.dot's smallest N); the first R of them are real


@triton.jit
def _dot_gemv_kernel(x_ptr, nw_ptr, w_ptr, out_ptr, R, N, K, eps, sx, so, HAS_NORM: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RP: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = tl.arange(0, RP)
    mmask = m < R
    dt = w_ptr.dtype.element_ty
    rstd = tl.zeros([RP], tl.float32)
    if HAS_NORM:
        ss = tl.zeros([RP, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + m[:, None] * sx + kk[None, :], mask=mmask[:, None] & (kk[None, :] < K),
                         other=0.0).to(tl.float32)
            ss += xv * xv
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + eps)
    acc = tl.zeros([BLOCK_N, RP], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        w = tl.load(w_ptr + n[:, None] * K + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        xv = tl.load(x_ptr + m[:, None] * sx + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        if HAS_NORM:
            xn = (xv.to(tl.float32) * rstd[:, None]).to(dt)
            nw = tl.load(nw_ptr + kk, mask=kmask, other=0.0)
            xv = (xn.to(tl.float32) * nw.to(tl.float32)[None, :]).to(dt)
        acc = tl.dot(w, tl.trans(xv), acc)
    tl.store(out_ptr + m[None, :] * so + n[:, None], acc.to(dt), mask=nmask[:, None] & mmask[None, :])


def dot_gemv(x, nw, w, out, rows, cfg, eps=1e-5):
    """out[:rows] = (RMSNorm(x[:rows]) if nw is not None else x[:rows]) @ w.T; cfg (BLOCK_N, BLOCK_K, STAGES,
    warps)."""
    n, k = w.shape
    bn, bk, stages, warps = cfg
    _dot_gemv_kernel[(triton.cdiv(n, bn),)](x, nw if nw is not None else x, w, out, rows, n, k, eps, x.stride(0),
                                            out.stride(0), HAS_NORM=nw is not None, BLOCK_N=bn, BLOCK_K=bk, RP=RP,
                                            STAGES=stages, num_warps=warps)


DOT_CONFIGS = [c for c in itertools.product((16, 32, 64), (128, 256), (3, 5), (4, 8))
               if not (c[0] == 16 and c[3] == 8)]

# The 8B's projections: (name, N, K, the lean step's kernel, whether its input is normalised in the kernel)
SHAPES_8B = [("qkv", 6144, 4096, "norm_qkv_rope", True), ("o", 4096, 4096, "gemv_residual", False),
             ("gate_up", 28672, 4096, "norm_gate_up_silu", True), ("down", 4096, 14336, "gemv_residual", False),
             ("lm_head", 128256, 4096, "norm_gemv", True)]
SHAPES_1B = [("qkv", 3072, 2048, "norm_qkv_rope", True), ("o", 2048, 2048, "gemv_residual", False),
             ("gate_up", 16384, 2048, "norm_gate_up_silu", True), ("down", 2048, 8192, "gemv_residual", False),
             ("lm_head", 128256, 2048, "norm_gemv", True)]
SHAPES_TINY = [("qkv", 96, 64, "norm_qkv_rope", True), ("o", 64, 64, "gemv_residual", False),
               ("gate_up", 256, 64, "norm_gate_up_silu", True), ("down", 64, 128, "gemv_residual", False),
               ("lm_head", 200, 64, "norm_gemv", True)]


def bench(fn) -> float:
    """Median microseconds of fn, from a CUDA graph of it (launch overhead out, as in the lean step's graph)."""
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def fused_timings(name, n, k, kernel, dtype, device, max_rows):
    """The lean step's kernel for this projection at R = 1..max_rows rows, block shapes picked for max_rows."""
    from expresslane.engine.models import fused

    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(dtype).to(device)  # noqa: E731
    w = rnd(n, k)
    nw = (1 + rnd(k)).contiguous()
    times = {}
    for r in range(1, max_rows + 1):
        x = rnd(r, k)
        if kernel == "gemv_residual":
            res = rnd(r, n)
            fn = lambda: fused.gemv_residual(x, w, None, res, max_rows=max_rows)  # noqa: E731
        elif kernel == "norm_gemv":
            out = torch.empty(r, n, dtype=torch.float32, device=device)
            fn = lambda: fused.norm_gemv(x, nw, 1e-5, w, out, max_rows=max_rows)  # noqa: E731
        elif kernel == "norm_gate_up_silu":
            out = torch.empty(r, n // 2, dtype=dtype, device=device)
            fn = lambda: fused.norm_gate_up_silu(x, nw, 1e-5, w, None, out, max_rows=max_rows)  # noqa: E731
        else:  # qkv: 32 q heads, 8 kv heads of 128 (n = 6144) or the tiny 4 + 1 + 1 of 16
            d, nh, nkv = {6144: (128, 32, 8), 3072: (64, 32, 8)}.get(n, (16, 4, 1))
            from expresslane.engine.models.config import RopeConfig
            from expresslane.engine.models.rope import rope_tables
            cos, sin = rope_tables(RopeConfig(), d, 64, dtype, device)
            q = torch.empty(r, nh * d, dtype=dtype, device=device)
            kc = torch.zeros(64, nkv, d, dtype=dtype, device=device)
            vc = torch.zeros_like(kc)
            start = torch.tensor([3], device=device)
            fn = lambda: fused.norm_qkv_rope(x, nw, 1e-5, w, None, cos, sin, start, q, kc, vc, nh, nkv, d,  # noqa: E731
                                             max_rows=max_rows)
        fn()
        times[r] = bench(fn) if device.type == "cuda" else 0.0
    return times


def dot_sweep(name, n, k, has_norm, dtype, device, configs, max_rows=5):
    """Each dot config's microseconds at R = 1..max_rows, and whether every row of the R-row launch equals the
    one-row launch over that row (torch.equal)."""
    g = torch.Generator(device="cpu").manual_seed(1)
    w = (torch.randn(n, k, generator=g) * 0.02).to(dtype).to(device)
    nw = (1 + torch.randn(k, generator=g) * 0.02).to(dtype).to(device) if has_norm else None
    xs = (torch.randn(max_rows, k, generator=g)).to(dtype).to(device)
    results = []
    for cfg in configs:
        out = torch.zeros(RP, n, dtype=dtype, device=device)
        try:
            dot_gemv(xs, nw, w, out, max_rows, cfg)
        except Exception as e:  # a shape this device cannot run (shared memory): skipped, said so
            results.append({"cfg": list(cfg), "error": type(e).__name__ + ": " + str(e)[:120]})
            continue
        full = out[:max_rows].clone()
        invariant = True
        for r in range(max_rows):
            one_x = torch.zeros_like(xs)
            one_x[0] = xs[r]
            one = torch.zeros(RP, n, dtype=dtype, device=device)
            dot_gemv(one_x, nw, w, one, 1, cfg)
            invariant &= bool(torch.equal(one[0], full[r]))
        ref = xs.float()
        if has_norm:
            ref = (ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).float() * nw.float()
        err = (full.float() - ref.to(dtype).float() @ w.float().T).abs().max().item()
        times = {}
        if device.type == "cuda":
            for r in range(1, max_rows + 1):
                times[r] = bench(lambda: dot_gemv(xs, nw, w, out, r, cfg))
        results.append({"cfg": list(cfg), "us": times, "row_invariant": invariant, "max_abs_err": err})
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, float32 (the interpreter)")
    ap.add_argument("--json", help="append one JSON line per shape here")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head")
    ap.add_argument("--model", choices=("8b", "1b"), default="8b")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shapes = [s for s in (SHAPES_TINY if args.tiny else SHAPES_1B if args.model == "1b" else SHAPES_8B) if s[0] in args.shapes.split(",")]
    configs = DOT_CONFIGS[:2] if args.tiny else DOT_CONFIGS
    ok = True
    print(f"{'shape':8} {'N':>6} {'K':>6}  {'fused T1(pick1)':>15} {'fused T1':>9} {'fused T5':>9} {'T5/T1':>6}"
          f"  {'dot best T1':>11} {'its T5':>8} {'T5/T1':>6} {'dot cfg':>16} {'dot T1/fused T1':>15} invariant")
    for name, n, k, kernel, has_norm in shapes:
        f1 = fused_timings(name, n, k, kernel, dtype, device, 1)
        f5 = fused_timings(name, n, k, kernel, dtype, device, 5)
        sweep = dot_sweep(name, n, k, has_norm, dtype, device, configs)
        runs = [s for s in sweep if "us" in s]
        inv = all(s["row_invariant"] for s in runs)
        ok &= inv
        rec = {"model": "tiny" if args.tiny else args.model, "shape": name, "n": n, "k": k, "kernel": kernel, "norm_in_kernel": has_norm,
               "fused_t1_pick1_us": f1[1], "fused_us_by_rows": f5, "dot": sweep,
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "triton": triton.__version__, "torch": torch.__version__}
        if device.type == "cuda" and runs:
            best = min(runs, key=lambda s: s["us"][1])
            print(f"{name:8} {n:6} {k:6}  {f1[1]:15.1f} {f5[1]:9.1f} {f5[5]:9.1f} {f5[5] / f5[1]:6.2f}"
                  f"  {best['us'][1]:11.1f} {best['us'][5]:8.1f} {best['us'][5] / best['us'][1]:6.2f}"
                  f" {str(best['cfg']):>16} {best['us'][1] / f1[1]:15.2f} {inv}")
            rec["dot_best_t1"] = best
        else:
            print(f"{name:8} {n:6} {k:6}  (no timing off a GPU) dot configs run: {len(runs)} invariant: {inv} "
                  f"max err {max((s['max_abs_err'] for s in runs), default=float('nan')):.2e}")
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
