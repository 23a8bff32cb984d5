#!/usr/bin/env python3
"""Where a (k+1)-row verify forward and the 1-row step disagree on the greedy token, is it a near-tie?

    python docs/bench/2026-12-01-gpu-adaptive-k-max-autotune/gpu_verify_ties.py MODEL_DIR [--context 1024] [--tokens 256] [--rows 4] [--max-seq-len N]

Decodes `tokens` greedy tokens with the plain (T = 1) step, then re-runs each position as row 0 of a T-row
forward (the verify step's shape) with the known continuation as the other rows, and prints every position
where the argmax differs, with the top-2 logits of both forwards: a near-tie (a gap of a few bf16 ulps) is
rounding; a large gap is a bug. Same engine options as the decode bench's default CUDA step.
"""

from __future__ import annotations

import argparse

import torch

from expresslane.engine.decode import DecodeEngine, SamplingParams, SpeculationConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    msl = args.max_seq_len or args.context + args.tokens + 64
    e = DecodeEngine.from_pretrained(args.model, dtype=args.dtype, device=args.device, max_seq_len=msl,
                                     compile=True, speculation=SpeculationConfig(k=args.rows - 1))
    e.warmup()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, e.vocab_size, (args.context,), generator=g).tolist()
    first = int(e.prefill(prompt).argmax())
    plain = list(e.generate(first, len(prompt), SamplingParams(max_tokens=args.tokens, ignore_eos=True,
                                                               speculative=False)))
    # plain[i] sits at position context + i; the step at that position predicts plain[i + 1].
    e.prefill(prompt)
    bad = 0
    with torch.inference_mode():
        for i in range(len(plain) - args.rows):
            pos = args.context + i
            one = e.runner.forward(torch.tensor([plain[i]], device=e.device), pos)[-1].clone()
            rows = torch.tensor(plain[i:i + args.rows], device=e.device)
            many = e.runner.forward(rows, pos)[0].clone()
            if int(one.argmax()) != plain[i + 1]:
                print(f"pos {pos}: the replayed 1-row step disagrees with the decode itself (state bug?)")
            if int(many.argmax()) != int(one.argmax()):
                bad += 1
                t1, t2 = one.topk(2), many.topk(2)
                print(f"pos {pos} (token {i + 1}): 1-row top2 {t1.indices.tolist()} {t1.values.tolist()} "
                      f"gap {float(t1.values[0] - t1.values[1]):.4g}; {args.rows}-row top2 "
                      f"{t2.indices.tolist()} {t2.values.tolist()}; max |logit diff| "
                      f"{float((one - many).abs().max()):.4g}", flush=True)
            # keep the cache as the plain decode had it (the T-row forward wrote rows past pos too)
            e.runner.forward(torch.tensor([plain[i]], device=e.device), pos)
    print(f"{bad} of {len(plain) - args.rows} positions: the {args.rows}-row forward's argmax differs from the "
          f"1-row step's")


if __name__ == "__main__":
    main()
