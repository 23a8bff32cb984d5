"""The express decode server's one typed config, built from the command line at the entrypoint."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServerConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    max_seq_len: int = 4096
    host: str = "0.0.0.0"
    advertise_host: str = "127.0.0.1"
    ctrl_port: int = 5556
    http_port: int = 5557
    kv_timeout_s: float = 120.0  # default /pd/decode timeout_s (wait for the KV) when the request has none
    max_timeout_s: float = 3600.0  # a request's timeout_s above this is refused (400)
    attention: str | None = None  # None: engine default for the device
    compile: bool = False
    cuda_graph: bool | None = None  # None: on for cuda with masked attention (the engine's default)
    threads: int | None = None  # torch intra-op threads on CPU; None = one per bound CPU, else torch default
    cpu_bind: tuple[int, ...] | None = None  # pin the whole process to these CPUs; None = inherit
    warmup: bool = True
    log_level: str = "info"

    @property
    def model_name(self) -> str:
        return Path(self.model).name


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-3,6"`` -> ``(0, 1, 2, 3, 6)`` (the syntax of taskset -c and VLLM_CPU_OMP_THREADS_BIND)."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: expected e.g. 0-3,6")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"empty CPU list {text!r}")
    return tuple(sorted(cpus))


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    ap = argparse.ArgumentParser(
        prog="python -m expresslane.engine.server",
        description="expresslane express decode node (TileRT-compatible /pd/* HTTP contract)",
    )
    ap.add_argument("--model", required=True, help="HF checkpoint directory (the one the prefill vLLM loads)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--host", default="0.0.0.0", help="bind address (HTTP and control plane)")
    ap.add_argument("--advertise-host", default="127.0.0.1", help="address the prefill uses to reach this node")
    ap.add_argument("--ctrl-port", type=int, default=5556)
    ap.add_argument("--http-port", type=int, default=5557)
    ap.add_argument("--kv-timeout-s", type=float, default=120.0, help="default wait for a request's KV")
    ap.add_argument("--attention", choices=["sliced", "masked"], default=None)
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    ap.add_argument("--cuda-graph", choices=["auto", "on", "off"], default="auto",
                    help="replay the decode step as one CUDA graph (auto: on for cuda with masked attention)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: one per --cpu-bind CPU, else torch's default)")
    ap.add_argument("--cpu-bind", default=None, metavar="LIST",
                    help="pin the node to these CPUs, e.g. 1 or 2-3 (taskset -c syntax); empty or 'auto' = inherit")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    ap.add_argument("--log-level", default="info")
    a = ap.parse_args(argv)
    if a.max_seq_len < 2:
        ap.error("--max-seq-len must be >= 2")
    if a.kv_timeout_s <= 0:
        ap.error("--kv-timeout-s must be > 0")
    cpu_bind = None
    if a.cpu_bind and a.cpu_bind.strip() not in ("", "auto"):
        try:
            cpu_bind = parse_cpu_list(a.cpu_bind)
        except ValueError as e:
            ap.error(f"--cpu-bind: {e}")
    from ..decode import CUDA_GRAPH_CHOICES, default_attention, resolve_cuda_graph

    cuda_graph = CUDA_GRAPH_CHOICES[a.cuda_graph]
    device_type = a.device.split(":")[0]
    try:
        resolve_cuda_graph(cuda_graph, device_type, a.attention or default_attention(device_type))
    except ValueError as e:
        ap.error(f"--cuda-graph {a.cuda_graph}: {e}")
    if a.threads is not None and a.threads < 1:
        ap.error("--threads must be >= 1")
    return ServerConfig(
        model=a.model, dtype=a.dtype, device=a.device, max_seq_len=a.max_seq_len, host=a.host,
        advertise_host=a.advertise_host, ctrl_port=a.ctrl_port, http_port=a.http_port,
        kv_timeout_s=a.kv_timeout_s, attention=a.attention, compile=a.compile, cuda_graph=cuda_graph,
        threads=a.threads,
        cpu_bind=cpu_bind, warmup=a.warmup, log_level=a.log_level,
    )
