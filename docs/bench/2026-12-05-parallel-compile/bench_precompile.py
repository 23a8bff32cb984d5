"""How long the lean step's block-shape candidates take to compile for an H100 / H200 (sm_90), one after another
and on a thread pool (models/precompile.py compiles a pick's candidates so). No GPU is needed: Triton builds the
cubins with its own ptxas.

    python docs/bench/2026-12-05-parallel-compile/bench_precompile.py                 # the CUDA-core family's four kernels, 1 and 5 rows
    python docs/bench/2026-12-05-parallel-compile/bench_precompile.py --threads 16 --kernels gemv_residual

Each mode compiles into a cache directory of its own (every kernel is really compiled); the binaries of the two
modes are compared. Prints one line per kernel and row count, then the totals.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]  # this lab note's folder is docs/bench/<date>-<topic>/
sys.path.insert(0, str(REPO / "engine" / "src"))
sys.path.insert(0, str(REPO / "scripts"))  # bench_lib
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench_lib.hopper import HOPPER, signature  # noqa: E402
from expresslane.engine.models import fused  # noqa: E402

HIDDEN = 4096  # the 8B shape's K (K_POW2 of the norm kernels)
# kernel name -> (kernel, candidates, constexprs of a candidate)
KERNELS = {
    "norm_qkv_rope": (fused._norm_qkv_rope_kernel, [c for c in fused.PAIR_CONFIGS if 64 % c[0] == 0],
                      lambda c: dict(NH=32, NKV=8, D=128, HAS_BIAS=False, BJ=c[0], BLOCK_K=c[1], PREFETCH=c[2],
                                     K_POW2=HIDDEN, PACK=fused._pack(c))),
    "gemv_residual": (fused._gemv_residual_kernel, list(fused.GEMV_CONFIGS),
                      lambda c: dict(HAS_BIAS=False, BLOCK_N=c[0], BLOCK_K=c[1], PREFETCH=c[2], PACK=fused._pack(c))),
    "norm_gate_up_silu": (fused._norm_gate_up_silu_kernel, list(fused.PAIR_CONFIGS),
                          lambda c: dict(HAS_BIAS=False, BJ=c[0], BLOCK_K=c[1], PREFETCH=c[2], K_POW2=HIDDEN, PACK=fused._pack(c))),
    "norm_gemv": (fused._norm_gemv_kernel, list(fused.GEMV_CONFIGS),
                  lambda c: dict(BLOCK_N=c[0], BLOCK_K=c[1], PREFETCH=c[2], K_POW2=HIDDEN, ARGMAX=False, PACK=fused._pack(c))),
}


def compile_one(kernel, constexprs: dict, warps: int, rows: int):
    cx = dict(constexprs, PDL=True, ROWS=rows)
    sig = signature(kernel, float32_out=kernel is fused._norm_gemv_kernel)  # the logits GEMV writes float32
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=cx), target=HOPPER,
                          options={"num_warps": warps})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--rows", default="1,5")
    args = ap.parse_args()
    jobs = []
    for name in args.kernels.split(","):
        kernel, cands, cx = KERNELS[name]
        for rows in (int(r) for r in args.rows.split(",")):
            jobs += [(name, rows, c, (kernel, cx(c), fused._warps(c), rows)) for c in cands]
    total = {}
    binaries = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("one after another", f"{args.threads} threads"):
            os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, mode.replace(" ", "-"))
            t0 = time.perf_counter()
            if mode == "one after another":
                built = [compile_one(*job[3]) for job in jobs]
            else:
                with ThreadPoolExecutor(args.threads) as pool:
                    built = list(pool.map(lambda job: compile_one(*job[3]), jobs))
            total[mode] = time.perf_counter() - t0
            binaries[mode] = [b.asm["cubin"] for b in built]
    same = binaries["one after another"] == binaries[f"{args.threads} threads"]
    print(f"host CPUs {len(os.sched_getaffinity(0))}, triton {triton.__version__}, {len(jobs)} kernels "
          f"({args.kernels}; rows {args.rows}), sm_90")
    for mode, s in total.items():
        print(f"  {mode:>18}: {s:7.2f} s  ({1e3 * s / len(jobs):.0f} ms a kernel)")
    print(f"  speedup {total['one after another'] / total[f'{args.threads} threads']:.2f}x, "
          f"same binaries: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
