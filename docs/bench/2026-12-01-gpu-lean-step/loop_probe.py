"""gpu_loop_probe.py at 1k / 8k / 32k (max_seq_len 33,088, random K/V): engine.generate (best of 3) vs the lean
graph's replay alone (docs/bench/2026-12-01-gpu-lean-step/run5-loop-probe.txt).  PYTHONPATH=engine/src python3 docs/bench/2026-12-01-gpu-lean-step/loop_probe.py OUT"""
import json, os, sys, time, torch
sys.argv = [sys.argv[0], "--out", sys.argv[1]]
import importlib.util
spec = importlib.util.spec_from_file_location("gl", "docs/bench/2026-12-01-gpu-lean-step/gpu_lean.py")
src = open("docs/bench/2026-12-01-gpu-lean-step/gpu_lean.py").read().replace("\nmain()\n", "\n")
g = {"__name__": "gl"}
exec(compile(src, "gpu_lean.py", "exec"), g)
from expresslane.engine.decode import DecodeEngine
for shape in ("llama-1b", "llama-8b"):
    model = g["make_model"](shape)
    e = DecodeEngine(model, model.config, dtype=torch.bfloat16, device=g["DEV"], max_seq_len=33088, attention="split", cuda_graph=True, speculation=None)
    e.warmup()
    r = e.runner
    n = 256
    with torch.no_grad():
        e.cache.k.normal_(); e.cache.v.normal_()
    for ctx in (1024, 8192, 32768):
      with torch.inference_mode():
        tok = torch.tensor([424], device="cuda")
        for mode in ():
            for rep in range(2):
                torch.cuda.synchronize(); t0 = time.perf_counter()
                for i in range(n):
                    logits = r.forward(tok, ctx + i)
                    nxt = logits[-1].argmax()
                    if mode == "argmax_item":
                        tok = torch.tensor([int(nxt.item())], device="cuda")
                    else:
                        tok = nxt.view(1)
                torch.cuda.synchronize(); dt = time.perf_counter() - t0
            g["emit"]("loop_probe", shape=shape, loop=mode, tok_per_s=n / dt, ms_per_token=1e3 * dt / n)
        rate, _ = g["decode"](e, ctx, n, repeats=3)
        g["emit"]("loop_probe", shape=shape, context=ctx, loop="engine.generate", tok_per_s=rate, ms_per_token=1e3 / rate)
        g["emit"]("loop_probe", shape=shape, context=ctx, loop="graph replay only", ms_per_token=g["replay_ms"](e, ctx))
    del e, model, r; torch.cuda.empty_cache()
