#!/usr/bin/env python3
"""The express lane's KV handoff between two real processes on one device, and injection from the receive buffer.

    python docs/bench/2026-12-01-vram-handoff/gpu_handoff.py [--device cuda|cpu] [--out DIR] [--deadline-s 480] [--reps 5]
                                  [--sizes llama-8b:1024,8192,32768 llama-1b:1024,32768] [--ucx-tls LIST]

Two processes (multiprocessing 'spawn'): a receiver holding the decode node's ``KVReceiver`` (its receive buffer
on the device: VRAM on cuda, registered with NIXL) and a sender holding a ``StagingPool`` + ``KVSender`` (the
prefill side). Every transfer is the production path: TCP control plane (hello, admit, accept), one-sided NIXL
WRITE staging -> receive slot, ``done`` with byte count and checksum (checked by the receiver: ``wsum16`` on the
device where a buffer is VRAM, crc32 for a DRAM pair, transfer/checksum.py), ack. Then:

* pairs: ``vram->vram`` (and ``dram->vram`` from pinned host staging) on cuda, ``dram->dram`` on cpu; per size
  the NIXL WRITE time and GB/s, the receiver's accept -> done (``transfer_s``, includes the checksum check), the
  checksum times on both sides, the send's total; p50 over ``--reps`` (a first cold transfer per size is
  reported apart: UCX wire-up / IPC handle opening). Bytes are checked exactly: the checksum path, and the
  receiver compares the landed K/V with the pattern regenerated on its own device.
* inject: a live ``DecodeEngine`` (tiny random-weight float32 Llama, scripts/make_tiny_model.py) in the receiver
  process injects the received K/V straight from the receive slot (zero-copy views of it); its greedy
  continuation must equal the same engine prefilling the prompt itself. On cuda, torch.profiler records every
  memcpy of the receive + inject window (DtoH / HtoD bytes must be ~0: no host bounce) and pinned host memory.
* refs: in one process, NIXL WRITE DRAM(pinned)->VRAM and VRAM->VRAM between two agents, and torch's own copies
  (device-to-device, pinned host-to-device).

UCX: nothing is set unless asked (``--ucx-tls`` sets UCX_TLS in both children). ``UCX_PROTO_INFO=y`` is set so
each child's log (DIR/receiver.log, DIR/sender.log) shows which transport UCX picked (cuda_ipc / cuda_copy /
posix / tcp ...); the summary prints those lines. Every wait has a bound (per step and ``--deadline-s`` for the
whole run): a stuck transfer is reported with the children's log tails, never a hang.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]  # this lab note's folder is docs/bench/<date>-<topic>/
if str(REPO / "engine" / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "engine" / "src"))

SHAPES = {  # num_layers, num_kv_heads, head_dim (bf16)
    "llama-8b": (32, 8, 128),  # 128 KiB a token; 32k tokens = 4 GiB
    "llama-1b": (16, 8, 64),   # 32 KiB a token
}
DEFAULT_SIZES = {
    "cuda": ["llama-1b:1024,32768", "llama-8b:1024,8192,32768"],
    "cpu": ["llama-1b:256", "llama-8b:256,1024"],
}
DTYPE = "bfloat16"
INJECT_PROMPT_LEN, INJECT_NEW_TOKENS = 200, 32


# ============================================================================ helpers (both sides)

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(name: str):
    """A torch.device with an index ("cuda" -> cuda:<current>, what torch.cuda.set_device needs)."""
    import torch

    d = torch.device(name)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _pattern(nbytes: int, seed: int, device):
    """The bytes a transfer carries: the same on both sides (generated on the same device type)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g)


def _nbytes(shape: str, tokens: int) -> int:
    L, H, D = SHAPES[shape]
    return 2 * L * tokens * H * D * 2


class _Timed:
    """Wraps a function and keeps (args summary, seconds) of its calls: times the checksum inside the real path."""

    def __init__(self, fn, sync_device=None) -> None:
        self.fn, self.calls, self.sync_device = fn, [], sync_device

    def __call__(self, data, algorithm="crc32"):
        t0 = time.perf_counter()
        out = self.fn(data, algorithm)
        self.calls.append({"algorithm": algorithm, "nbytes": data.numel(), "s": time.perf_counter() - t0})
        return out


def _memcpy_summary(trace_path: str) -> dict:
    """Bytes and count of every GPU memcpy / memset kind in a torch.profiler chrome trace."""
    with open(trace_path) as f:
        trace = json.load(f)
    out: dict[str, dict] = {}
    kernels = 0
    for ev in trace.get("traceEvents", []):
        cat = str(ev.get("cat", ""))
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels += 1
        if cat in ("gpu_memcpy", "gpu_memset"):
            d = out.setdefault(str(ev.get("name")), {"count": 0, "bytes": 0})
            d["count"] += 1
            d["bytes"] += int((ev.get("args") or {}).get("bytes", 0) or 0)
    return {"gpu_events": kernels, "copies": out,
            "host_bytes": sum(v["bytes"] for k, v in out.items() if "DtoH" in k or "HtoD" in k)}


def _pinned_host_bytes() -> dict | None:
    """The pinned host allocator's cumulative counters (equal before and after: no pinned block was handed out)."""
    import torch

    try:
        stats = torch.cuda.memory.host_memory_stats()
    except Exception:  # noqa: BLE001 - older torch
        return None
    keys = ("active_bytes.allocated", "active_requests.allocated", "allocated_bytes.allocated", "num_host_alloc")
    return {k: stats.get(k) for k in keys}


# ============================================================================ child processes

def _child_main(role: str, conn, log_path: str, env: dict) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)  # UCX and NIXL write to these: the log shows what they chose and why they failed
    os.environ.update(env)
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s {role} %(name)s %(message)s")
    handler = _Receiver() if role == "receiver" else _Sender()
    while True:
        if not conn.poll(3600):
            return
        cmd, kw = conn.recv()
        if cmd == "stop":
            handler.stop()
            conn.send(("ok", {}))
            return
        try:
            conn.send(("ok", getattr(handler, cmd)(**kw)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent, typed by name
            traceback.print_exc()
            conn.send(("error", {"type": type(e).__name__, "message": str(e)[:2000]}))


def _time_wsum16(seg) -> dict:
    """wsum16 of the slot with each row-sum kernel (the second call of each: triton compiles on its first),
    and whether they agree. Restores EXPRESSLANE_WSUM16_KERNEL."""
    from expresslane.engine.transfer.checksum import checksum

    kernels = ["torch"]
    if seg.device.type == "cuda":
        try:
            import triton  # noqa: F401

            kernels.append("triton")
        except ImportError:
            pass
    saved = os.environ.get("EXPRESSLANE_WSUM16_KERNEL")
    out: dict = {}
    values = {}
    try:
        for kernel in kernels:
            os.environ["EXPRESSLANE_WSUM16_KERNEL"] = kernel
            try:
                checksum(seg, "wsum16")
                t0 = time.perf_counter()
                values[kernel] = checksum(seg, "wsum16")
                out[f"wsum16_{kernel}_s"] = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - a kernel that fails here is a result, not a crash
                out[f"wsum16_{kernel}_error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        if saved is None:
            os.environ.pop("EXPRESSLANE_WSUM16_KERNEL", None)
        else:
            os.environ["EXPRESSLANE_WSUM16_KERNEL"] = saved
    out["wsum16_s"] = out.get("wsum16_torch_s")
    if len(values) > 1:
        out["wsum16_kernels_agree"] = len(set(values.values())) == 1
    return out


class _Receiver:
    """The decode node's side: one KVReceiver per shape (one slot each), and the inject engine."""

    def __init__(self) -> None:
        self.rx: dict = {}
        self.engine = None
        self.timed = None

    def setup(self, device: str, shapes: dict) -> dict:
        import torch

        from expresslane.engine.transfer import receiver as recv_mod
        from expresslane.engine.transfer.receiver import KVReceiver

        self.device = _device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.timed = _Timed(recv_mod.checksum)
        recv_mod.checksum = self.timed  # times the receiver's own verification of done.checksum
        out = {}
        for name, (layers, heads, dim, dtype, max_tokens) in shapes.items():
            rx = KVReceiver(layers, heads, dim, dtype, self.device, max_tokens, "127.0.0.1", ctrl_port=_free_port(),
                            num_slots=1, verify_checksum=True, notif_timeout_s=10.0, write_deadline_s=60.0)
            rx.start()
            self.rx[name] = rx
            out[name] = {"port": rx.ctrl_port, "region": rx._region.to_wire(), "agent": rx._endpoint.name}
        return out

    def expect(self, shape: str, rid: str, ttl_s: float) -> dict:
        self.rx[shape].expect(rid, ttl_s)
        return {}

    def wait(self, shape: str, rid: str, timeout_s: float, seed: int, gen_device: str,
             bounce_ref: bool = False) -> dict:
        import asyncio

        import torch

        from expresslane.engine.transfer.checksum import checksum

        rx = self.rx[shape]
        self.timed.calls.clear()
        got = asyncio.run(rx.wait_for(rid, timeout_s))
        try:
            raw_k = got.k.reshape(-1).view(torch.uint8)
            raw_v = got.v.reshape(-1).view(torch.uint8)
            expected = _pattern(got.nbytes, seed, gen_device).to(self.device)
            half = got.nbytes // 2
            exact = bool(torch.equal(raw_k, expected[:half]) and torch.equal(raw_v, expected[half:]))
            del expected
            out = {"transfer_s": got.transfer_s, "wire_wait_s": got.wire_wait_s, "nbytes": got.nbytes,
                   "bytes_exact": exact, "kv_device": str(got.k.device),
                   "zero_copy_view": got.k.untyped_storage().data_ptr() == rx._buffer.data_ptr(),
                   "recv_checksums": list(self.timed.calls)}
            if bounce_ref:  # what the old path cost: crc32 of the VRAM slot through the host
                seg = rx._buffer[: got.nbytes]
                t0 = time.perf_counter()
                checksum(seg, "crc32")
                out["crc32_s"] = time.perf_counter() - t0
                out.update(_time_wsum16(seg))
            return out
        finally:
            got.release()

    # -------------------------------------------------------------- inject
    def inject_setup(self, model_dir: str, max_seq_len: int) -> dict:
        import torch

        from expresslane.engine.decode.engine import DecodeEngine
        from expresslane.engine.transfer.receiver import KVReceiver

        dtype = "float32"
        self.engine = DecodeEngine.from_pretrained(model_dir, dtype=dtype, device=self.device, max_seq_len=max_seq_len)
        if self.device.type == "cuda":
            self.engine.warmup()  # captures the step's CUDA graphs (what a live node has done before a request)
        c = self.engine.config
        rx = KVReceiver(c.num_layers, c.num_kv_heads, c.head_dim, dtype, self.device, max_seq_len, "127.0.0.1",
                        ctrl_port=_free_port(), num_slots=1, verify_checksum=True)
        rx.start()
        self.rx["inject"] = rx
        return {"port": rx.ctrl_port, "step": self.engine.runner.mode.value, "device": str(self.engine.device),
                "torch": torch.__version__}

    def inject_prepare(self, prompt: list) -> dict:
        """The reference: this engine prefills the prompt itself and decodes greedily; then the cache is dirtied."""
        from expresslane.engine.decode.sampling import SamplingParams

        eng = self.engine
        self.prompt = prompt
        self.params = SamplingParams(max_tokens=INJECT_NEW_TOKENS, ignore_eos=True)
        self.first = int(eng.prefill(prompt).argmax())
        self.ref_k = eng.cache.k[:, :len(prompt)].clone()
        self.ref_v = eng.cache.v[:, :len(prompt)].clone()
        self.expected = list(eng.generate(self.first, len(prompt), self.params))
        eng.prefill([5] * 50)  # dirty the cache: a no-op inject cannot pass
        return {"first_token": self.first}

    def inject_arm(self) -> dict:
        """Start recording (before the sender is told to send): every GPU copy of receive + check + inject."""
        self.timed.calls.clear()
        self.prof = None
        self.pinned0 = _pinned_host_bytes() if self.device.type == "cuda" else None
        if self.device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()
        return {}

    def inject_wait(self, rid: str, timeout_s: float) -> dict:
        import asyncio

        import torch

        eng, rx, prompt = self.engine, self.rx["inject"], self.prompt
        got = asyncio.run(rx.wait_for(rid, timeout_s))  # the KV lands and is checked (checksum) in the window
        try:
            _sync(self.device)
            t0 = time.perf_counter()
            eng.inject(got.k, got.v, got.num_tokens)  # straight from the receive slot (views of it)
            inject_s = time.perf_counter() - t0
            view = got.k.untyped_storage().data_ptr() == rx._buffer.data_ptr()
            kv_equal = bool(torch.equal(got.k, self.ref_k) and torch.equal(got.v, self.ref_v))
            kv_device = str(got.k.device)
        finally:
            got.release()
        trace = None
        if self.prof is not None:
            _sync(self.device)
            self.prof.__exit__(None, None, None)
            trace = os.path.join(tempfile.gettempdir(), f"handoff-inject-{os.getpid()}.json")
            self.prof.export_chrome_trace(trace)
        pinned1 = _pinned_host_bytes() if self.device.type == "cuda" else None
        pinned_delta = ({k: (pinned1[k] or 0) - (self.pinned0[k] or 0) for k in pinned1}
                        if pinned1 is not None and self.pinned0 is not None else None)
        tokens = list(eng.generate(self.first, len(prompt), self.params))
        return {"tokens_equal": tokens == self.expected, "expected": self.expected, "got": tokens,
                "first_token": self.first, "inject_s": inject_s, "kv_device": kv_device, "zero_copy_view": view,
                "kv_bitwise_equal_own_prefill": kv_equal, "recv_checksums": list(self.timed.calls),
                "transfer_s": got.transfer_s, "nbytes": got.nbytes,
                "memcpy": _memcpy_summary(trace) if trace else None,
                "pinned_host_bytes": [self.pinned0, pinned1], "pinned_host_delta": pinned_delta}

    def stop(self) -> None:
        for rx in self.rx.values():
            rx.stop()


class _Sender:
    """The prefill's side: a StagingPool per (mode, shape) + KVSender, one NIXL agent each."""

    def __init__(self) -> None:
        self.tx: dict = {}

    def setup(self, device: str, shapes: dict, modes: list) -> dict:
        import torch

        from expresslane.engine.transfer import sender as send_mod

        self.device = _device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.timed = _Timed(send_mod.checksum)
        send_mod.checksum = self.timed
        for mode in modes:
            for name, (layers, heads, dim, dtype, max_tokens) in shapes.items():
                self.tx[(mode, name)] = self._make(mode, layers, heads, dim, dtype, max_tokens)
        return {"modes": modes}

    def _make(self, mode: str, layers, heads, dim, dtype, max_tokens) -> dict:
        from expresslane.engine.protocol.layout import KVLayoutSpec
        from expresslane.engine.transfer.sender import KVSender, SenderConfig
        from expresslane.engine.transfer.staging import StagingPool

        layout = KVLayoutSpec(layers, heads, dim, dtype, max_tokens)
        on_device = mode.startswith("vram")
        pool = StagingPool(1, layout.request_nbytes(max_tokens), device=self.device if on_device else "cpu",
                           pin_memory=(not on_device and self.device.type == "cuda"))
        ep = _TimedEndpoint(f"handoff-{mode.replace('->', '-')}")
        region = ep.register(pool.buffer)
        # A WRITE of 4 GiB takes seconds even at 1 GB/s: 30 s means stuck (the run must not spend its budget)
        sender = KVSender(ep, region, layout, config=SenderConfig(io_timeout_s=30, write_timeout_s=30,
                                                                  busy_retry_s=5))
        return {"layout": layout, "pool": pool, "ep": ep, "region": region, "sender": sender}

    def send(self, mode: str, shape: str, rid: str, port: int, tokens: int, seed: int, gen_device: str) -> dict:
        from expresslane.engine.transfer.sender import SendJob

        t = self.tx[(mode, shape)]
        nbytes = t["layout"].request_nbytes(tokens)
        slot = t["pool"].acquire()
        assert slot is not None
        slot.bytes(nbytes).copy_(_pattern(nbytes, seed, gen_device))
        _sync(gen_device)
        self.timed.calls.clear()
        job = SendJob(rid=rid, host="127.0.0.1", port=port, num_tokens=tokens, slot=slot, nbytes=nbytes)
        t0 = time.perf_counter()
        t["sender"].send(job)  # raises SendError (typed reason) on any failure
        total = time.perf_counter() - t0
        return {"send_s": total, "write_s": t["ep"].last_write_s, "send_checksums": list(self.timed.calls),
                "staging": t["region"].mem_type}

    # -------------------------------------------------------------- inject
    def inject_setup(self, model_dir: str, max_seq_len: int) -> dict:
        from expresslane.engine.decode.engine import DecodeEngine

        self.engine = DecodeEngine.from_pretrained(model_dir, dtype="float32", device=self.device,
                                                   max_seq_len=max_seq_len)
        c = self.engine.config
        self.tx["inject"] = self._make("vram" if self.device.type == "cuda" else "dram", c.num_layers,
                                       c.num_kv_heads, c.head_dim, "float32", max_seq_len)
        return {}

    def inject_send(self, rid: str, port: int, prompt: list) -> dict:
        """Prefill the prompt (as the prefill server would), stage its K/V on the device, ship it."""
        import torch

        from expresslane.engine.transfer.sender import SendJob

        eng, t = self.engine, self.tx["inject"]
        first = int(eng.prefill(prompt).argmax())
        T, c = len(prompt), eng.config
        slot = t["pool"].acquire()
        k, v = slot.dense_kv(c.num_layers, T, c.num_kv_heads, c.head_dim, torch.float32)
        k.copy_(eng.cache.k[:, :T])
        v.copy_(eng.cache.v[:, :T])
        _sync(self.device)
        self.timed.calls.clear()
        t0 = time.perf_counter()
        t["sender"].send(SendJob(rid=rid, host="127.0.0.1", port=port, num_tokens=T, slot=slot,
                                 nbytes=t["layout"].request_nbytes(T)))
        return {"first_token": first, "send_s": time.perf_counter() - t0, "send_checksums": list(self.timed.calls)}

    # -------------------------------------------------------------- references in one process
    def refs(self, sizes: list, reps: int) -> list:
        import torch

        from expresslane.engine.transfer.nixl_transport import NixlEndpoint

        out = []
        dev = self.device
        cuda = dev.type == "cuda"
        biggest = max(sizes)
        dst = torch.empty(biggest, dtype=torch.uint8, device=dev)
        src_dev = torch.randint(0, 256, (biggest,), dtype=torch.uint8, device=dev)
        src_host = torch.empty(biggest, dtype=torch.uint8, pin_memory=cuda)
        src_host.copy_(src_dev)
        target = NixlEndpoint("handoff-ref-dst")
        dst_region = target.register(dst)
        target.start_progress(lambda: True)
        try:
            for src_name, src in (("dram", src_host), ("vram" if cuda else "dram2", src_dev)):
                if not cuda and src_name == "dram2":
                    continue
                try:
                    out += self._nixl_ref(src_name, src, dst, target, dst_region, sizes, reps, cuda)
                except Exception as e:  # noqa: BLE001 - recorded; the torch references still run
                    traceback.print_exc()
                    out.append({"ref": f"nixl_1proc_{src_name}->{'vram' if cuda else 'dram'}", "nbytes": 0,
                                "error": f"{type(e).__name__}: {e}"[:1000]})
        finally:
            target.stop_progress()
        for name, src in (("torch_d2d" if cuda else "torch_memcpy", src_dev), ("torch_h2d_pinned", src_host)):
            if not cuda and name == "torch_h2d_pinned":
                continue
            for n in sizes:
                times = []
                for _ in range(reps + 1):
                    _sync(dev)
                    t0 = time.perf_counter()
                    dst[:n].copy_(src[:n], non_blocking=True)
                    _sync(dev)
                    times.append(time.perf_counter() - t0)
                out.append({"ref": name, "nbytes": n, "cold_s": times[0], "p50_s": statistics.median(times[1:])})
        return out

    def _nixl_ref(self, src_name, src, dst, target, dst_region, sizes, reps, cuda) -> list:
        import torch

        init = _TimedEndpoint(f"handoff-ref-{src_name}")
        src_region = init.register(src)
        remote = init.ensure_remote(target.name, target.metadata_b64())
        out = []
        for n in sizes:
            times = []
            for rep in range(reps + 1):
                init.write(local=src_region, local_offset=0, nbytes=n, remote_agent=remote, remote=dst_region,
                           remote_offset=0, notif=f"ref-{src_name}-{n}-{rep}".encode(), timeout_s=30)
                times.append(init.last_write_s)
            exact = bool(torch.equal(dst[:n], src[:n].to(dst.device)))
            out.append({"ref": f"nixl_1proc_{src_name}->{'vram' if cuda else 'dram'}", "nbytes": n,
                        "cold_s": times[0], "p50_s": statistics.median(times[1:]), "bytes_exact": exact})
        return out

    def stop(self) -> None:
        for t in self.tx.values():
            t["sender"].stop(2.0)


class _TimedEndpoint:
    """A NixlEndpoint that keeps the duration of its last WRITE (initialize + transfer + completion poll)."""

    def __new__(cls, prefix: str):
        from expresslane.engine.transfer.nixl_transport import NixlEndpoint

        class Timed(NixlEndpoint):
            last_write_s = 0.0

            def write(self, **kw) -> None:
                t0 = time.perf_counter()
                try:
                    super().write(**kw)
                finally:
                    self.last_write_s = time.perf_counter() - t0

        return Timed(prefix)


# ============================================================================ parent

def _tail(path: Path, n: int = 30) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


class StepTimeout(Exception):
    pass


class ChildError(Exception):
    pass


class Worker:
    def __init__(self, role: str, log_path: Path, env: dict) -> None:
        ctx = mp.get_context("spawn")
        self.role, self.log_path = role, log_path
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(role, child, str(log_path), env), name=f"handoff-{role}",
                                daemon=True)
        self.proc.start()

    def send(self, cmd: str, **kw) -> None:
        self.conn.send((cmd, kw))

    def recv(self, timeout_s: float) -> dict:
        if not self.conn.poll(max(0.0, timeout_s)):
            state = "alive" if self.proc.is_alive() else f"exited with {self.proc.exitcode}"
            raise StepTimeout(f"{self.role}: no answer within {timeout_s:.0f} s (process {state})")
        try:
            status, payload = self.conn.recv()
        except EOFError:
            raise ChildError(f"{self.role} died (exit code {self.proc.exitcode})") from None
        if status != "ok":
            raise ChildError(f"{self.role}: {payload['type']}: {payload['message']}")
        return payload

    def call(self, cmd: str, timeout_s: float, **kw) -> dict:
        self.send(cmd, **kw)
        return self.recv(timeout_s)

    def log_tail(self, n: int = 30) -> list[str]:
        return _tail(self.log_path, n)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", 10)
            except Exception:  # noqa: BLE001
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def parse_sizes(specs: list[str]) -> list[tuple[str, int]]:
    sizes = []
    for spec in specs:
        shape, _, toks = spec.partition(":")
        if shape not in SHAPES or not toks:
            raise SystemExit(f"bad --sizes entry {spec!r}: SHAPE:T1,T2 with SHAPE in {sorted(SHAPES)}")
        sizes += [(shape, int(t)) for t in toks.split(",")]
    return sizes


class Run:
    def __init__(self, args) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.deadline_s
        self.out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-handoff-"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.results = (self.out / "results.jsonl").open("a")
        self.log = (self.out / "handoff.log").open("a")
        self.records: list[dict] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def bound(self, step_s: float) -> float:
        """A step's wait: its own bound, never past the run's deadline."""
        left = self.left()
        if left < 1:
            raise StepTimeout("run deadline reached")
        return min(step_s, left)

    def skip_unless(self, need_s: float, phase: str) -> bool:
        if self.left() >= need_s:
            return True
        self.emit({"event": "skipped", "phase": phase, "why": f"deadline: {self.left():.0f} s left, {need_s} s needed"})
        return False

    def emit(self, rec: dict) -> None:
        rec = {"t": round(time.monotonic() - self.t0, 3), **rec}
        line = json.dumps(rec, default=str)
        print(line, flush=True)
        self.results.write(line + "\n")
        self.results.flush()
        self.log.write(line + "\n")
        self.log.flush()
        self.records.append(rec)


def _env_info(device: str) -> dict:
    import importlib.metadata as md

    import torch

    info = {"torch": torch.__version__, "device": device, "python": sys.version.split()[0],
            "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")}}
    for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _p50(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run_pairs(run: Run, rx: Worker, tx: Worker, modes: list, sizes: list, gen_device: str) -> None:
    a = run.args
    for mode in modes:
        for shape, tokens in sizes:
            nbytes = _nbytes(shape, tokens)
            step = 30 + nbytes / 2e8
            trials = []
            for rep in range(a.reps + 1):
                if run.left() < 5 + nbytes / 1e9:  # not even a slow (1 GB/s) transfer fits: stop here
                    run.emit({"event": "skipped", "phase": f"{mode} {shape} {tokens} tokens from rep {rep}",
                              "why": "deadline"})
                    if len(trials) > 1:
                        _summary(run, mode, shape, tokens, nbytes, trials)
                    return
                rid = f"{mode}-{shape}-{tokens}-{rep}"
                seed = (hash(rid) & 0x7FFFFFFF)
                rx.call("expect", run.bound(30), shape=shape, rid=rid, ttl_s=step + 30)
                rx.send("wait", shape=shape, rid=rid, timeout_s=step, seed=seed, gen_device=gen_device,
                        bounce_ref=(rep == 1 and a.bounce_ref))
                s = tx.call("send", run.bound(step + 10), mode=mode, shape=shape, rid=rid, port=run.ports[shape],
                            tokens=tokens, seed=seed, gen_device=gen_device)
                r = rx.recv(run.bound(step + 10))
                rec = {"event": "transfer", "mode": mode, "shape": shape, "tokens": tokens, "nbytes": nbytes,
                       "rep": rep, "cold": rep == 0, **s, **r,
                       "write_GBps": nbytes / s["write_s"] / 1e9 if s["write_s"] else None}
                run.emit(rec)
                if not r["bytes_exact"]:
                    raise ChildError(f"{rid}: landed bytes differ from the sent pattern")
                trials.append(rec)
            _summary(run, mode, shape, tokens, nbytes, trials)


def _summary(run: Run, mode: str, shape: str, tokens: int, nbytes: int, trials: list[dict]) -> None:
    warm = [t for t in trials if not t["cold"]] or trials
    sck = [c["s"] for t in warm for c in t["send_checksums"]]
    rck = [c["s"] for t in warm for c in t["recv_checksums"]]
    bounce = [t for t in warm if "crc32_s" in t]
    run.emit({"event": "summary", "mode": mode, "shape": shape, "tokens": tokens, "nbytes": nbytes,
              "reps": len(warm), "write_s_p50": _p50([t["write_s"] for t in warm]),
              "write_GBps_p50": nbytes / _p50([t["write_s"] for t in warm]) / 1e9,
              "recv_accept_to_done_s_p50": _p50([t["transfer_s"] for t in warm]),
              "send_total_s_p50": _p50([t["send_s"] for t in warm]),
              "send_checksum_s_p50": _p50(sck), "recv_checksum_s_p50": _p50(rck),
              "checksum_algorithm": (warm[0]["send_checksums"] or [{}])[0].get("algorithm"),
              "cold_write_s": trials[0]["write_s"], "all_bytes_exact": all(t["bytes_exact"] for t in trials),
              "crc32_host_bounce_s": bounce[0]["crc32_s"] if bounce else None,
              "wsum16_s": bounce[0]["wsum16_s"] if bounce else None,
              "wsum16_triton_s": bounce[0].get("wsum16_triton_s") if bounce else None,
              "wsum16_kernels_agree": bounce[0].get("wsum16_kernels_agree") if bounce else None})


def run_inject(run: Run, rx: Worker, tx: Worker, model_dir: Path) -> None:
    max_seq = 512
    rx_info = rx.call("inject_setup", run.bound(300), model_dir=str(model_dir), max_seq_len=max_seq)
    tx.call("inject_setup", run.bound(300), model_dir=str(model_dir), max_seq_len=max_seq)
    prompt = [(i * 37 + 11) % 1000 + 10 for i in range(INJECT_PROMPT_LEN)]
    rx.call("inject_prepare", run.bound(120), prompt=prompt)
    rx.call("expect", run.bound(30), shape="inject", rid="inject-0", ttl_s=120)
    rx.call("inject_arm", run.bound(60))
    rx.send("inject_wait", rid="inject-0", timeout_s=60)
    s = tx.call("inject_send", run.bound(120), rid="inject-0", port=rx_info["port"], prompt=prompt)
    r = rx.recv(run.bound(120))
    mc = r.get("memcpy") or {}
    run.emit({"event": "inject", **rx_info, **r, "sender_first_token": s["first_token"],
              "send_checksums": s["send_checksums"],
              "no_host_bounce": (mc.get("host_bytes", 0) < 4096 and mc.get("gpu_events", 0) > 0
                                 and ((r.get("pinned_host_delta") or {}).get("active_bytes.allocated") or 0) < 4096)
              if mc else None})


_UCX_PREFIX = re.compile(r"^\[[0-9.]+\]\s+\[[^]]*\]\s*")
_AGENT = re.compile(r"\S*(handoff|expresslane)-\S*")


def ucx_choices(paths: list[Path]) -> list[str]:
    """What UCX chose for the NIXL WRITEs (the ``ucp_put`` tables UCX_PROTO_INFO prints: transport per size
    range, e.g. ``cuda_ipc/cuda``, ``cuda_copy/cuda``, ``cma/memory``), plus every UCX error / warning line."""
    out: list[str] = []
    for p in paths:
        try:
            lines = [_UCX_PREFIX.sub("", line) for line in p.read_text(errors="replace").splitlines()]
        except OSError:
            continue
        for i, line in enumerate(lines):
            if re.search(r"UCX\s+(ERROR|WARN)|ucx.*(error|fail)", line, re.I):
                entry = f"{p.stem}: {line.strip()[:300]}"
            elif "ucp_put" in line:
                # UCX prints the agent + config either on the line above or in a first column of this one
                above = lines[i - 1] if i and lines[i - 1].startswith("|") else ""
                title = _AGENT.sub("", above.strip("| ").strip()).strip()
                rows: list[str] = []
                for nxt in lines[i + 1:i + 24]:  # the size-range rows, with or without a "Range" header
                    if nxt.startswith("|"):
                        if nxt.strip("| ").split()[:1] != ["Range"]:
                            rows.append(" ".join(nxt.strip("| ").split()))
                    elif not nxt.startswith("+") or rows:
                        break
                what = " ".join(_AGENT.sub("", line.strip("| ").strip()).split())
                entry = f"{p.stem}: [{title}] {what}: {'; '.join(rows)}" if title else f"{p.stem}: {what}: " \
                    f"{'; '.join(rows)}"
            else:
                continue
            if entry not in out:
                out.append(entry)
    return out[:60]


def print_table(run: Run) -> None:
    rows = [r for r in run.records if r.get("event") == "summary"]
    print("\n== two-process handoff (p50 over warm reps) ==")
    print(f"{'mode':12} {'shape':9} {'tokens':>6} {'MiB':>7} {'write ms':>9} {'GB/s':>7} {'acc->done ms':>12} "
          f"{'send ms':>8} {'ck tx ms':>8} {'ck rx ms':>8} {'algo':7} {'crc32 bounce ms':>15} "
          f"{'wsum16 torch/triton ms':>22} exact")
    for r in rows:
        def ms(x):
            return f"{x * 1e3:.2f}" if x is not None else "-"
        print(f"{r['mode']:12} {r['shape']:9} {r['tokens']:>6} {r['nbytes'] / 2**20:>7.0f} {ms(r['write_s_p50']):>9} "
              f"{r['write_GBps_p50']:>7.1f} {ms(r['recv_accept_to_done_s_p50']):>12} {ms(r['send_total_s_p50']):>8} "
              f"{ms(r['send_checksum_s_p50']):>8} {ms(r['recv_checksum_s_p50']):>8} {str(r['checksum_algorithm']):7} "
              f"{ms(r['crc32_host_bounce_s']):>15} "
              f"{ms(r['wsum16_s']) + '/' + ms(r.get('wsum16_triton_s')):>22} {r['all_bytes_exact']}")
    refs = [r for r in run.records if r.get("event") == "ref"]
    if refs:
        print("\n== one-process references (p50) ==")
        for r in refs:
            if "error" in r:
                print(f"{r['ref']:26} FAILED: {r['error']}")
                continue
            print(f"{r['ref']:26} {r['nbytes'] / 2**20:>7.0f} MiB {r['p50_s'] * 1e3:>9.2f} ms "
                  f"{r['nbytes'] / r['p50_s'] / 1e9:>7.1f} GB/s  cold {r['cold_s'] * 1e3:.1f} ms"
                  + (f"  exact {r['bytes_exact']}" if "bytes_exact" in r else ""))
    for r in run.records:
        if r.get("event") == "inject":
            mc = r.get("memcpy") or {}
            print(f"\n== inject == tokens_equal {r['tokens_equal']}  inject {r['inject_s'] * 1e3:.3f} ms  "
                  f"kv on {r['kv_device']} (zero-copy view {r['zero_copy_view']})  host bytes copied "
                  f"{mc.get('host_bytes', '-')}  copies {mc.get('copies', '-')}  gpu events {mc.get('gpu_events', '-')}  "
                  f"pinned delta {r.get('pinned_host_delta')}  no_host_bounce {r['no_host_bounce']}  "
                  f"first token {r['first_token']} / sender {r['sender_first_token']}  "
                  f"checks {[c['algorithm'] for c in r['recv_checksums']]}")
    for r in run.records:
        if r.get("event") == "ucx":
            print("\n== what UCX chose for the WRITEs (UCX_PROTO_INFO), and its errors ==")
            for line in r["lines"] or ["(nothing logged: UCX_PROTO_INFO off, or no WRITE ran)"]:
                print("  " + line)
    for r in run.records:
        if r.get("event") in ("error", "skipped"):
            print(f"\n!! {r['event']}: {r.get('phase', '')} {r.get('why', r.get('message', ''))}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    ap.add_argument("--out", default=None, help="results.jsonl, handoff.log and the children's logs go here")
    ap.add_argument("--deadline-s", type=float, default=480.0, help="stop cleanly after this long")
    ap.add_argument("--reps", type=int, default=5, help="warm repetitions per size (plus one cold)")
    ap.add_argument("--sizes", nargs="*", default=None, help="SHAPE:T1,T2 ... (shapes: llama-8b, llama-1b)")
    ap.add_argument("--modes", nargs="*", default=None, help="vram->vram dram->vram (cuda) | dram->dram (cpu)")
    ap.add_argument("--phases", nargs="*", default=["pairs", "inject", "refs", "mixed"],
                    help="pairs: the first mode (vram->vram on cuda); inject; refs; mixed: the other modes")
    ap.add_argument("--model-dir", default=None,
                    help="the inject model (default OUT/tiny-model; made by make_tiny_model.py where missing)")
    ap.add_argument("--ucx-tls", default=None, help="UCX_TLS for both children (default: UCX's own choice)")
    ap.add_argument("--child-env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more environment for both children (e.g. UCX_RNDV_SCHEME=put_zcopy); recorded in start")
    ap.add_argument("--no-proto-info", action="store_true", help="do not set UCX_PROTO_INFO=y")
    ap.add_argument("--wsum16-kernel", choices=["torch", "triton"], default=None,
                    help="EXPRESSLANE_WSUM16_KERNEL for both children (default: checksum.py's auto)")
    ap.add_argument("--no-bounce-ref", dest="bounce_ref", action="store_false",
                    help="skip timing crc32 of the VRAM slot through the host (once per size)")
    args = ap.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device")
    args.device = device
    sizes = parse_sizes(args.sizes or DEFAULT_SIZES[device])
    modes = args.modes or (["vram->vram", "dram->vram"] if device == "cuda" else ["dram->dram"])
    run = Run(args)
    env = {} if args.no_proto_info else {"UCX_PROTO_INFO": "y"}
    if args.ucx_tls:
        env["UCX_TLS"] = args.ucx_tls
    if args.wsum16_kernel:
        env["EXPRESSLANE_WSUM16_KERNEL"] = args.wsum16_kernel
    for item in args.child_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--child-env wants KEY=VALUE, got {item!r}")
        env[key] = value
    run.emit({"event": "start", "argv": list(sys.argv[1:] if argv is None else argv), "out": str(run.out),
              "child_env": env, **_env_info(device)})
    gen_device = "cuda:0" if device == "cuda" else "cpu"  # where both sides generate the transfer pattern
    model_dir = Path(args.model_dir) if args.model_dir else run.out / "tiny-model"
    maker = None
    if "inject" in args.phases and not (model_dir / "config.json").exists():  # build it there
        maker = subprocess.Popen([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(model_dir),
                                  "--dtype", "float32"], stdout=run.log, stderr=subprocess.STDOUT)
    shapes = {}
    for shape, tokens in sizes:
        L, H, D = SHAPES[shape]
        prev = shapes.get(shape, (L, H, D, DTYPE, 0))
        shapes[shape] = (L, H, D, DTYPE, max(prev[4], tokens))
    logs = [run.out / "receiver.log", run.out / "sender.log"]

    def start_workers() -> tuple[Worker, Worker]:
        rx, tx = Worker("receiver", logs[0], env), Worker("sender", logs[1], env)
        try:
            got = rx.call("setup", run.bound(180), device=device, shapes=shapes)
            run.ports = {k: v["port"] for k, v in got.items()}
            tx.call("setup", run.bound(180), device=device, shapes=shapes, modes=modes)
        except BaseException:
            rx.close()
            tx.close()
            raise
        run.emit({"event": "ready", "ports": run.ports})
        return rx, tx

    def inject(rx: Worker, tx: Worker) -> None:
        if maker is not None:
            maker.wait(timeout=run.bound(240))
            if maker.returncode != 0:
                raise ChildError(f"make_tiny_model.py failed ({maker.returncode}); see {run.out / 'handoff.log'}")
        run_inject(run, rx, tx, model_dir)

    def refs(rx: Worker, tx: Worker) -> None:
        ref_sizes = sorted({_nbytes(s, t) for s, t in sizes})
        for r in tx.call("refs", run.bound(60 + sum(ref_sizes) * (args.reps + 1) * 4 / 1e9), sizes=ref_sizes,
                         reps=args.reps):
            run.emit({"event": "ref", **r})

    phases = [  # (name, seconds it needs at least, body); each runs even when an earlier one failed
        ("pairs", 10, lambda rx, tx: run_pairs(run, rx, tx, modes[:1], sizes, gen_device)),
        ("inject", 60, inject),
        ("refs", 30, refs),
        ("mixed", 30, lambda rx, tx: run_pairs(run, rx, tx, modes[1:], sizes, gen_device)),
    ]
    rc = 0
    workers: tuple[Worker, Worker] | None = None
    try:
        for name, need_s, body in phases:
            if name not in args.phases or (name == "mixed" and not modes[1:]) or not run.skip_unless(need_s, name):
                continue
            try:
                if workers is None:
                    workers = start_workers()
                body(*workers)
            except (StepTimeout, ChildError, subprocess.TimeoutExpired) as e:
                rc = 1
                tails = {w.role: w.log_tail() for w in workers} if workers else {p.stem: _tail(p) for p in logs}
                run.emit({"event": "error", "phase": name, "type": type(e).__name__, "message": str(e),
                          "log_tails": tails})
                if workers is not None:  # a child in an unknown state: the next phase gets fresh ones
                    for w in workers:
                        w.close()
                    workers = None
    finally:
        if maker is not None and maker.poll() is None:
            maker.kill()
        for w in workers or ():
            w.close()
    run.emit({"event": "ucx", "lines": ucx_choices(logs)})
    print_table(run)
    run.emit({"event": "end", "rc": rc, "elapsed_s": round(time.monotonic() - run.t0, 1)})
    return rc


if __name__ == "__main__":
    sys.exit(main())
