"""The lean decode step on one CUDA GPU, in one run (issue 14, items 2 and 5): checks, then speed.

    PYTHONPATH=engine/src python3 docs/bench/2026-12-01-gpu-lean-step/gpu_lean.py --out OUTDIR [--shapes llama-1b,llama-8b]
        [--contexts 1024,8192,32768] [--tokens 256] [--deadline-s 240] [--pytest] [--compiled]

1. Device facts and copy bandwidth (bytes read + written, best of 3 copies of 1 GiB x 10).
2. Per shape (random bf16 weights with Llama-3.2-1B / Llama-3.1-8B shapes built on the GPU, lm_head x16 as in
   scripts/gpu_make_shape_model.py, no checkpoint written): each fused kernel against the model's own PyTorch
   modules on layer 0 (relative error), the lean step's logits against the PyTorch graph step's at 1k context,
   then for the lean step and the PyTorch step (CUDA graph, uncompiled) at each context: tok/s of 256 greedy
   tokens through DecodeEngine.generate (best of 2, speculation off), the graph replay's ms per step, the
   bound (copy bandwidth over weights + live K/V at the mean context) and % of it; the greedy tokens of the two
   steps compared; the split-KV attention alone per context; a profile of the lean step's kernels at 1k.
3. Optionally the GPU unit tests that go through the lean step (--pytest: test_fused_kernels, test_cuda_graph,
   test_gpu_speculative) and the compiled PyTorch step (--compiled).

Every result is one JSON line appended to OUTDIR/results.jsonl as soon as it exists (a timeout keeps what was
measured); a part that would start after --deadline-s is skipped and says so.
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
ap.add_argument("--contexts", default="1024,8192,32768")
ap.add_argument("--tokens", type=int, default=256)
ap.add_argument("--deadline-s", type=float, default=240.0)
ap.add_argument("--pytest", action="store_true")
ap.add_argument("--compiled", action="store_true")
ap.add_argument("--pdl-ab", default="",
                help="also measure the lean step with other programmatic-dependent-launch kinds (models/pdl.py), "
                     "same run: label=kinds pairs separated by '/', kinds as EXPRESSLANE_PDL takes them, "
                     "e.g. 'no-partial=gemv,attn_merge/off=0'")
ap.add_argument("--smoke-cpu", action="store_true",
                help="run the script's code paths on CPU with a tiny shape (Triton's interpreter; the lean step's "
                     "runner parts, which need CUDA graphs, are skipped): a check of this script, not a result")
args = ap.parse_args()
if args.smoke_cpu:
    os.environ["TRITON_INTERPRET"] = "1"
import torch  # noqa: E402
import triton  # noqa: E402

from expresslane.engine.decode import DecodeEngine, SamplingParams  # noqa: E402
from expresslane.engine.decode.bench import copy_bandwidth  # noqa: E402
from expresslane.engine.models import fused, pdl  # noqa: E402
from expresslane.engine.models.triton_decode import split_kv_attention  # noqa: E402

from gpu_shapes import ResultLog, make_model  # noqa: E402  (this directory: the scripts run as files)

DEV = torch.device("cpu" if args.smoke_cpu else "cuda")
_log = ResultLog(args.out, args.deadline_s, T0)
emit, late = _log.emit, _log.late
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if torch.isfinite(a).all() else float("nan")


def check_kernels(shape: str, engine: DecodeEngine) -> None:
    model, cfg = engine.model, engine.config
    layer = model.layers[0]
    att, mlp = layer.self_attn, layer.mlp
    d = cfg.head_dim
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(cfg.hidden_size, device=DEV, generator=g).to(torch.bfloat16)
    a = torch.randn(cfg.q_size, device=DEV, generator=g).to(torch.bfloat16)
    pos = min(777, engine.max_seq_len - 1)
    with torch.inference_mode():
        qkv = att.qkv_proj(layer.input_layernorm(x[None])).view(1, -1, d)
        from expresslane.engine.models.rope import apply_rope
        qk = apply_rope(qkv[:, : cfg.num_heads + cfg.num_kv_heads], engine.cos[pos:pos + 1], engine.sin[pos:pos + 1])
        kc = torch.full_like(engine.cache.k_layers[0], float("nan"))
        vc = torch.full_like(kc, float("nan"))
        q = torch.full((cfg.q_size,), float("nan"), dtype=torch.bfloat16, device=DEV)
        fused.norm_qkv_rope(x, layer.input_layernorm.weight, cfg.rms_norm_eps, att.qkv_proj.weight, None,
                            engine.cos, engine.sin, torch.tensor([pos], device=DEV), q, kc, vc, cfg.num_heads,
                            cfg.num_kv_heads, d)
        rows_ok = int(torch.isnan(kc).flatten(1).all(1).sum()) == kc.shape[0] - 1
        emit("kernel_check", shape=shape, kernel="norm_qkv_rope",
             rel_q=rel(q.view(-1, d), qk[0, : cfg.num_heads]), rel_k=rel(kc[pos], qk[0, cfg.num_heads:]),
             rel_v=rel(vc[pos], qkv[0, cfg.num_heads + cfg.num_kv_heads:]), only_row_pos_written=rows_ok)
        del kc, vc
        res = x.clone()
        fused.gemv_residual(a, att.o_proj.weight, None, res)
        emit("kernel_check", shape=shape, kernel="gemv_residual(o_proj)", rel=rel(res, x + att.o_proj(a[None])[0]))
        gate, up = mlp.gate_up_proj(layer.post_attention_layernorm(x[None]))[0].split(cfg.intermediate_size)
        h = torch.full((cfg.intermediate_size,), float("nan"), dtype=torch.bfloat16, device=DEV)
        fused.norm_gate_up_silu(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps, mlp.gate_up_proj.weight,
                                None, h)
        ref_h = torch.nn.functional.silu(gate) * up
        emit("kernel_check", shape=shape, kernel="norm_gate_up_silu", rel=rel(h, ref_h))
        res = x.clone()
        fused.gemv_residual(ref_h, mlp.down_proj.weight, None, res)
        emit("kernel_check", shape=shape, kernel="gemv_residual(down_proj)",
             rel=rel(res, x + mlp.down_proj(ref_h[None])[0]))
        logits = torch.full((cfg.vocab_size,), float("nan"), device=DEV)
        fused.norm_gemv(x, model.norm.weight, cfg.rms_norm_eps, model.lm_head.weight, logits)
        ref = model.lm_head(model.norm(x)).float()
        emit("kernel_check", shape=shape, kernel="norm_gemv(lm_head)", rel=rel(logits, ref),
             argmax_equal=int(logits.argmax()) == int(ref.argmax()))


def use_lean(engine: DecodeEngine, lean: bool) -> None:
    if not (args.smoke_cpu and lean):  # on CPU the lean step cannot be selected (it needs a CUDA graph)
        engine.runner.set_lean(lean)
        engine.runner.capture()


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def step_logits(engine: DecodeEngine, lean: bool, pos: int) -> torch.Tensor:
    use_lean(engine, lean)
    with torch.inference_mode():
        return engine.runner.forward(torch.tensor([424], device=DEV), pos).clone()


def decode(engine: DecodeEngine, ctx: int, tokens: int, repeats: int = 2, chain: bool = True) -> tuple[float, list[int]]:
    """tok/s of `tokens` greedy tokens after the first; chain: the greedy chain (decode/chain.py, the default
    path) or the per-token loop (one host sync per token before the next step is launched)."""
    best, ids = 0.0, []
    engine.greedy_chain = chain
    for _ in range(repeats):
        engine.cached_tokens = ctx  # the cache rows [0, ctx) hold random K/V: a context of ctx tokens
        gen = engine.generate(424, ctx, SamplingParams(max_tokens=tokens + 1, ignore_eos=True, speculative=False))
        next(gen)
        t0 = time.perf_counter()
        out = list(gen)
        rate = len(out) / (time.perf_counter() - t0)
        if rate > best:
            best, ids = rate, gen.token_ids
    engine.greedy_chain = True
    return best, ids


def replay_ms(engine: DecodeEngine, ctx: int, reps: int = 50) -> float:
    tok = torch.tensor([424], device=DEV)
    with torch.inference_mode():
        for _ in range(3):
            engine.runner.forward(tok, ctx)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            engine.runner.forward(tok, ctx)
        sync()
    return 1e3 * (time.perf_counter() - t0) / reps


def greedy_replay_ms(engine: DecodeEngine, ctx: int, mode: str, reps: int = 50) -> float:
    """The greedy chain's device work: its graph replayed `reps` times from `ctx`, one step queued ahead of the
    host, with after each step: nothing (`none`), an event (`event`), the token's copy to a pinned slot and an
    event (`copy`: what GreedyChain queues today), or nothing in the stream and the host reading each step's
    token from the lean step's mapped ring (`ring`, models/lean.py) before it queues the next but one."""
    runner = engine.runner
    lean = runner._lean
    host = torch.empty(1, dtype=torch.long, pin_memory=True)
    ev = torch.cuda.Event()
    with torch.inference_mode():
        runner.start_greedy(424, ctx)
        for i in range(3):
            runner.greedy_step(ctx + i)
        sync()
        runner.start_greedy(424, ctx)
        seq0 = int(lean.greedy_seq[0]) if lean is not None else 0
        t0 = time.perf_counter()
        if mode == "ring":
            runner.greedy_step(ctx)
            for i in range(reps):
                if i + 1 < reps:
                    runner.greedy_step(ctx + i + 1)
                want = (seq0 + i + 1) & 0x7FFFFFFF
                slot = (seq0 + i + 1) % lean.RING
                while fused.ring_entry(int(lean.token_ring[slot]))[0] != want:
                    pass
        else:
            for i in range(reps):
                tok = runner.greedy_step(ctx + i)
                if mode == "copy":
                    host.copy_(tok, non_blocking=True)
                if mode in ("copy", "event"):
                    ev.record()
        sync()
    return 1e3 * (time.perf_counter() - t0) / reps


def profile_lean(shape: str, engine: DecodeEngine, ctx: int, greedy: bool = False) -> None:
    from torch.profiler import ProfilerActivity, profile

    use_lean(engine, True)
    tok = torch.tensor([424], device=DEV)
    reps = 10

    def step():
        if greedy:  # the greedy chain's graph, from the same position each time
            engine.runner.start_greedy(424, ctx)
            engine.runner.greedy_step(ctx)
        else:
            engine.runner.forward(tok, ctx)

    with torch.inference_mode():
        step()
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                step()
            sync()
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dev_us:
            rows.append((e.key[:60], e.count // reps, dev_us / reps))
    rows.sort(key=lambda r: -r[2])
    emit("profile", shape=shape, context=ctx, step="lean-greedy" if greedy else "lean", kernel_us_per_step=round(sum(r[2] for r in rows), 1),
         kernels_per_step=sum(r[1] for r in rows),
         top=[{"kernel": k, "per_step": c, "us_per_step": round(us, 1)} for k, c, us in rows[:12]])


def attention_alone(shape: str, engine: DecodeEngine, ctx: int) -> None:
    cfg = engine.config
    q = torch.randn(1, cfg.num_heads, cfg.head_dim, device=DEV).to(torch.bfloat16)
    kc, vc = engine.cache.k_layers[0], engine.cache.v_layers[0]
    start = torch.tensor([ctx], device=DEV)
    if args.smoke_cpu:
        return
    us = 1e3 * triton.testing.do_bench(lambda: split_kv_attention(q, kc, vc, start, cfg.head_dim ** -0.5),
                                       warmup=5, rep=30, return_mode="median")
    live = 2 * (ctx + 1) * cfg.num_kv_heads * cfg.head_dim * 2
    emit("attention", shape=shape, context=ctx, us=round(us, 2), live_kv_mb=round(live / 1e6, 2),
         gb_per_s=round(live / us / 1e3, 1))


def run_shape(shape: str, contexts: list[int], bw: float) -> None:
    t0 = time.time()
    model = make_model(shape, DEV)
    max_seq = max(contexts) + args.tokens + 64
    engine = DecodeEngine(model, model.config, dtype=torch.bfloat16, device=DEV, max_seq_len=max_seq,
                          attention="split", cuda_graph=DEV.type == "cuda", speculation=None)
    with torch.no_grad():
        engine.cache.k.normal_()
        engine.cache.v.normal_()
    assert engine.runner.lean or args.smoke_cpu, "the lean step should be the default here"
    steps = ("lean", "graph")
    try:
        engine.warmup()  # tunes the fused kernels' block shapes, captures the lean T = 1 graph
    except Exception as e:  # say so, and still measure the PyTorch step
        import traceback
        traceback.print_exc()
        emit("lean_failed", shape=shape, error=repr(e)[:2000])
        engine.runner.set_lean(False)
        engine.warmup()
        steps = ("graph",)
    wbytes, kv_tok = engine.weight_bytes(), engine.geometry.token_bytes()
    emit("shape", shape=shape, weight_gb=wbytes / 1e9, kv_bytes_per_token=kv_tok, max_seq_len=max_seq,
         build_and_warmup_s=round(time.time() - t0, 1), step=engine.runner.mode.value)
    for entry in fused.TUNING_LOG:
        emit("tuning", shape=shape, **entry)
    fused.TUNING_LOG.clear()
    if "lean" in steps:
        try:
            check_kernels(shape, engine)
            lean_l = step_logits(engine, True, contexts[0])
            graph_l = step_logits(engine, False, contexts[0])
            top2 = graph_l[0].topk(2).values
            emit("step_check", shape=shape, context=contexts[0], rel_logits=rel(lean_l, graph_l),
                 argmax_equal=int(lean_l.argmax()) == int(graph_l.argmax()),
                 graph_top2_margin=float(top2[0] - top2[1]))
        except Exception as e:
            import traceback
            traceback.print_exc()
            emit("check_failed", shape=shape, error=repr(e)[:2000])
    with torch.no_grad():
        engine.cache.k.normal_()  # rows written by warmup and the checks: random again
        engine.cache.v.normal_()
    tokens: dict[tuple[str, int], list[int]] = {}
    for step in steps:
        use_lean(engine, step == "lean")
        for ctx in contexts:
            if late(f"{shape} {step} context {ctx}"):
                break
            rate, ids = decode(engine, ctx, args.tokens)
            loop_rate, loop_ids = decode(engine, ctx, args.tokens, chain=False)
            tokens[step, ctx] = ids
            ms = replay_ms(engine, ctx)
            greedy = ({m: greedy_replay_ms(engine, ctx, m) for m in ("none", "event", "copy", "ring")}
                      if DEV.type == "cuda" and step == "lean" else {})
            bound = bw / (wbytes + kv_tok * (ctx + args.tokens / 2))
            emit("decode", shape=shape, step=step, mode=engine.runner.mode.value, context=ctx, tok_per_s=rate,
                 greedy_replay_ms=greedy,
                 loop_tok_per_s=loop_rate, chain_equals_loop=ids == loop_ids,
                 replay_ms=ms, replay_tok_per_s=1e3 / ms, bound_tok_per_s=bound, of_bound=rate / bound,
                 loop_of_bound=loop_rate / bound, replay_of_bound=1e3 / ms / bound)
    for ctx in contexts:
        a, b = tokens.get(("lean", ctx)), tokens.get(("graph", ctx))
        if a and b:
            prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            emit("greedy_compare", shape=shape, context=ctx, tokens=len(a), identical=a == b, common_prefix=prefix,
                 equal_positions=sum(x == y for x, y in zip(a, b)))
    if "lean" in steps:  # before the profile: CUPTI, once on, slows the kernels timed after it
        for variant in filter(None, args.pdl_ab.split("/")):
            label, kinds = variant.split("=", 1)
            if not late(f"{shape} PDL {label}"):
                pdl_variant(shape, engine, contexts, bw, tokens, label, kinds)
    if not late(f"{shape} attention alone"):
        for ctx in contexts:
            attention_alone(shape, engine, ctx)
    if not late(f"{shape} profile"):
        try:
            profile_lean(shape, engine, contexts[0])
            profile_lean(shape, engine, contexts[0], greedy=True)
        except Exception as e:  # the profile is a diagnosis, not a result: say it failed and go on
            emit("profile_failed", shape=shape, error=repr(e)[:300])
    del engine, model
    torch.cuda.empty_cache()


def recapture_lean(engine: DecodeEngine) -> None:
    if args.smoke_cpu:  # no lean step on CPU (use_lean says why)
        return
    engine.runner.set_lean(False)  # drops the lean graphs
    engine.runner.set_lean(True)
    engine.runner.capture()  # the first warm-up run picks block shapes for the launch mode now in force


def pdl_variant(shape: str, engine: DecodeEngine, contexts: list[int], bw: float, tokens: dict, label: str,
                kinds: str) -> None:
    """The lean step launched with other PDL kinds (block shapes picked again where the GEMVs' launch mode
    changed), against the default run above."""
    wbytes, kv_tok = engine.weight_bytes(), engine.geometry.token_bytes()
    default = pdl.pdl_kinds()
    pdl.set_pdl(kinds)
    emit("pdl_variant", shape=shape, label=label, kinds=sorted(pdl.pdl_kinds()))
    try:
        recapture_lean(engine)
        for entry in fused.TUNING_LOG:
            emit("tuning", shape=shape, pdl=label, **entry)
        fused.TUNING_LOG.clear()
        for ctx in contexts:
            if late(f"{shape} PDL off context {ctx}"):
                break
            rate, ids = decode(engine, ctx, args.tokens)
            ms = replay_ms(engine, ctx)
            bound = bw / (wbytes + kv_tok * (ctx + args.tokens / 2))
            ref = tokens.get(("lean", ctx)) or []
            prefix = next((i for i, (x, y) in enumerate(zip(ids, ref)) if x != y), min(len(ids), len(ref)))
            emit("decode", shape=shape, step=f"lean-pdl-{label}", mode=engine.runner.mode.value, context=ctx,
                 tok_per_s=rate, replay_ms=ms, replay_tok_per_s=1e3 / ms, bound_tok_per_s=bound,
                 of_bound=rate / bound, replay_of_bound=1e3 / ms / bound, common_prefix_with_pdl=prefix)
    finally:
        pdl.set_pdl(default)
        recapture_lean(engine)


def compiled_step(shape: str, contexts: list[int], bw: float) -> None:
    t0 = time.time()
    model = make_model(shape, DEV)
    engine = DecodeEngine(model, model.config, dtype=torch.bfloat16, device=DEV,
                          max_seq_len=max(contexts) + args.tokens + 64, attention="split", cuda_graph=True,
                          compile=True, speculation=None)
    engine.runner.set_lean(False)
    with torch.no_grad():
        engine.cache.k.normal_()
        engine.cache.v.normal_()
    engine.warmup()
    emit("shape", shape=shape, step=engine.runner.mode.value, build_and_warmup_s=round(time.time() - t0, 1))
    wbytes, kv_tok = engine.weight_bytes(), engine.geometry.token_bytes()
    for ctx in contexts:
        if late(f"{shape} compiled context {ctx}"):
            break
        rate, _ = decode(engine, ctx, args.tokens)
        ms = replay_ms(engine, ctx)
        bound = bw / (wbytes + kv_tok * (ctx + args.tokens / 2))
        emit("decode", shape=shape, step="compiled-graph", mode=engine.runner.mode.value, context=ctx,
             tok_per_s=rate, replay_ms=ms, bound_tok_per_s=bound, of_bound=rate / bound,
             replay_of_bound=1e3 / ms / bound)


def main() -> None:
    smi = args.smoke_cpu or subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    emit("env", argv=sys.argv[1:], date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), gpu=smi,
         torch=torch.__version__, triton=triton.__version__, python=sys.version.split()[0],
         commit=open("GIT_HEAD").read().strip() if os.path.exists("GIT_HEAD") else None)
    bw = max(copy_bandwidth(DEV) for _ in range(1 if args.smoke_cpu else 3))
    emit("copy_bandwidth", gb_per_s=bw / 1e9)
    emit("pdl", kinds=sorted(pdl.pdl_kinds()), on=pdl.use_pdl(DEV), unsupported_reason=pdl.pdl_unsupported_reason(DEV))
    contexts = [int(c) for c in args.contexts.split(",")]
    for shape in args.shapes.split(","):
        if late(f"shape {shape}"):
            continue
        try:
            run_shape(shape, contexts, bw)
        except Exception as e:
            emit("failed", shape=shape, error=repr(e)[:2000])
            import traceback
            traceback.print_exc()
            torch.cuda.empty_cache()
    if args.pytest and not late("pytest"):
        # The GPU tests that run through the lean step (the server-flag test needs starlette, absent there).
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                               "-k", "not server_flag", "tests/unit/engine/test_fused_kernels.py",
                               "tests/unit/engine/test_cuda_graph.py", "tests/unit/engine/test_gpu_speculative.py",
                               "tests/unit/engine/test_greedy_chain.py"],
                              capture_output=True, text=True,
                              timeout=max(10, args.deadline_s + 60 - (time.time() - T0)))
        emit("pytest", rc=proc.returncode, tail=proc.stdout[-1500:])
    if args.compiled and not late("compiled 1B"):
        compiled_step("llama-1b", contexts, bw)
    emit("done")


main()
