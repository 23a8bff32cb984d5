#!/usr/bin/env python3
"""Train a small copy-capable Llama from the repo's own files, deterministically, in minutes of CPU, and
measure the acceptance prompt lookup gets with it.

    python docs/bench/2026-12-04-copy-acceptance/make_copy_model.py OUTDIR [--steps 2000] [--seq 512] [--threads 2]
    python docs/bench/2026-12-04-copy-acceptance/make_copy_model.py OUTDIR --measure-only      # acceptance of an existing OUTDIR
    python docs/bench/2026-12-04-copy-acceptance/make_copy_model.py OUTDIR --tokens 240 --trace TRACES.json   # + the speculation traces

No checkpoint can be downloaded here, and random weights never copy, so prompt-lookup acceptance on them is
meaningless. This model learns what matters for it: continuing text like the repo's code and docs and, above
all, copying (induction), from the repo's tracked *.py / *.md files (sorted, so the data is fixed by the
commit) with half of each batch made of "chunk, then the same chunk again" sequences, as an edit request
repeats the file it edits. The tokenizer is the tiny model's (scripts/make_tiny_model.py, written first into
OUTDIR/../tiny-llama if absent): 1024-token byte-level BPE. 2 layers, hidden 128, 4 / 2 heads, float32,
tied embeddings. Same commit + arguments + thread count -> the same weights (seeded, single process).

--measure: greedy decoding with DecodeEngine, speculation on (prompt lookup, k = 4) and off, on a code-edit
prompt (a piece of a repo file, an instruction to rewrite it with one rename, its first line), an agentic
prompt (a tool's JSON result, then the start of an answer quoting it), both about 260 tokens (with the output,
inside the 513-token windows it is trained on), and the code-edit prompt over a whole 1.3k-token file. Prints
acceptance, tokens per forward, wall time against plain decoding, whether the two decodes are identical.

Measured 2026-12-04 (docs/bench/2026-12-04-copy-acceptance/: --seq 512 --steps 4000, 13.6 min of training on 2
CPUs, 240 tokens, the node's drafter): code-edit 1.56 drafts kept per verify step, 1.88 tokens per forward;
agentic 3.19 and 3.57; the 1.3k-token prompt 0.68 and 1.12. Greedy output identical with speculation on and off.
Whether the model copies a given prompt varies from one training run to the next (a 2-layer model trained for
minutes): 2000-step models gave code-edit 3.27 and 1.58 tokens per forward on trees one docstring apart. With the
earlier defaults (256-token windows, 1500 steps) it stops copying past the window: code-edit 1.22 tokens per
forward over 256 output tokens.

--texts FILE: also write each prompt and its greedy output (token ids), for `bench --replay-text FILE`, which
runs the node's own drafter on that text at any model's step costs (the GPU check: the 8B and 1B shapes).

--trace FILE: also write each prompt's speculation trace, the (drafted, kept) of every step of the node's
default drafter (adaptive prompt lookup, k <= 4), for `python -m expresslane.engine.decode.bench --replay FILE`,
which replays it on any model (the GPU check: the 8B shape).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]  # this lab note's folder is docs/bench/<date>-<topic>/
SEQ = 512


def repo_text() -> str:
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "*.py", "*.md"], capture_output=True, text=True,
                           check=True).stdout.split()
    keep = [f for f in sorted(files) if not f.startswith("docs/bench/")]
    return "\n\n".join((REPO / f).read_text(errors="replace") for f in keep if (REPO / f).is_file())


def batches(ids: torch.Tensor, steps: int, batch: int, seed: int, seq: int = SEQ):
    g = torch.Generator().manual_seed(seed)
    n = ids.numel()
    for _ in range(steps):
        rows = []
        for b in range(batch):
            if b % 2:  # copy task: a chunk, then the same chunk again
                half = seq // 2
                s = int(torch.randint(0, n - half - 1, (1,), generator=g))
                chunk = ids[s:s + half]
                rows.append(torch.cat([chunk, chunk, ids[s + half:s + half + 1]]))
            else:
                s = int(torch.randint(0, n - seq - 2, (1,), generator=g))
                rows.append(ids[s:s + seq + 1])
        yield torch.stack(rows)


def train(out: Path, tok_dir: Path, steps: int, seed: int, seq: int = SEQ) -> None:
    import transformers
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    ids = torch.tensor(tok.encode(repo_text()).ids, dtype=torch.long)
    print(f"corpus: {ids.numel()} tokens from the repo's *.py / *.md", flush=True)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=344, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    t0 = time.perf_counter()
    for step, xb in enumerate(batches(ids, steps, 8, seed, seq)):
        loss = model(input_ids=xb[:, :-1], labels=xb[:, :-1]).loss  # HF shifts labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f}s)", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tok_dir / name).read_bytes())
    print(f"copy model in {out} ({time.perf_counter() - t0:.0f}s of training)", flush=True)


def measure(out: Path, tokens: int = 100, compile: bool = False, repeats: int = 3, trace: Path | None = None,
            texts: Path | None = None) -> None:
    sys.path.insert(0, str(REPO / "engine" / "src"))
    import json

    from tokenizers import Tokenizer

    from expresslane.engine.decode import DecodeEngine, SamplingParams
    from expresslane.engine.decode.bench import RecordingDrafter

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    source = (REPO / "engine/src/expresslane/engine/decode/cache.py").read_text()
    snippet = source[source.index("class StaticKVCache"):][:420]
    doc = (REPO / "docs/protocol.md").read_text()[:360].replace('"', "'")
    # Short prompts (about 260 tokens): with the output they stay inside the training window (--seq); RoPE
    # positions far beyond it are outside what the model learnt; the long variant shows what happens there.
    prompts = {
        "code-edit": snippet + "\n\n# The same code with k renamed to keys:\n\n" + snippet.splitlines()[0] + "\n",
        "agentic": '{"tool": "read_file", "path": "docs/protocol.md", "result": "' + doc + '"}\n\nThe file says: "'
        + doc[:20],
        "code-edit-long (1.3k tokens)": source + "\n\n# The same file with KVGeometry renamed to CacheGeometry:\n\n"
        + source.splitlines()[0] + "\n",
    }
    from expresslane.engine.decode import SpeculationConfig

    kw = dict(max_seq_len=4096, compile=compile)
    engines = {"adaptive k<=4": DecodeEngine.from_pretrained(out, **kw),
               "fixed k=4": DecodeEngine.from_pretrained(out, speculation=SpeculationConfig(adaptive=False), **kw),
               "plain": DecodeEngine.from_pretrained(out, speculation=None, **kw)}
    steps: list[tuple[int, int]] = []  # the adaptive engine's request, step by step
    adaptive = engines["adaptive k<=4"]
    adaptive.set_drafter(lambda: RecordingDrafter(adaptive.speculation.drafter(), steps))
    traces = {}
    recorded = {}  # name -> (prompt ids, plain greedy output)
    if compile:
        for e in engines.values():
            e.warmup()
    for name, text in prompts.items():
        ids = tok.encode(text).ids
        runs = {}
        for label, e in engines.items():
            best = None
            for _ in range(repeats):  # best of: a shared host is noisy
                first = int(e.prefill(ids).argmax())
                gen = e.generate(first, len(ids), SamplingParams(max_tokens=tokens, ignore_eos=True,
                                                                 prompt_token_ids=ids))
                t0 = time.perf_counter()
                got = list(gen)
                dt = time.perf_counter() - t0
                if best is None or dt < best[2]:
                    best = (got, gen.spec, dt)
                if e is adaptive:
                    traces[name.split(" ")[0]] = list(steps)  # the same steps every run (greedy, one model)
            runs[label] = best
        ref, _, t_plain = runs["plain"]
        recorded[name.split(" ")[0]] = (ids, ref)
        print(f"{name}: prompt {len(ids)} tokens, {tokens} generated (best of {repeats}, "
              f"{'compiled' if compile else 'eager'} step)", flush=True)
        for label, (got, s, dt) in runs.items():
            if label == "plain":
                continue
            print(f"  {label}: mean acceptance {s.mean_acceptance:.2f} per verify step, {s.verify_steps} verify + "
                  f"{s.plain_steps} plain forwards, {s.drafted_tokens} drafted / {s.accepted_tokens} kept, "
                  f"{s.tokens_per_forward:.2f} tokens per forward, identical to plain greedy: {got == ref}; "
                  f"wall {dt:.3f}s vs {t_plain:.3f}s plain ({t_plain / dt:.2f}x)", flush=True)
        print(f"  continuation: {tok.decode(ref[:80])!r}", flush=True)
    if trace is not None:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        trace.write_text(json.dumps({
            "what": "(drafted, kept) of every decode step of the node's default drafter (adaptive prompt lookup, "
                    "k <= 4) on the copy model of this commit; replay: python -m expresslane.engine.decode.bench "
                    "--replay THIS_FILE", "commit": commit, "tokens": tokens,
            "traces": {k: [list(s) for s in v] for k, v in traces.items()}}, indent=None) + "\n")
        print(f"traces of {', '.join(traces)} in {trace}", flush=True)
    if texts is not None:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        texts.write_text(json.dumps({
            "what": "each prompt and its greedy output (token ids, the first token included) on the copy model "
                    f"{out.name} at commit {commit}; replay with the node's own drafter: python -m "
                    "expresslane.engine.decode.bench --replay-text THIS_FILE", "commit": commit, "tokens": tokens,
            "texts": {k: {"prompt": p, "output": o} for k, (p, o) in recorded.items()}}, indent=None) + "\n")
        print(f"texts of {', '.join(recorded)} in {texts}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seq", type=int, default=SEQ, help="training window (tokens); a request past it stops copying")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--measure-only", action="store_true", help="measure OUT (any model dir with the tiny tokenizer)")
    ap.add_argument("--compile", action="store_true", help="measure with the compiled step (as the launched stack)")
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--trace", type=Path, default=None, help="write each prompt's speculation trace (JSON)")
    ap.add_argument("--texts", type=Path, default=None,
                    help="write each prompt and its greedy output (JSON, for bench --replay-text)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.measure_only:
        tok_dir = args.out.parent / "tiny-llama"
        if not (tok_dir / "tokenizer.json").exists():
            subprocess.run([sys.executable, str(REPO / "scripts/make_tiny_model.py"), str(tok_dir)], check=True)
        train(args.out, tok_dir, args.steps, args.seed, args.seq)
    measure(args.out, tokens=args.tokens, compile=args.compile, trace=args.trace, texts=args.texts)


if __name__ == "__main__":
    main()
