"""Batch-1 decode micro benchmark: tokens/s and achieved weight bandwidth.

    python -m expresslane.engine.decode.bench --model DIR [--dtype float32] [--device cpu] [--prompt-len 128]
        [--tokens 256] [--attention sliced|masked] [--compile] [--cuda-graph auto|on|off] [--threads N]

GB/s = weight bytes (read once per token) / step time; "bound" is a device copy's bytes/s (read + write)
over the weight bytes, the same calibration FACTS.md uses.
"""

from __future__ import annotations

import argparse
import time

import torch

from .engine import CUDA_GRAPH_CHOICES, DecodeEngine
from .sampling import SamplingParams


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read + written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync()
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def run(engine: DecodeEngine, prompt_len: int, tokens: int, repeats: int = 3, warmup: int = 32) -> dict:
    """Best and median of `repeats` timed decodes of `tokens` tokens after a `prompt_len` prefill (best-of
    because shared CI cores are noisy)."""
    gen_ = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engine.vocab_size, (prompt_len,), generator=gen_).tolist()
    first = int(engine.prefill(prompt).argmax())
    list(engine.generate(first, prompt_len, SamplingParams(max_tokens=warmup, ignore_eos=True)))
    times = []
    for _ in range(repeats):
        engine.prefill(prompt)
        gen = engine.generate(first, prompt_len, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
        next(gen)  # the first token is the prefill's; time the decode steps only
        t0 = time.perf_counter()
        n = sum(1 for _ in gen)
        times.append((time.perf_counter() - t0) / n)
    times.sort()
    step_s, median_s = times[0], times[len(times) // 2]
    wbytes = engine.weight_bytes()
    return {"tokens": n, "tok_per_s": 1 / step_s, "median_tok_per_s": 1 / median_s, "ms_per_token": 1e3 * step_s,
            "weight_gb": wbytes / 1e9, "achieved_gb_per_s": wbytes / step_s / 1e9}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--attention", choices=["sliced", "masked"], default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--cuda-graph", choices=["auto", "on", "off"], default="auto",
                    help="replay each decode step as one CUDA graph (auto: on for cuda with masked attention)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-bound", action="store_true", help="skip the copy-bandwidth calibration")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    try:
        engine = DecodeEngine.from_pretrained(args.model, dtype=args.dtype, device=args.device,
                                              max_seq_len=args.max_seq_len, attention=args.attention,
                                              compile=args.compile,
                                              cuda_graph=CUDA_GRAPH_CHOICES[args.cuda_graph])
    except (OSError, ValueError) as e:  # missing checkpoint, unsupported model, bad option combination
        ap.error(str(e))
    load_s = time.perf_counter() - t0
    r = run(engine, args.prompt_len, args.tokens, args.repeats)
    print(f"model={args.model} type={engine.config.model_type} dtype={args.dtype} device={args.device} "
          f"attention={engine.attention} compile={args.compile} cuda_graph={engine.cuda_graph} threads={torch.get_num_threads()} "
          f"load_s={load_s:.2f}")
    print(f"batch=1 prompt={args.prompt_len} decoded={r['tokens']} tok/s={r['tok_per_s']:.1f} (median {r['median_tok_per_s']:.1f}) "
          f"ms/token={r['ms_per_token']:.3f} weights={r['weight_gb']:.4f}GB achieved={r['achieved_gb_per_s']:.2f}GB/s")
    if not args.no_bound:
        bw = copy_bandwidth(engine.device)
        bound = bw / (r["weight_gb"] * 1e9)
        print(f"copy_bandwidth={bw / 1e9:.1f}GB/s bound_tok/s={bound:.0f} of_bound={100 * r['tok_per_s'] / bound:.1f}%")


if __name__ == "__main__":
    main()
