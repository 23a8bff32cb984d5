"""Batch-1 GEMV block shapes on the GPU (docs/bench/2026-12-01-gpu-lean-step/run3-gemv-sweep.jsonl): the fused
kernels' GEMV loops (models/fused.py) over (rows, K-block, warps, stages), and cuBLAS (F.linear) on the same
weights, Llama-1B / 8B shapes, bf16, triton.testing.do_bench medians (L2 flushed each call, launch included).

    PYTHONPATH=engine/src python3 docs/bench/2026-12-01-gpu-lean-step/gpu_gemv_sweep.py OUTDIR     # writes OUTDIR/sweep.jsonl
(The "TB/s" it prints is off by 1e3 in its units; the jsonl's times are right.)
"""
import json, os, sys, torch, triton, triton.testing
from expresslane.engine.models import fused as F
out = open(os.path.join(sys.argv[1], "sweep.jsonl"), "a")
dev = "cuda"
def bench(fn):
    return 1e3 * triton.testing.do_bench(fn, warmup=3, rep=15, return_mode="median")
shapes = {"1b": (2048, 8192, 3072), "8b": (4096, 14336, 6144)}
cfgs = [(bn, bk, w, s) for (bn, bk) in [(2, 4096), (4, 2048), (8, 1024), (16, 512), (4, 4096), (8, 2048), (16, 1024), (32, 512)] for w in (4, 8) for s in (1, 3)]
for name, (h, inter, nqkv) in shapes.items():
    for (n, k, what) in [(h, h, "o"), (h, inter, "down")]:
        w_ = torch.randn(n, k, device=dev, dtype=torch.bfloat16); a = torch.randn(k, device=dev, dtype=torch.bfloat16); r = torch.randn(n, device=dev, dtype=torch.bfloat16)
        res = {}
        for bn, bk, nw, ns in cfgs:
            if bk > k: continue
            try:
                res[f"{bn}x{bk}w{nw}s{ns}"] = round(bench(lambda: F._gemv_residual_kernel[(triton.cdiv(n, bn),)](a, w_, w_, r, n, k, HAS_BIAS=False, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)), 2)
            except Exception as e:
                res[f"{bn}x{bk}w{nw}s{ns}"] = repr(e)[:80]
        mb = n * k * 2 / 1e6
        best = min((v, c) for c, v in res.items() if isinstance(v, float))
        out.write(json.dumps({"shape": name, "gemv": what, "mb": mb, "best": best, "best_tb_s": mb / best[0] / 1e6 * 1e3, "all": res}) + "\n"); out.flush()
        print(name, what, mb, best, round(mb / best[0] / 1e3, 2), "TB/s", flush=True)
    n, k = 2 * inter, h
    w_ = torch.randn(n, k, device=dev, dtype=torch.bfloat16); x = torch.randn(k, device=dev, dtype=torch.bfloat16); nw_ = torch.ones(k, device=dev, dtype=torch.bfloat16); o = torch.empty(inter, device=dev, dtype=torch.bfloat16)
    res = {}
    for bj, bk, nw, ns in cfgs:
        if bk > k: continue
        res[f"{bj}x{bk}w{nw}s{ns}"] = round(bench(lambda: F._norm_gate_up_silu_kernel[(triton.cdiv(inter, bj),)](x, nw_, w_, w_, o, inter, k, 1e-5, HAS_BIAS=False, BJ=bj, BLOCK_K=bk, num_warps=nw, num_stages=ns)), 2)
    mb = n * k * 2 / 1e6
    best = min((v, c) for c, v in res.items())
    out.write(json.dumps({"shape": name, "gemv": "gate_up", "mb": mb, "best": best, "all": res}) + "\n"); out.flush()
    print(name, "gate_up", mb, best, round(mb / best[0] / 1e3, 2), "TB/s", flush=True)
    # plain cuBLAS for the same three
    for (n, k, what) in [(h, h, "o"), (h, inter, "down"), (2 * inter, h, "gate_up"), (nqkv, h, "qkv")]:
        w_ = torch.randn(n, k, device=dev, dtype=torch.bfloat16); a = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        t = bench(lambda: torch.nn.functional.linear(a, w_))
        print(name, what, "cublas", round(t, 2), "us", round(n * k * 2 / t / 1e6, 2), "TB/s", flush=True)
        out.write(json.dumps({"shape": name, "gemv": what, "cublas_us": t}) + "\n"); out.flush()
