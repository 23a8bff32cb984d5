"""Several users on one engine (decode/batch.py): per-user tok/s, aggregate, x solo, % of the whole step's bound.

    python -m expresslane.engine.decode.bench_users {--model DIR | --random-shape llama-8b} [--device cuda]
        [--dtype bfloat16] [--contexts 1024,8192] [--users 1,2,4,8] [--tokens 128] [--speculation on,off]
        [--text TEXTS.json] [--compile] [--repeats 3] [--threads N] [--json F]

For each context, speculation setting and user count U it runs U requests at once on an engine of max(--users)
seats (each on its own seat, a prompt of `context` tokens: random ids, or with --text a recorded request's prompt
repeated to that length), greedy, `tokens` tokens each, and reports:
- per-user tok/s: each user's tokens over the wall time of the whole run (every user decodes the same number),
  the median of --repeats rounds; each round runs every U in turn (1, 2, 4, ...);
- aggregate tok/s: U times that; x solo: the median over rounds of per-user over the same round's U = 1 run
  (same engine, same prompt length): a device's speed drifts a few per cent from run to run, a paired ratio
  does not carry that drift;
- host ms a step: the scheduler's host work between forwards (planning, emitting; the device idles then);
- of_bound: the run's bytes (the weights once a step plus each user's live K/V) at the device's copy bandwidth,
  over the time it took (a step of U users reads the weights once and U caches: that is the bound of the step);
- exact: every user's tokens, in every round, equal its first run's (the smallest U it is in; user 0: alone).
Users' prompts differ (each its own random ids, or the recorded text at another offset), so no two share a
token stream. The first token of each is the prefill's; only decode steps are timed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from .bench import _sync, build_engine, copy_bandwidth, load_texts
from .engine import ATTENTION_MODES, CUDA_GRAPH_CHOICES, DecodeEngine
from .sampling import SamplingParams
from .shapes import SHAPES
from .speculative import SpeculationConfig


def user_prompts(users: int, context: int, vocab: int, text: list[int] | None, seed: int = 0) -> list[list[int]]:
    """One prompt of `context` tokens per user: random ids, or `text` repeated to that length and rotated by a
    user's offset (recorded text: the drafter finds what a real request would)."""
    rng = random.Random(seed)
    if text is None:
        return [[rng.randrange(vocab) for _ in range(context)] for _ in range(users)]
    out = []
    for u in range(users):
        shift = (u * 97) % len(text)
        rotated = text[shift:] + text[:shift]
        out.append((rotated * (context // len(rotated) + 1))[:context])
    return out


def prefill_seats(engine: DecodeEngine, prompts: list[list[int]]) -> list[int]:
    """Each prompt's KV into its user's seat (seat u for user u), once per context: a decode writes only rows past
    the prompt, so every run after reuses them. Returns each prompt's first token (the prefill's)."""
    firsts = []
    for seat, prompt in enumerate(prompts):
        firsts.append(int(engine.prefill(prompt, seat=seat).argmax()))
        _sync(engine)
    return firsts


def run_users(engine: DecodeEngine, prompts: list[list[int]], firsts: list[int], tokens: int,
              speculative: bool) -> dict:
    """All prompts decoded at once (seat u for user u, prefilled): wall time of the decode steps, the part of it
    spent in the forwards (on a GPU: from the inputs' staging to the rows' argmaxes on the host; the rest is the
    scheduler's host work between forwards, when the device idles) and each user's tokens."""
    gens = []
    for seat, (prompt, first) in enumerate(zip(prompts, firsts)):
        gens.append(engine.generate(first, len(prompt), SamplingParams(
            max_tokens=tokens + 1, ignore_eos=True, speculative=speculative, prompt_token_ids=prompt), seat=seat))
    sched = engine.scheduler
    sched.step()  # emits every first token (the prefill's): not timed
    _sync(engine)
    steps0, rows0 = sched.steps, dict(sched.rows_histogram)
    forward, in_forward = sched._forward_rows, [0.0]

    def timed_forward(plan, want_argmax, while_running=None):
        t = time.perf_counter()
        try:
            return forward(plan, want_argmax, while_running)
        finally:
            in_forward[0] += time.perf_counter() - t

    sched._forward_rows = timed_forward
    try:
        t0 = time.perf_counter()
        while sched.active:
            sched.step()
        _sync(engine)
        dt = time.perf_counter() - t0
    finally:
        sched._forward_rows = forward
    steps = sched.steps - steps0
    rows = {r: n - rows0.get(r, 0) for r, n in sched.rows_histogram.items() if n - rows0.get(r, 0)}
    spec = [g.spec.as_dict() for g in gens]
    return {"seconds": dt, "steps": steps, "rows_histogram": rows,
            "host_ms_per_step": 1e3 * (dt - in_forward[0]) / max(1, steps),
            "token_ids": [g.token_ids for g in gens],
            "tokens_per_forward": [s["tokens_per_forward"] for s in spec],
            "mean_acceptance": [s["mean_acceptance"] for s in spec]}


def bench(engine: DecodeEngine, contexts: list[int], users_list: list[int], tokens: int, spec_modes: list[bool],
          repeats: int, bw: float | None, text: list[int] | None) -> list[dict]:
    """Rounds of every user count in turn (1, 2, 4, ...), `repeats` rounds: a device's speed drifts by a few
    per cent from one run to the next (clocks, the host), so each round's U users are compared with the same
    round's single user, and the table gives the median of those paired ratios (x_solo), the median per-user
    speed and the spread of the rounds."""
    kv_token = engine.geometry.token_bytes()
    weights = engine.weight_bytes()
    users_list = sorted(users_list)
    out = []
    for ctx in contexts:
        prompts = user_prompts(max(users_list), ctx, engine.vocab_size, text)
        firsts = prefill_seats(engine, prompts)
        for speculative in spec_modes:
            runs: dict[int, list[dict]] = {u: [] for u in users_list}
            for _ in range(repeats):
                for users in users_list:
                    runs[users].append(run_users(engine, prompts[:users], firsts, tokens, speculative))
            solo_speeds = [tokens / r["seconds"] for r in runs[1]] if 1 in runs else None
            for users in users_list:
                rs = runs[users]
                speeds = [tokens / r["seconds"] for r in rs]
                per_user = statistics.median(speeds)
                mid = min(rs, key=lambda r: abs(tokens / r["seconds"] - per_user))  # the median run
                ratios = [s / s1 for s, s1 in zip(speeds, solo_speeds)] if solo_speeds else None
                # every user's tokens in every round against its first run: that of the smallest U it is in
                # (user 0: alone), so any user or round that a neighbour changed shows
                first_seen: dict[int, list[int]] = {}
                for u_count in users_list:
                    for u in range(u_count):
                        first_seen.setdefault(u, runs[u_count][0]["token_ids"][u])
                exact = all(r["token_ids"][u] == first_seen[u] for r in rs for u in range(users))
                kv = users * (ctx + tokens / 2) * kv_token
                row = {"context": ctx, "users": users, "speculation": speculative, "tokens": tokens,
                       "repeats": repeats, "per_user_tok_per_s": per_user, "aggregate_tok_per_s": users * per_user,
                       "per_user_runs": [round(s, 2) for s in speeds],
                       "x_solo": statistics.median(ratios) if ratios else None,
                       "x_solo_runs": [round(x, 4) for x in ratios] if ratios else None,
                       "exact_vs_alone": exact, "steps": mid["steps"], "rows_histogram": mid["rows_histogram"],
                       "host_ms_per_step": mid["host_ms_per_step"],
                       "tokens_per_forward": mid["tokens_per_forward"],
                       "mean_acceptance": mid["mean_acceptance"], "kv_gb": kv / 1e9}
                if bw:
                    step_bytes = weights + kv
                    row["of_bound"] = step_bytes * mid["steps"] / mid["seconds"] / bw
                out.append(row)
                spread = f" (runs {min(speeds):.1f}-{max(speeds):.1f})" if repeats > 1 else ""
                print(f"context={ctx} users={users} speculation={'on' if speculative else 'off'}: "
                      f"per-user {per_user:.1f} tok/s{spread}, aggregate {users * per_user:.1f} tok/s"
                      + (f", x solo {row['x_solo']:.3f}" if row["x_solo"] else "")
                      + (f", {100 * row['of_bound']:.1f} % of the step bound" if bw else "")
                      + f", host {row['host_ms_per_step']:.3f} ms a step"
                      + f", tok/fwd {sum(mid['tokens_per_forward']) / users:.2f}, exact={exact}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m expresslane.engine.decode.bench_users", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a Hugging Face checkpoint directory")
    source.add_argument("--random-shape", choices=sorted(SHAPES), help="random weights of a real model's shape")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--contexts", default="128", help="comma-separated prompt lengths")
    ap.add_argument("--users", default="1,2,4", help="comma-separated user counts (1 is always run: x solo)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens each user decodes")
    ap.add_argument("--speculation", default="on,off", help="on, off or both (the node's default is on)")
    ap.add_argument("--speculation-k", type=int, default=4)
    ap.add_argument("--text", default=None, help="recorded texts (bench --replay-text's file): users' prompts "
                                                 "are its first request's prompt and output")
    ap.add_argument("--attention", choices=ATTENTION_MODES, default=None)
    ap.add_argument("--cuda-graph", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--compile", action="store_true", help="torch.compile the CPU step (the CPU node's default)")
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds of every user count in turn; the table gives medians (x solo: of each round's ratio)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-bound", action="store_true", help="skip the copy-bandwidth calibration")
    ap.add_argument("--json", default=None, help="append one JSON line per result to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    users_list = sorted({1, *(int(u) for u in args.users.split(","))})
    modes = [m == "on" for m in args.speculation.split(",")]
    max_seq_len = args.max_seq_len or max(contexts) + args.tokens + 64
    text = None
    if args.text:
        try:
            prompt, output = next(iter(load_texts(args.text).values()))
        except (OSError, ValueError, StopIteration) as e:
            ap.error(f"--text: {e}")
        text = [*prompt, *output]
    options = dict(dtype=args.dtype, device=args.device, max_seq_len=max_seq_len, attention=args.attention,
                   cuda_graph=CUDA_GRAPH_CHOICES[args.cuda_graph], seats=max(users_list), compile=args.compile,
                   speculation=SpeculationConfig(k=args.speculation_k) if args.speculation_k else None)
    t0 = time.perf_counter()
    try:
        engine = build_engine(args.model, args.random_shape, **options)
        engine.warmup()
    except (OSError, ValueError) as e:
        ap.error(str(e))
    bw = None if args.no_bound else copy_bandwidth(engine.device)
    name = args.model or args.random_shape
    print(f"model={name} dtype={args.dtype} device={args.device} seats={engine.seats} step={engine.runner.mode.value} "
          f"compile={engine.compile} "
          f"threads={torch.get_num_threads()} max_seq_len={max_seq_len} load+warmup_s={time.perf_counter() - t0:.1f} "
          f"weights={engine.weight_bytes() / 1e9:.3f}GB" + (f" copy_bandwidth={bw / 1e9:.0f}GB/s" if bw else ""),
          flush=True)
    rows = bench(engine, contexts, users_list, args.tokens, modes, args.repeats, bw, text)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"model": name, "dtype": args.dtype, "device": args.device,
                                    "step": engine.runner.mode.value, **r}) + "\n")


if __name__ == "__main__":
    main()
