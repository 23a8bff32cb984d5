"""The tensor-core step's norms as kernels of their own or as the residual kernels' tail, with and without its
weights' L2 prefetch: time and tokens (a probe: it prints numbers and writes JSON lines; docs/performance.md
says why it exists).

The tensor-core family (models/fused_dot.py) runs each RMSNorm as a kernel of its own (`rms_rows`, two a layer),
and its one-row step at the 8B shape costs 4 % more than the CUDA-core family's (4.22 vs 4.04 ms on the H200,
docs/bench/2026-12-04-tensor-core-verify/), which keeps it off by default: a speculating node on text that never
repeats would run at 0.95-0.96x of a node without speculation. Hypothesis: the norm kernels are most of that
gap. Each is one more kernel on the step's critical path (65 at 8B) whose one program reads the residual,
reduces it and writes the normalised row while every multiprocessor else waits, and the projection after it
only then starts its first weight load. The `tail` placement (models/lean.py LEAN_NORMS) moves the norm into
the last program of the o_proj / down_proj kernel that wrote the residual. A second candidate for the rest of it:
that family's projections load no weight before their PDL wait (models/pdl.py), so each starts from HBM latency
once the kernel before it ends; `l2` has them prefetch their first tiles into the L2 before the wait.

For each shape it builds a speculating engine (k = 4, the warm-up's picks and graphs) of each GEMV family, and
times a forward of 1 .. 5 rows (CUDA graph replays, `bench.step_times`) at each context: the CUDA-core family
(the reference, `auto`), and the tensor-core family in three variants, kernel / tail / tail + l2, run twice in
turn (drift shows as a difference between the two runs of one variant). It also decodes 64 greedy tokens with
each variant and says whether they are the kernel placement's tokens (the
norms' sums may be added in another order in a program of other warps: a difference is a rounding, not an
error; within one placement a verify row is the one-row step's bits, which the GPU tests check).

Then, on the CUDA-core engine, what a host sync costs (docs/bench/2026-12-05-sync-penalty-policy/: 100-200 us a
synced forward at 1B in the decode loop): per forward, at the first context, a one-row step queued back to back
(the greedy chain's steady state: each step submitted before the one before it is read), a one-row step
launched after reading the one before it (the chain's start, its submit and its read, as after a verify), graph
replays of 1 and 5 rows with no read, and verifies of 2 and 5 rows as the engine runs them (the rows staged in
pinned memory, the forward with its argmax in the graph, the read: StepRunner.greedy_rows), and a verify of 5
rows by the host path before it (the rows as a device tensor, the start and the rows set by two kernels, the
argmax after the graph, the read). The differences are the host's path.

    python3 docs/bench/2026-12-05-h100-gpu-check/probe_lean_norm.py --json OUT.jsonl
        # on a CUDA machine, from the repository root (the GPU check's bench ran it until 2026-12-07)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "engine" / "src"))  # from docs/bench/<note>/

from expresslane.engine.decode.bench import step_times  # noqa: E402
from expresslane.engine.decode.engine import DecodeEngine  # noqa: E402
from expresslane.engine.decode.sampling import SamplingParams  # noqa: E402
from expresslane.engine.decode.shapes import random_checkpoint  # noqa: E402
from expresslane.engine.decode.speculative import SpeculationConfig  # noqa: E402


def greedy_tokens(engine: DecodeEngine, prompt: list[int], n: int) -> list[int]:
    engine.prefill(prompt)
    gen = engine.generate(prompt[-1], len(prompt), SamplingParams(max_tokens=n, ignore_eos=True, speculative=False))
    return list(gen)


def per_call_us(fn, device: torch.device, reps: int = 200) -> float:
    """Microseconds per call of fn, the best of 3 runs of `reps` calls (the device drained before and after)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / reps)
    return 1e6 * best


def sync_costs(engine: DecodeEngine, pos: int) -> dict[str, float]:
    """us per forward at `pos`: the greedy chain queued and after a read, graph replays, verifies with their read
    (the rows each writes lie past the live length: scratch)."""
    chain, runner = engine._chain, engine.runner
    out = {}

    def queued():  # steady state: the next step submitted before the previous one is read
        chain.result(chain.submit() - 1)

    chain.start(1, pos)
    chain.submit()
    out["plain queued"] = per_call_us(queued, engine.device)
    chain.result(chain.submitted - 1)

    def synced():  # as after a verify: start, submit, read
        chain.start(1, pos)
        chain.result(chain.submit())

    out["plain after a read"] = per_call_us(synced, engine.device)
    for rows in (1, 5):
        toks = torch.arange(rows, device=engine.device)
        out[f"replay {rows} rows, no read"] = per_call_us(lambda: runner.forward(toks, pos), engine.device)
    for rows in (2, 5):
        out[f"verify {rows} rows with its read"] = per_call_us(lambda: engine._greedy_rows(list(range(rows)), pos),
                                                               engine.device)

    def unstaged(rows):  # the host path before StepRunner.greedy_rows: a pageable copy, two kernels, the argmax
        return runner.forward(torch.tensor(rows, device=engine.device), pos).argmax(dim=-1).tolist()

    out["verify 5 rows, unstaged read"] = per_call_us(lambda: unstaged(list(range(5))), engine.device)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-8b,llama-1b")
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--max-seq-len", type=int, default=33100)
    ap.add_argument("--reps", type=int, default=50, help="forwards per timing")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (the interpreter's timings mean nothing; the unit tests check the bits)")
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"{'shape':9} {'gemv':11} {'norm':6} {'l2':5} {'ctx':>6} {'T=1 ms':>7} {'T=5 ms':>7} {'T5/T1':>6} "
          f"{'x cuda-core T=1':>15}", flush=True)
    variants = [("kernel", False), ("tail", False), ("tail", True)] * 2
    for shape in args.shapes.split(","):
        config, tensors = random_checkpoint(shape, "cuda")
        prompt = torch.randint(0, config["vocab_size"], (64,), generator=torch.Generator().manual_seed(0)).tolist()
        reference: dict[int, float] = {}
        tokens_by_norm: dict[str, list[int]] = {}
        for gemv, runs in (("cuda-core", [("kernel", False)]), ("tensor-core", variants)):
            t0 = time.perf_counter()
            # a copy of the dict (the loader empties the one it is given); the tensors are shared
            engine = DecodeEngine.from_checkpoint_tensors(config, dict(tensors), dtype="bfloat16", device="cuda",
                                                          max_seq_len=args.max_seq_len,
                                                          speculation=SpeculationConfig(k=4), lean_gemv=gemv)
            engine.warmup()
            print(f"{shape} {gemv}: built and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
            for i, (norm, l2) in enumerate(runs):
                if gemv == "tensor-core":
                    engine.runner.set_lean_norm(norm)  # the graphs are captured again at the next forward
                    engine.runner.set_lean_l2_prefetch(l2)
                tokens = greedy_tokens(engine, prompt, 64)
                same = tokens == tokens_by_norm.setdefault(f"{norm}{'+l2' if l2 else ''}" if gemv == "tensor-core"
                                                           else gemv, tokens)
                for ctx in contexts:
                    times = step_times(engine, ctx, reps=args.reps)
                    t1, t5 = 1e3 * times[1], 1e3 * times[max(times)]
                    if gemv == "cuda-core":
                        reference[ctx] = t1
                    ref = reference.get(ctx)
                    print(f"{shape:9} {gemv:11} {norm:6} {str(l2):5} {ctx:>6} {t1:>7.3f} {t5:>7.3f} {t5 / t1:>6.2f} "
                          f"{t1 / ref if ref else float('nan'):>15.3f}", flush=True)
                    if args.json:
                        with open(args.json, "a") as f:
                            f.write(json.dumps(dict(
                                shape=shape, gemv=gemv, norm=norm, l2_prefetch=l2, run=i, context=ctx,
                                step_ms_by_rows={t: 1e3 * v for t, v in times.items()},
                                x_cuda_core_t1=t1 / ref if ref else None,
                                tokens_as_first_run=same,
                                tokens_as_kernel_norm=(tokens == tokens_by_norm["kernel"]
                                                       if gemv == "tensor-core" else None))) + "\n")
            if gemv == "cuda-core":
                costs = sync_costs(engine, contexts[0])
                print(f"{shape} {gemv} ctx {contexts[0]}: us a forward: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(dict(shape=shape, gemv=gemv, context=contexts[0], sync_us=costs)) + "\n")
            del engine
            torch.cuda.empty_cache()
        del tensors
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
