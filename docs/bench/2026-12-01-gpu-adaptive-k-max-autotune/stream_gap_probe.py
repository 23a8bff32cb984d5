#!/usr/bin/env python3
"""Stream a long greedy generation through DecodeEngine and print the largest gaps between tokens, and how
many torch.compile frames were compiled after warmup (must be 0: a mid-stream compile is a multi-second gap).

    python docs/bench/2026-12-01-gpu-adaptive-k-max-autotune/stream_gap_probe.py MODEL_DIR [--tokens 1500] [--compile]
        [--spec-k 4] [--fixed-k] [--prompt-len 200] [--threads 1]

The prompt repeats a short pattern, so prompt lookup drafts (and verify steps of several row counts run).
Seen 2026-12-01 before the StepRunner fix (tiny model, compiled step, 2 shared CPUs): a 17 s gap at token 151.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "engine" / "src"))  # from docs/bench/<note>/

from expresslane.engine.decode import DecodeEngine, SamplingParams, SpeculationConfig  # noqa: E402


def frames() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--spec-k", type=int, default=4, help="0: speculation off")
    ap.add_argument("--fixed-k", action="store_true", help="no adaptive k")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = SpeculationConfig(k=args.spec_k, adaptive=not args.fixed_k) if args.spec_k else None
    e = DecodeEngine.from_pretrained(args.model, max_seq_len=args.prompt_len + args.tokens + 8,
                                     compile=args.compile, speculation=spec)
    t0 = time.perf_counter()
    e.warmup()
    warm_s, warm_frames = time.perf_counter() - t0, frames()
    prompt = [(i * 7) % 500 for i in range(args.prompt_len)]
    first = int(e.prefill(prompt).argmax())
    gen = e.generate(first, len(prompt), SamplingParams(max_tokens=args.tokens, ignore_eos=True,
                                                        prompt_token_ids=prompt))
    gaps = []
    t_start = last = time.perf_counter()
    for i, _ in enumerate(gen):
        now = time.perf_counter()
        gaps.append((now - last, i))
        last = now
    total = last - t_start
    gaps.sort(reverse=True)
    print(f"model={args.model} compile={args.compile} spec={spec} threads={args.threads} warmup_s={warm_s:.1f} "
          f"compiled_frames_at_warmup={warm_frames} compiled_frames_after_warmup={frames() - warm_frames}")
    print(f"{len(gaps)} tokens in {total:.2f}s ({len(gaps) / total:.1f} tok/s); largest gaps: "
          + ", ".join(f"{g * 1e3:.0f} ms at token {i}" for g, i in gaps[:5]))
    print(f"speculation: {gen.spec.as_dict()}")


if __name__ == "__main__":
    main()
