"""The verify's attention, per row or shared: time and bits (a probe: it prints numbers and writes JSON lines).

A verify of R rows runs each row's attention as a one-row step at its own position, with that step's splits
(models/triton_decode.py), which is what keeps each row's bits. Two kernels do that:

* `per-row` (the lean step's): R programs per (KV head, split), side by side in the grid, so R - 1 of them
  find the cache tiles in L2;
* `shared` (`split_kv_attention_rows(..., shared=True)`): one program per (KV head, split) reads each tile once
  and runs every row's online softmax over it, each row on exactly its own program's operands.

For the 8B and 1B attention shapes (8 KV heads, 4 query heads each, head dim 128 / 64) at contexts 1k / 8k /
32k, and R = 1 .. 5 rows, it prints the time of one launch (CUDA graph replays of 50 launches) of each, R = 1
being the one-row step, and checks with torch.equal that every row of each kernel is its own one-row launch's
output. On the H200, T5 / T1 of the whole 8B tensor-core step at 32k was 1.41 with `per-row`
(docs/bench/2026-12-04-gpu-check/); the attention is what grows there.

    python3 docs/bench/2026-12-05-gpu-check/probe_verify_attention.py --json OUT.jsonl
        # on a CUDA machine, from the repository root (the GPU check's bench ran it until 2026-12-07)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "engine" / "src"))  # from docs/bench/<note>/

from expresslane.engine.models.triton_decode import split_kv_attention, split_kv_attention_rows  # noqa: E402

SHAPES = {"llama-8b": (8, 4, 128), "llama-1b": (8, 4, 64)}


def graph_ms(fn, launches: int = 50) -> float:
    """ms per call of fn, from CUDA graph replays of `launches` calls (no launch overhead in the figure)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / launches)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-8b,llama-1b")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--max-rows", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (the interpreter's timings mean nothing; the unit tests check its bits)")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"{'shape':9} {'ctx':>6} {'R':>2} {'per-row ms':>10} {'shared ms':>9} {'per-row/T1':>10} {'shared/T1':>9} "
          f"{'exact':>5}", flush=True)
    for shape in args.shapes.split(","):
        hkv, g, d = SHAPES[shape]
        for ctx in (int(c) for c in args.contexts.split(",")):
            size = ctx + args.max_rows + 1
            k = torch.randn(size, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
            v = torch.randn(size, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
            pos = torch.tensor([ctx], device=dev)
            t1 = None
            for r in range(1, args.max_rows + 1):
                q = torch.randn(r, hkv * g, d, device=dev, dtype=torch.bfloat16, generator=gen)
                scale = d ** -0.5
                if r == 1:
                    per_row = shared = graph_ms(lambda: split_kv_attention(q, k, v, pos, scale))
                    t1 = per_row
                    exact = True
                else:
                    per_row = graph_ms(lambda: split_kv_attention_rows(q, k, v, pos, scale))
                    shared = graph_ms(lambda: split_kv_attention_rows(q, k, v, pos, scale, shared=True))
                    a = split_kv_attention_rows(q, k, v, pos, scale)
                    b = split_kv_attention_rows(q, k, v, pos, scale, shared=True)
                    ones = [split_kv_attention(q[i:i + 1], k, v, torch.tensor([ctx + i], device=dev), scale)[0]
                            for i in range(r)]
                    exact = all(torch.equal(a[i], ones[i]) and torch.equal(b[i], ones[i]) for i in range(r))
                row = dict(shape=shape, context=ctx, rows=r, per_row_ms=per_row, shared_ms=shared,
                           per_row_x_t1=per_row / t1, shared_x_t1=shared / t1, exact=exact)
                print(f"{shape:9} {ctx:>6} {r:>2} {per_row:>10.4f} {shared:>9.4f} {per_row / t1:>10.2f} "
                      f"{shared / t1:>9.2f} {str(exact):>5}", flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
