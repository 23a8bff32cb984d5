#!/usr/bin/env python3
"""Both lanes side by side on ONE GPU, started by the product's own launch scripts, measured by the product's bench.

    PYTHONPATH=/tmp/site:$PWD/engine/src:$PWD/router/src \\
      python3 scripts/gpu_stack.py --shapes llama-8b,llama-1b --models /tmp/models --out $OUT [--deadline-s 560]
    python3 scripts/gpu_stack.py --dry-run ...      # print every service's command line and environment, start nothing

Per shape (a random bf16 checkpoint from scripts/gpu_make_shape_model.py, written if missing): scripts/launch/*.sh
through dev_stack.DevStack start stock vLLM prefill (MultiConnector[NixlConnector, ExpressLaneConnector], staging
in VRAM), stock vLLM native decode (NixlConnector, kv_buffer_device cuda), our express node (CUDA, receive buffer in
VRAM) and the router, the GPU's memory split by flags (vLLM: a fixed KV cache each, --kv-cache-memory-bytes, so the
servers can start at once; the express node takes what its weights, KV cache and buffers need). Then:
  1. the cross-lane greedy check: one token-id prompt per length through the router's express alias, its native
     alias and the prefill alone; token ids compared, the first divergence reported with vLLM's top-2 logprob
     margin there (bf16 kernels differ between engines; a flip on a near-tie is reported, not hidden);
  2. scripts/bench.py, lanes express + native through its bench router (express requests queue, never spill),
     concurrency 1/2/4, prompts 1k/8k tokens unique per request, 256 output tokens.
Everything is bounded by --deadline-s (a shape that no longer fits is skipped and said so; the bench is stopped
with SIGTERM and keeps its partial report). $OUT gets at most 8 files (the device tool's limit): summary.md,
summary.json, greedy.json, <shape>-bench.json / .png per shape, logs.tar.xz.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib.client import token_prompt  # noqa: E402
from dev_stack import LAUNCH, SERVICES, DevStack, StackError  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# Per shape: seconds it needs at least (stack start + greedy + a short bench), and the GPU memory split.
# vLLM: 0.25 of the GPU is only checked as free at start; the KV cache is fixed (8B: 128 KiB/token, so 10 GiB
# holds 80k tokens: 4 users x 8.4k with room). The express node's KV cache is its max_seq_len (one user).
SHAPES = {
    "llama-8b": {"min_s": 240, "vllm_args": "--gpu-memory-utilization 0.25", "kv": "10G"},
    "llama-1b": {"min_s": 150, "vllm_args": "--gpu-memory-utilization 0.15", "kv": "4G"},
    "tiny": {"min_s": 300, "vllm_args": "", "kv": None},  # --device cpu only: scripts/make_tiny_model.py's model
}
GREEDY_LANES = ("express", "native", "prefill")


def log(msg: str) -> None:
    print(f"[gpu_stack {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ShapeStack(DevStack):
    """DevStack over a checkpoint this script provides: never writes the tiny model into it."""

    def ensure_model(self) -> None:
        if not (self.model_dir / "config.json").exists() or not (self.model_dir / "tokenizer.json").exists():
            raise StackError(f"{self.model_dir}: no checkpoint with tokenizer (scripts/gpu_make_shape_model.py)")


def stack_env(shape: str, args: argparse.Namespace) -> dict[str, str]:
    """The environment the launch scripts read (scripts/launch/common.sh and each script's header)."""
    if args.device == "cpu":  # the same script on the CPU dev stack (tiny model): a check of this script itself
        return {"SERVED_MODEL_NAME": shape, "VLLM_TOOL_CALL_PARSER": "", "EXPRESS_COMPILE": "0",
                "EXPRESS_SPECULATION": args.express_speculation}
    base = f"{SHAPES[shape]['vllm_args']} --max-num-seqs {args.max_num_seqs}"

    def vllm_args(kv: str | None) -> str:
        kv = kv or SHAPES[shape]["kv"]
        return f"{base} --kv-cache-memory-bytes {kv}" if kv else base

    return {
        "SERVED_MODEL_NAME": shape,
        "DTYPE": "bfloat16",
        "MAX_MODEL_LEN": str(args.max_model_len),
        "MAX_NUM_BATCHED_TOKENS": str(args.max_num_batched_tokens),
        "KV_BUFFER_DEVICE": "cuda",
        "PREFILL_EXTRA_ARGS": vllm_args(args.prefill_kv_cache),
        "DECODE_NATIVE_EXTRA_ARGS": vllm_args(args.native_kv_cache),
        "EXPRESS_STAGING_DEVICE": "device",
        "EXPRESS_DEVICE": "cuda",
        "EXPRESS_COMPILE": "1" if args.express_compile else "0",
        "EXPRESS_SPECULATION": args.express_speculation,
        "EXPRESS_SEATS": str(args.express_seats),  # explicit: the GPU is shared with the two vLLM servers
        "VLLM_TOOL_CALL_PARSER": "",            # the shape checkpoints have no tool-call tokens
        "VLLM_USE_FLASHINFER_SAMPLER": "0",     # flashinfer is not carried (scripts/gpu_carry.py)
        "EXPRESS_KV_TIMEOUT_S": "120",
        **native_transport_env(args),
    }


# The native lane's KV handoff on one GPU. vLLM's NixlConnector pulls: the native decode READs the blocks from the
# prefill's VRAM (NIXL READ = a UCX GET). UCX runs a GET over CUDA IPC only where it detects active NVLinks
# (UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto); elsewhere the GET goes over TCP through host memory, ~0.4-0.5 GB/s (vLLM issue
# 52607; NIXL's UCX plugin turns it on from its PR 2208). That matches the 0.3 s (1k) to 2.7 s (8k) handoffs of the
# 8B (128 KiB/token) in docs/performance.md, where UCX was left to choose. `cuda-ipc` (the default) asks for GET
# zero-copy over CUDA IPC on every service and logs each transfer's protocol choice (UCX_PROTO_INFO) so the logs
# show which transport carried it; `ucx-default` is the earlier runs' setting (nothing set).
NATIVE_TRANSPORTS = {
    "cuda-ipc": {"UCX_TLS": "cuda_ipc,cuda_copy,sm,self,tcp", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on",
                 "UCX_PROTO_INFO": "y"},
    "ucx-default": {},
}


def native_transport_env(args: argparse.Namespace) -> dict[str, str]:
    """UCX settings for every service (both ends of a NIXL transfer read them); --ucx-tls replaces UCX_TLS."""
    env = dict(NATIVE_TRANSPORTS[args.native_transport])
    if args.ucx_tls:
        env["UCX_TLS"] = args.ucx_tls
    return env


def dry_run(shapes: list[str], args: argparse.Namespace) -> int:
    """Run every launcher with PYTHON pointing at a recorder that prints the command line it was given."""
    with tempfile.TemporaryDirectory() as tmp:
        recorder = Path(tmp) / "python"
        recorder.write_text(f"#!{sys.executable}\nimport shlex, sys\nprint(shlex.join(['python3', *sys.argv[1:]]))\n")
        recorder.chmod(0o755)
        for shape in shapes:
            stack = ShapeStack(model_dir=args.models / shape, state_dir=Path(tmp) / shape, port_base=args.port_base,
                               python=str(recorder), extra_env=stack_env(shape, args))
            env = stack.env()
            print(f"## {shape}: environment set by gpu_stack.py")
            for k, v in sorted(stack_env(shape, args).items()):
                print(f"  {k}={shlex.quote(v)}")
            for name, (launcher, _, _) in SERVICES.items():
                out = subprocess.run(["bash", str(LAUNCH / launcher)], env=env, capture_output=True, text=True,
                                     timeout=30)
                if out.returncode:
                    raise SystemExit(f"{launcher} failed: {out.stderr}")
                # The server's command line is the last one a launcher runs (decode-express.sh checks the
                # checkpoint with a short python -c first).
                print(f"## {shape} {name}: {out.stdout.strip().splitlines()[-1]}")
            print(f"## {shape} bench: {shlex.join(bench_cmd(shape, args, Path('/tmp/gpu-stack') / shape / 'bench'))}")
    return 0


def bench_cmd(shape: str, args: argparse.Namespace, out: Path) -> list[str]:
    return [sys.executable, str(REPO / "scripts" / "bench.py"), "--port-base", str(args.port_base), "--model-dir",
            str(args.models / shape), "--served-model", shape, "--lanes", "express,native",
            "--concurrency", args.concurrency, "--prompts", args.prompts, "--output-tokens", str(args.output_tokens),
            "--skip-overheads", "--out", str(out)]


def preflight() -> dict:
    """Versions, the GPU, NIXL's agent API, and vLLM's connector factory finding our connector by module path."""
    code = r"""
import json, torch, vllm, nixl
from nixl._api import nixl_agent
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
cfg = KVTransferConfig(kv_connector="ExpressLaneConnector", kv_connector_module_path="expresslane.engine.connector",
                       kv_role="kv_producer")
cls = KVConnectorFactory.get_connector_class(cfg)
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "vllm": vllm.__version__,
                  "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                  "nixl_agent": nixl_agent.__module__, "connector": f"{cls.__module__}.{cls.__name__}",
                  "connector_by_name": KVConnectorFactory.get_connector_class_by_name("ExpressLaneConnector").__name__}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    if proc.returncode:
        raise SystemExit(f"preflight failed (imports):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def gpu_memory() -> dict:
    if shutil.which("nvidia-smi") is None:
        return {}
    q = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True)
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                           "--format=csv,noheader,nounits"], capture_output=True, text=True)
    return {"gpu_mib": q.stdout.strip(), "processes_mib": apps.stdout.strip().splitlines()}


def greedy_check(stack: DevStack, shape: str, prompts: list[int], output: int, vocab: int) -> list[dict]:
    """Each prompt through the router's express alias, its native alias and the prefill alone (greedy, token ids).
    vLLM's paths also return their top-2 logprobs, whose gap is the margin where the lanes part."""
    rows = []
    with httpx.Client(timeout=httpx.Timeout(300, connect=10), trust_env=False) as client:
        for p in prompts:
            prompt = token_prompt(p, f"greedy/{shape}/{p}", vocab)
            body = {"prompt": prompt, "max_tokens": output, "temperature": 0.0, "ignore_eos": True,
                    "return_token_ids": True}
            row: dict = {"prompt_tokens": p, "lanes": {}}
            for lane, url, model, logprobs in (
                    ("express", stack.router_url, stack.aliases[1], False),  # compose/config/router.yaml's
                    ("native", stack.router_url, stack.aliases[0], True),  # aliases: the served name
                    ("prefill", stack.prefill_url, shape, True)):
                t0 = time.perf_counter()
                r = client.post(url + "/v1/completions",
                                json={**body, "model": model, **({"logprobs": 2} if logprobs else {})})
                rec: dict = {"status": r.status_code, "s": round(time.perf_counter() - t0, 3),
                             "served_by": r.headers.get("x-expresslane-lane")}
                if r.status_code == 200:
                    choice = r.json()["choices"][0]
                    rec["token_ids"] = choice.get("token_ids")
                    top = (choice.get("logprobs") or {}).get("top_logprobs")
                    if top:
                        rec["top2_margin"] = [round(_margin(t), 4) for t in top]
                else:
                    rec["error"] = r.text[:500]
                row["lanes"][lane] = rec
            row["compare"] = {f"{a}_vs_{b}": _compare(row["lanes"][a], row["lanes"][b])
                              for a, b in (("express", "prefill"), ("native", "prefill"), ("express", "native"))}
            rows.append(row)
            log(f"greedy {shape} {p}: " + "; ".join(f"{k} {v['verdict']}" for k, v in row["compare"].items()))
    return rows


def _margin(top: dict) -> float:
    vals = sorted(top.values(), reverse=True)
    return vals[0] - vals[1] if len(vals) > 1 else float("inf")


def _compare(a: dict, b: dict) -> dict:
    ta, tb = a.get("token_ids"), b.get("token_ids")
    if not ta or not tb:
        return {"verdict": "missing", "detail": "a lane returned no token ids"}
    if ta == tb:
        return {"verdict": "identical", "tokens": len(ta)}
    i = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
    out = {"verdict": "diverges", "first_divergence": i, "tokens": [len(ta), len(tb)],
           "a_token": ta[i] if i < len(ta) else None, "b_token": tb[i] if i < len(tb) else None}
    for side, rec in (("a", a), ("b", b)):
        margins, ids = rec.get("top2_margin"), rec.get("token_ids")
        if margins and len(margins) == len(ids) and i < len(margins):  # one logprob entry per token, aligned
            out[f"{side}_top2_logprob_margin"] = margins[i]
        elif margins:
            out[f"{side}_top2_logprob_margin"] = f"{len(margins)} logprob entries for {len(ids)} tokens: not aligned"
    return out


def run_shape(shape: str, args: argparse.Namespace, deadline: float, work: Path, summary: dict) -> None:
    left = deadline - time.monotonic()
    if left < SHAPES[shape]["min_s"]:
        summary["shapes"][shape] = {"skipped": f"{left:.0f} s left, needs {SHAPES[shape]['min_s']} s"}
        log(f"{shape}: skipped ({left:.0f} s left)")
        return
    rec: dict = summary["shapes"].setdefault(shape, {})
    model_dir = args.models / shape
    if not (model_dir / "tokenizer.json").exists():
        t0 = time.monotonic()
        make = ([str(REPO / "scripts" / "make_tiny_model.py"), str(model_dir)] if shape == "tiny" else
                [str(REPO / "scripts" / "gpu_make_shape_model.py"), shape, str(model_dir)])
        subprocess.run([sys.executable, *make], check=True, timeout=max(30, deadline - time.monotonic() - 60))
        rec["checkpoint_s"] = round(time.monotonic() - t0, 1)
    stack = ShapeStack(model_dir=model_dir, state_dir=work / shape / "stack", python=sys.executable,
                       port_base=args.port_base,
                       extra_env=stack_env(shape, args),
                       start_timeout_s=max(60.0, min(args.start_timeout_s, deadline - time.monotonic() - 90)))
    rec["env"] = stack_env(shape, args)
    t0 = time.monotonic()
    try:
        log(f"{shape}: starting prefill, decode-native, decode-express, router")
        stack.start()
        rec["stack_start_s"] = round(time.monotonic() - t0, 1)
        rec["gpu_memory_after_start"] = gpu_memory()
        log(f"{shape}: stack up in {rec['stack_start_s']} s; GPU memory used, total (MiB): "
            f"{rec['gpu_memory_after_start'].get('gpu_mib')}")
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        prompts = [int(x) for x in args.prompts.split(",")]
        try:
            rec["greedy"] = greedy_check(stack, shape, prompts, args.output_tokens, vocab)
        except (httpx.HTTPError, KeyError, ValueError) as e:
            rec["greedy"] = {"error": f"{type(e).__name__}: {e}"}
            log(f"{shape}: greedy check failed: {e}")
        budget = deadline - time.monotonic() - 20
        out = work / shape / "bench"
        cmd = bench_cmd(shape, args, out)
        rec["bench_command"] = shlex.join(cmd)
        log(f"{shape}: bench ({budget:.0f} s left): {rec['bench_command']}")
        t1 = time.monotonic()
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            rec["bench_rc"] = proc.wait(timeout=max(10.0, budget))
        except KeyboardInterrupt:  # this script was stopped: so is the bench (it keeps its partial report)
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
            raise
        except subprocess.TimeoutExpired:
            log(f"{shape}: bench out of time: SIGTERM (it keeps its partial report)")
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                rec["bench_rc"] = proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rec["bench_rc"] = proc.wait()
            rec["bench_stopped_at_deadline"] = True
        rec["bench_s"] = round(time.monotonic() - t1, 1)
        for src, dst in (("bench.json", f"{shape}-bench.json"), ("bench.png", f"{shape}-bench.png")):
            if (out / src).exists():
                shutil.copy(out / src, args.out / dst)
        if (out / "bench.md").exists():
            rec["bench_md"] = (out / "bench.md").read_text()
    except StackError as e:
        rec["error"] = str(e)[:1500] + ("\n...\n" + str(e)[-4500:] if len(str(e)) > 6000 else str(e)[1500:])
        log(f"{shape}: the stack did not come up: {str(e)[-2000:]}")
    finally:
        stack.stop()


def write_outputs(args: argparse.Namespace, work: Path, summary: dict) -> None:
    greedy = {s: r.get("greedy") for s, r in summary["shapes"].items() if r.get("greedy") is not None}
    (args.out / "greedy.json").write_text(json.dumps(greedy, indent=1) + "\n")
    lean = {**summary, "shapes": {s: {k: v for k, v in r.items() if k not in ("greedy", "bench_md")}
                                  for s, r in summary["shapes"].items()}}
    (args.out / "summary.json").write_text(json.dumps(lean, indent=1) + "\n")
    md = [f"# gpu_stack {summary['started_at']}", "", "```", json.dumps(summary.get("preflight"), indent=1), "```"]
    for shape, r in summary["shapes"].items():
        md += ["", f"## {shape}", ""]
        for key in ("skipped", "error", "stack_start_s", "bench_s", "bench_rc", "bench_stopped_at_deadline"):
            if key in r:
                md.append(f"- {key}: {r[key]}")
        for g in r.get("greedy") or []:
            if isinstance(g, dict) and "compare" in g:
                md.append(f"- greedy {g['prompt_tokens']}: " + "; ".join(
                    f"{k} {v['verdict']}" + (f" at {v['first_divergence']}" if "first_divergence" in v else "")
                    for k, v in g["compare"].items()))
        md += ["", r.get("bench_md", "")]
    (args.out / "summary.md").write_text("\n".join(md) + "\n")
    with tarfile.open(args.out / "logs.tar.xz", "w:xz") as tar:
        for log_file in sorted(work.rglob("*.log")):
            data = log_file.read_bytes()[-(2 << 20):]  # the last 2 MB of each
            info = tarfile.TarInfo(str(log_file.relative_to(work)))
            info.size = len(data)
            tar.addfile(info, fileobj=io.BytesIO(data))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-8b,llama-1b", help=f"in order, from {list(SHAPES)}")
    ap.add_argument("--models", type=Path, default=Path("/tmp/models"), help="checkpoint directory per shape")
    ap.add_argument("--out", type=Path, required=True, help="at most 8 files are written here")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-stack"), help="logs and bench artifacts")
    ap.add_argument("--deadline-s", type=float, default=560.0, help="all work ends by then (device call: 600 s)")
    ap.add_argument("--deadline-epoch", type=float, help="all work ends by this Unix time (wins over --deadline-s)")
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--prompts", default="1024,8192")
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=8448, help="prompt 8192 + 256 output")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=8, help="vLLM servers: bounds CUDA-graph capture too")
    ap.add_argument("--express-seats", type=int, default=4, help="users the express node decodes at once")
    # An H100 (79 GiB) at 8B holds three 15 GiB copies of the weights: the express node with 4 seats takes ~25.5 GiB
    # (each seat's KV cache and its receive region, 2 x 1.1 GiB at max_model_len 8448), each vLLM server ~17.5 GiB
    # plus its KV cache, so 10G + 10G runs out (2026-12-07); 6G (prefill: prompts held until the handoff) + 9G
    # (native decode: 8 users x 8.4k tokens at 128 KiB) fits.
    ap.add_argument("--prefill-kv-cache", default=None, help="the prefill's --kv-cache-memory-bytes (default: the "
                                                               "shape's, 8B 10G, 1B 4G)")
    ap.add_argument("--native-kv-cache", default=None, help="the native decode's --kv-cache-memory-bytes (default: "
                                                              "the shape's)")
    ap.add_argument("--express-speculation", choices=["on", "off"], default="off",
                    help="off: the headline target is without speculation (random weights rarely repeat)")
    ap.add_argument("--no-express-compile", dest="express_compile", action="store_false")
    ap.add_argument("--native-transport", choices=list(NATIVE_TRANSPORTS), default="cuda-ipc",
                    help="the native lane's KV handoff: cuda-ipc (UCX GET zero-copy over CUDA IPC, see "
                         "NATIVE_TRANSPORTS) or ucx-default (nothing set: the earlier runs)")
    ap.add_argument("--ucx-tls", default="", help="UCX_TLS for every service, replacing --native-transport's "
                    "(the handoff probe measured cuda_ipc VRAM -> VRAM: docs/bench/2026-12-01-vram-handoff/)")
    ap.add_argument("--start-timeout-s", type=float, default=420.0, help="the services must be healthy by then")
    ap.add_argument("--port-base", type=int, default=0, help="added to every default port (dev_stack.py)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the CPU dev stack's settings with --shapes tiny (checks this script, not a GPU)")
    ap.add_argument("--dry-run", action="store_true", help="print the command lines; start nothing")
    args = ap.parse_args(argv)
    bad = [s for s in args.shapes.split(",") if s not in SHAPES or (s == "tiny") != (args.device == "cpu")]
    if bad:
        ap.error(f"shapes {bad} do not fit --device {args.device}: cuda takes {list(SHAPES)[:-1]}, cpu takes tiny")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shapes = args.shapes.split(",")
    if args.dry_run:
        return dry_run(shapes, args)
    deadline = time.monotonic() + (args.deadline_epoch - time.time() if args.deadline_epoch else args.deadline_s)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    summary: dict = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "shapes": {},
                     "argv": sys.argv}
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt("SIGTERM")))
    try:
        summary["preflight"] = preflight()
        log(f"preflight: {summary['preflight']}")
        for shape in shapes:
            run_shape(shape, args, deadline, args.work, summary)
    except KeyboardInterrupt as e:
        summary["interrupted"] = str(e)
    finally:
        write_outputs(args, args.work, summary)
        log(f"wrote {sorted(p.name for p in args.out.iterdir())}")
    ok = "interrupted" not in summary and all("error" not in r and "skipped" not in r and r.get("bench_rc") == 0
                                              for r in summary["shapes"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
