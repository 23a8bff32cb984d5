"""Profile the express engine's T=1 step at a given context on CPU (the stack's tiny model, float32)."""
import sys, time, torch
from expresslane.engine.decode.engine import DecodeEngine
from torch.profiler import profile, ProfilerActivity
import os
from expresslane.engine.models import attention as A
if os.environ.get("KSRC"):
    A._NATIVE_SRC = open(os.environ["KSRC"]).read()

model, ctx, compile_ = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
torch.set_num_threads(1)
eng = DecodeEngine.from_pretrained(model, dtype="float32", device="cpu", max_seq_len=4096, compile=compile_)
eng.warmup()
g = torch.Generator().manual_seed(0)
prompt = torch.randint(0, eng.vocab_size, (ctx,), generator=g).tolist()
torch.inference_mode().__enter__()
eng.prefill(prompt)
rows = torch.arange(1)
for _ in range(20):
    eng.runner.forward(rows, ctx)
best = 1e9
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(50):
        eng.runner.forward(rows, ctx)
    best = min(best, (time.perf_counter() - t0) / 50)
print(f"ctx={ctx} compile={compile_} step_ms={best*1e3:.3f} ({1/best:.1f} tok/s)", flush=True)
with profile(activities=[ProfilerActivity.CPU]) as p:
    for _ in range(50):
        eng.runner.forward(rows, ctx)
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
