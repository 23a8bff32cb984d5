"""The chat request's speed with speculation on against off, in interleaved pairs (CPU, compiled, 2 threads).

    python docs/bench/2026-12-07-real-model-speculation/chat_pairs.py var/models/smollm2-135m-instruct --pairs 8

record_real_text.py gives best-of-N per engine; on a shared 2-CPU host a 3 s request moves by a few per cent from
one run to the next, which is the size of the effect in question (0.93-0.96x there). Here one engine (the node's:
adaptive prompt lookup) decodes the recorded chat request (texts.json) plain, then with speculation, N times in
turn; each pair's ratio (plain time / speculative time) and their median are printed, and every output is checked
against the plain one.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from expresslane.engine.decode.engine import DecodeEngine
from expresslane.engine.decode.sampling import SamplingParams

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("model_dir")
ap.add_argument("--request", default="chat")
ap.add_argument("--pairs", type=int, default=8)
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()
torch.set_num_threads(args.threads)
t = json.loads((Path(__file__).parent / "texts.json").read_text())["texts"][args.request]
prompt, out = t["prompt"], t["output"]
engine = DecodeEngine.from_pretrained(args.model_dir, compile=True, max_seq_len=1024)
engine.warmup()


def run(speculative: bool) -> tuple[float, list[int], float]:
    first = int(engine.prefill(prompt).argmax())
    gen = engine.generate(first, len(prompt), SamplingParams(max_tokens=len(out), ignore_eos=True,
                                                             speculative=speculative, prompt_token_ids=prompt))
    next(gen)
    t0 = time.perf_counter()
    toks = list(gen)
    return time.perf_counter() - t0, toks, gen.spec.as_dict()["tokens_per_forward"]


ratios = []
for i in range(args.pairs):
    plain_s, plain_toks, _ = run(False)
    spec_s, spec_toks, tpf = run(True)
    ratios.append(plain_s / spec_s)
    print(f"pair {i}: plain {plain_s:.3f} s, speculative {spec_s:.3f} s ({tpf:.2f} tokens per forward): "
          f"{plain_s / spec_s:.3f}x, identical={spec_toks == plain_toks}", flush=True)
print(f"{args.request}: {len(out)} tokens, speculative vs plain median {statistics.median(ratios):.3f}x "
      f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {args.pairs} pairs)")
