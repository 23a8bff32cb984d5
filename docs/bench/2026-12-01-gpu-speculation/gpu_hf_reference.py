"""transformers' own fastest batch-1 decode on the same checkpoint, as the reference row of
docs/bench/2026-12-01-gpu-speculation/gpu_speed.sh: generate() with a static cache and the forward torch.compile'd (transformers' documented
recipe: cache_implementation="static", which makes generate() compile the decode forward with mode
"reduce-overhead" = CUDA graphs).

    python docs/bench/2026-12-01-gpu-speculation/gpu_hf_reference.py MODEL_DIR [--contexts 1024] [--tokens 256]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--contexts", default="1024")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map="cuda").eval()
    # With a static cache, generate() compiles the decoding forward itself (generation_config.compile_config,
    # mode "reduce-overhead": CUDA graphs); wrapping model.forward by hand breaks its cache updates.
    model.generation_config.cache_implementation = "static"
    g = torch.Generator().manual_seed(0)
    for ctx in (int(c) for c in args.contexts.split(",")):
        ids = torch.randint(0, model.config.vocab_size, (1, ctx), generator=g).cuda()
        kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=0)
        t0 = time.perf_counter()
        for n in (args.tokens, args.tokens):  # compile + capture, then a warm run
            model.generate(ids, max_new_tokens=n, **kw)
        warm_s = time.perf_counter() - t0
        best = 0.0
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, **kw)  # the prefill alone, to subtract it
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=args.tokens + 1, **kw)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            best = max(best, args.tokens / ((t2 - t1) - (t1 - t0)))
        print(f"transformers static-cache+compile model={args.model} context={ctx} tok/s={best:.1f} "
              f"(compile+warm {warm_s:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
