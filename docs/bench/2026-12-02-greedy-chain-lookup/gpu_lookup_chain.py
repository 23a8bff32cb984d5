"""The greedy chain under prompt lookup on one CUDA GPU (issue 14): tok/s of speculating greedy requests with
the chain (the default) and without it (the per-token speculating loop), in one run.

    PYTHONPATH=engine/src python3 docs/bench/2026-12-02-greedy-chain-lookup/gpu_lookup_chain.py --out OUTDIR [--shapes llama-1b,llama-8b]
        [--contexts 1024] [--tokens 256] [--repeats 3] [--deadline-s 300] [--pytest] [--smoke-cpu]

Per shape (random bf16 weights with Llama-3.2-1B / Llama-3.1-8B shapes built on the GPU, lm_head x16 as in
scripts/gpu_make_shape_model.py; the cache rows [0, context) hold random K/V, as docs/bench/2026-12-01-gpu-lean-step/gpu_lean.py does) and
context, three lookup contexts for the same request (speculation on: the default adaptive prompt lookup, k=4):
* plain: the lookup sees a random prompt of `context` tokens (random weights rarely repeat it, so the drafter
  rarely drafts: the all-plain case the chain is for);
* repeating: the lookup context holds the answer (the prompt, then the request's own greedy continuation):
  most drafts are kept, few steps are plain;
* mixed: the same with every 8th token of the continuation corrupted;
* no-drafts: a drafter that never drafts (random weights can fall into loops the lookup then matches: this case
  is all-plain whatever they do).
For each: tok/s with the chain and without (best of --repeats, decode steps only), the speculation counters,
the chain's split verifies (a verify entered with a step queued: two forwards), and whether the two token
lists are identical (bf16 near-ties can flip between a 1-row and a (k+1)-row forward: common_prefix says where)
and, for plain and no-drafts, the tok/s of speculation off (the chain alone) for scale.

Every result is one JSON line appended to OUTDIR/results.jsonl as soon as it exists; --pytest then runs
tests/unit/engine/test_lookup_chain.py and test_greedy_chain.py on the GPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

T0 = time.time()
ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--shapes", default="llama-1b,llama-8b")
ap.add_argument("--contexts", default="1024")
ap.add_argument("--tokens", type=int, default=256)
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--deadline-s", type=float, default=300.0)
ap.add_argument("--pytest", action="store_true")
ap.add_argument("--smoke-cpu", action="store_true",
                help="run the script's code paths on CPU with a tiny shape (no CUDA graphs): a check of this "
                     "script, not a result")
args = ap.parse_args()
import torch  # noqa: E402

from expresslane.engine.decode import DecodeEngine, SamplingParams, SpeculationConfig  # noqa: E402

# gpu_shapes.py lives beside gpu_lean.py, in the lab note of the lean step
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-01-gpu-lean-step"))
from gpu_shapes import ResultLog, make_model  # noqa: E402

DEV = torch.device("cpu" if args.smoke_cpu else "cuda")
_log = ResultLog(args.out, args.deadline_s, T0)
emit, late = _log.emit, _log.late
FIRST = 424  # the first token (the prefill's), as docs/bench/2026-12-01-gpu-lean-step/gpu_lean.py
def decode(engine: DecodeEngine, ctx: int, lookup: list[int], chain: bool, speculative: bool = True) -> dict:
    """Best of --repeats: tok/s of --tokens greedy tokens after the first, the lookup seeing `lookup`."""
    best: dict | None = None
    engine.greedy_chain = chain
    try:
        for _ in range(args.repeats):
            engine.cached_tokens = ctx  # rows [0, ctx) hold random K/V: a context of ctx tokens
            gen = engine.generate(FIRST, ctx, SamplingParams(max_tokens=args.tokens + 1, ignore_eos=True,
                                                             speculative=speculative, prompt_token_ids=lookup))
            next(gen)
            t0 = time.perf_counter()
            out = list(gen)
            rate = len(out) / (time.perf_counter() - t0)
            if best is None or rate > best["tok_per_s"]:
                best = {"tok_per_s": rate, "token_ids": list(gen.token_ids), "spec": gen.spec.as_dict(),
                        "split_verifies": gen.split_verifies}
    finally:
        engine.greedy_chain = True
    return best


class NoDrafts:
    """A drafter that never drafts: the speculating path with every step plain (the lookup's best case for the
    chain, whether or not the random weights happen to repeat themselves)."""

    def start(self, context) -> None:
        pass

    def propose(self, k: int) -> list[int]:
        return []

    def extend(self, tokens) -> None:
        pass

    def may_draft_next(self) -> bool:
        return False


SUMMARY: list[dict] = []


def print_summary() -> None:
    """One table of the lookup_chain rows (what docs/bench/2026-12-02-greedy-chain-lookup/ records)."""
    print("| shape | context | case | chain tok/s | loop tok/s | speedup | spec off tok/s | acceptance | "
          "verify / plain steps | split | identical |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|---:|---|")
    for r in SUMMARY:
        s = r["spec"]
        off = r.get("speculation_off_tok_per_s")
        print(f"| {r['shape']} | {r['context']} | {r['case']} | {r['chain_tok_per_s']:.1f} | "
              f"{r['loop_tok_per_s']:.1f} | {r['speedup']:.3f}x | {'' if off is None else f'{off:.1f}'} | "
              f"{s['mean_acceptance']:.2f} | {s['verify_steps']} / {s['plain_steps']} | {r['split_verifies']} | "
              f"{r['identical']} ({r['common_prefix']}/{r['tokens']}) |", flush=True)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_shape(shape: str, contexts: list[int]) -> None:
    t0 = time.time()
    model = make_model(shape, DEV)
    cuda = DEV.type == "cuda"
    engine = DecodeEngine(model, model.config, dtype=torch.bfloat16, device=DEV,
                          max_seq_len=max(contexts) + args.tokens + 64, attention="split" if cuda else "live",
                          cuda_graph=cuda, speculation=SpeculationConfig())
    engine.warmup()  # the lean T = 1 graph, the greedy chain's graph, every verify bucket's graph
    with torch.no_grad():
        engine.cache.k.normal_()
        engine.cache.v.normal_()
    emit("shape", shape=shape, step=engine.runner.mode.value, weight_gb=engine.weight_bytes() / 1e9,
         build_and_warmup_s=round(time.time() - t0, 1))
    rng = torch.Generator().manual_seed(1)
    for ctx in contexts:
        if late(f"{shape} context {ctx}"):
            break
        prompt = torch.randint(0, engine.vocab_size, (ctx,), generator=rng).tolist()
        off = decode(engine, ctx, prompt, chain=True, speculative=False)  # the chain alone, no drafter
        answer = off["token_ids"]
        corrupt = [t if i % 8 != 5 else (t + 1) % engine.vocab_size for i, t in enumerate(answer)]
        for case, lookup in (("plain", prompt), ("no-drafts", prompt), ("repeating", prompt + answer),
                             ("mixed", prompt + corrupt)):
            if late(f"{shape} context {ctx} {case}"):
                break
            if case == "no-drafts":  # every step plain, whatever the weights repeat
                engine.set_drafter(NoDrafts)
            try:
                chained = decode(engine, ctx, lookup, chain=True)
                loop = decode(engine, ctx, lookup, chain=False)
            finally:
                engine.set_drafter(None)
            a, b = chained.pop("token_ids"), loop.pop("token_ids")
            row = dict(shape=shape, context=ctx, case=case, chain_tok_per_s=chained["tok_per_s"],
                       loop_tok_per_s=loop["tok_per_s"], speedup=chained["tok_per_s"] / loop["tok_per_s"],
                       identical=a == b, common_prefix=common_prefix(a, b), tokens=len(a),
                       equals_speculation_off=a == answer, spec=chained["spec"], loop_spec=loop["spec"],
                       split_verifies=chained["split_verifies"])
            if case in ("plain", "no-drafts"):
                row["speculation_off_tok_per_s"] = off["tok_per_s"]
            emit("lookup_chain", **row)
            SUMMARY.append(row)
    del engine, model
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    smi = args.smoke_cpu or subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True).stdout.strip()
    emit("env", argv=sys.argv[1:], date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), gpu=smi,
         torch=torch.__version__, python=sys.version.split()[0],
         commit=open("GIT_HEAD").read().strip() if os.path.exists("GIT_HEAD") else None)
    contexts = [int(c) for c in args.contexts.split(",")]
    for shape in args.shapes.split(","):
        if late(f"shape {shape}"):
            continue
        try:
            run_shape(shape, contexts)
        except Exception as e:
            emit("failed", shape=shape, error=repr(e)[:2000])
            import traceback
            traceback.print_exc()
    print_summary()
    if args.pytest and not late("pytest"):
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                               "tests/unit/engine/test_lookup_chain.py", "tests/unit/engine/test_greedy_chain.py"],
                              capture_output=True, text=True,
                              timeout=max(10, args.deadline_s + 120 - (time.time() - T0)))
        emit("pytest", rc=proc.returncode, tail=proc.stdout[-1500:])
    emit("done")


main()
