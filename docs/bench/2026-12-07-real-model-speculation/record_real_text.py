#!/usr/bin/env python3
"""Speculation on real text: the express engine's prompt-lookup drafter on SmolLM2-135M-Instruct's own greedy output.

    python docs/bench/2026-12-07-real-model-speculation/record_real_text.py MODEL_DIR [--tokens 256] [--compile]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--repeats 3] [--texts texts.json] [--traces traces.json]

MODEL_DIR: the real model (scripts/model_init.py; var/models/smollm2-135m-instruct). Four chat requests rendered with
the model's chat template, as the router's prefill would: a chat question, a code edit, a quote/summarise request
and an agentic turn whose tool result the answer draws on. Each runs greedily on three engines of the same
checkpoint: the node's default (adaptive prompt lookup, k <= 4), a fixed k = 4 drafter and no speculation; the
output stops at EOS as a served request does (or at --tokens). Printed per request: mean acceptance per verify,
tokens per forward, drafted / kept, whether the output equals plain greedy, and wall time against plain (best of
--repeats, the engines interleaved repeat by repeat; a shared 2-CPU host is noisy).

--texts writes each prompt and its plain greedy output (token ids) in the format `python -m
expresslane.engine.decode.bench --replay-text` reads; --traces writes the default engine's (drafted, kept) of
every step, the format `bench --replay` reads. Both are the real-text evidence the GPU replays at the 1B and 8B
step costs (README.md beside this file has the commands).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

CODE = '''import json
from pathlib import Path


def load_settings(path):
    """Read the settings file and fill in the defaults."""
    data = json.loads(Path(path).read_text())
    data.setdefault("timeout", 30)
    data.setdefault("retries", 3)
    data.setdefault("log_level", "info")
    return data


def save_settings(path, data):
    Path(path).write_text(json.dumps(data, indent=2))
'''

QUOTE = ("The Industrial Revolution began in Great Britain in the late eighteenth century. Steam engines, first used "
         "to pump water out of mines, were soon driving looms and locomotives. Factories drew workers from the "
         "countryside into fast-growing cities, where wages were low and hours were long. Over the next century the "
         "new methods spread to Europe and North America, and living standards slowly rose.")

TOOL_RESULT = json.dumps({"city": "Lisbon", "date": "2026-12-07", "forecast": [
    {"hour": "09:00", "temp_c": 13, "sky": "light rain", "wind_kmh": 18},
    {"hour": "12:00", "temp_c": 16, "sky": "cloudy", "wind_kmh": 14},
    {"hour": "15:00", "temp_c": 17, "sky": "sunny intervals", "wind_kmh": 11},
    {"hour": "18:00", "temp_c": 14, "sky": "clear", "wind_kmh": 9}]})

REQUESTS = {
    "chat": [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}],
    "code-edit": [{"role": "user", "content": "Rename the function load_settings to read_config in this Python "
                                              "module and return the whole module:\n\n" + CODE}],
    "quote-summarise": [{"role": "user", "content": "Quote the first two sentences of this text exactly, then "
                                                    "summarise the rest in one sentence:\n\n" + QUOTE}],
    "agentic": [
        {"role": "user", "content": "What will the weather be like in Lisbon today? List every hour."},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
            "name": "get_forecast", "arguments": json.dumps({"city": "Lisbon"})}}]},
        {"role": "tool", "content": TOOL_RESULT}],
}
TOOLS = [{"type": "function", "function": {"name": "get_forecast", "description": "Hourly forecast for a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--tokens", type=int, default=256, help="most tokens a request generates (EOS ends it sooner)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compile", action="store_true", help="torch.compile the step (what the CPU node runs)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--texts", type=Path, default=None)
    ap.add_argument("--traces", type=Path, default=None)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from expresslane.engine.decode import DecodeEngine, SamplingParams, SpeculationConfig
    from expresslane.engine.decode.bench import RecordingDrafter

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(str(args.model_dir))
    kw = dict(max_seq_len=2048, compile=args.compile, device=args.device, dtype=args.dtype)
    engines = {"adaptive k<=4": DecodeEngine.from_pretrained(args.model_dir, **kw),
               "fixed k=4": DecodeEngine.from_pretrained(args.model_dir,
                                                         speculation=SpeculationConfig(adaptive=False), **kw),
               "plain": DecodeEngine.from_pretrained(args.model_dir, speculation=None, **kw)}
    for e in engines.values():
        e.warmup()  # compiles with --compile; the adaptive drafter's step costs are measured here
    steps: list[tuple[int, int]] = []
    adaptive = engines["adaptive k<=4"]
    adaptive.set_drafter(lambda: RecordingDrafter(adaptive.speculation.drafter(), steps))
    traces, recorded, rows = {}, {}, []
    for name, messages in REQUESTS.items():
        ids = tok.apply_chat_template(messages, tools=TOOLS if name == "agentic" else None,
                                      add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        runs: dict = {}
        # Engines interleaved, repeat by repeat: a shared host's load changes over minutes, and each engine then
        # sees the same spells of it (best of --repeats each).
        for _, (label, e) in ((r, le) for r in range(args.repeats) for le in engines.items()):
            with torch.inference_mode():
                first = int(e.prefill(ids).argmax())
            if e.device.type == "cuda":
                torch.cuda.synchronize(e.device)
            gen = e.generate(first, len(ids), SamplingParams(max_tokens=args.tokens, prompt_token_ids=tuple(ids)))
            t0 = time.perf_counter()
            got = list(gen)
            if e.device.type == "cuda":
                torch.cuda.synchronize(e.device)
            dt = time.perf_counter() - t0
            if label not in runs or dt < runs[label][2]:
                runs[label] = (got, gen.spec, dt)
            if e is adaptive:
                traces[name] = list(steps)  # the same steps every run (greedy, one model)
        ref, _, t_plain = runs["plain"]
        recorded[name] = (ids, ref)
        print(f"{name}: prompt {len(ids)} tokens, {len(ref)} generated (best of {args.repeats}, "
              f"{'compiled' if args.compile else 'eager'} step, plain {len(ref) / t_plain:.1f} tok/s)", flush=True)
        for label, (got, s, dt) in runs.items():
            if label == "plain":
                continue
            row = {"request": name, "engine": label, "prompt_tokens": len(ids), "tokens": len(got),
                   "mean_acceptance": round(s.mean_acceptance, 3), "tokens_per_forward": round(s.tokens_per_forward, 3),
                   "verify_forwards": s.verify_steps, "plain_forwards": s.plain_steps, "drafted": s.drafted_tokens,
                   "kept": s.accepted_tokens, "identical_to_plain": got == ref, "wall_s": round(dt, 4),
                   "plain_wall_s": round(t_plain, 4), "speed_vs_plain": round(t_plain / dt, 3)}
            rows.append(row)
            print(f"  {label}: acceptance {s.mean_acceptance:.2f} per verify, {s.verify_steps} verify + "
                  f"{s.plain_steps} plain forwards, {s.drafted_tokens} drafted / {s.accepted_tokens} kept, "
                  f"{s.tokens_per_forward:.2f} tokens per forward, identical to plain greedy: {got == ref}; "
                  f"{dt:.3f}s vs {t_plain:.3f}s plain ({t_plain / dt:.2f}x)", flush=True)
        print(f"  answer: {tok.decode(ref[:120])!r}", flush=True)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(json.dumps({"rows": rows}))
    if args.traces is not None:
        args.traces.write_text(json.dumps({
            "what": "(drafted, kept) of every decode step of the node's default drafter (adaptive prompt lookup, "
                    "k <= 4) on SmolLM2-135M-Instruct's greedy answers to real requests; replay: python -m "
                    "expresslane.engine.decode.bench --replay THIS_FILE", "commit": commit,
            "traces": {k: [list(s) for s in v] for k, v in traces.items()}}) + "\n")
    if args.texts is not None:
        args.texts.write_text(json.dumps({
            "what": "each real request's prompt (chat template applied) and SmolLM2-135M-Instruct's greedy output "
                    "(token ids, the first token included, to EOS); replay with the node's own drafter: python -m "
                    "expresslane.engine.decode.bench --replay-text THIS_FILE", "commit": commit,
            "texts": {k: {"prompt": p, "output": o} for k, (p, o) in recorded.items()}}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
