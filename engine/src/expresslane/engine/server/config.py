"""The express decode server's one typed config, built from the command line at the entrypoint."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..secrets import NODE_TOKEN, PEER_SECRET, SecretError, read_secret


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
    max_timeout_s: float = 300.0  # a request's timeout_s above this is refused (400)
    # Deadlines: every failure of a request surfaces within a bound.
    reservation_ttl_s: float = 60.0  # the cap on /pd/reserve's ttl_s (a longer one is shortened to this)
    request_deadline_s: float = 600.0  # a /pd/decode from take-over to its last token (KV wait included)
    stall_timeout_s: float = 30.0  # no token for this long mid-decode -> error, cancel, release
    health_interval_s: float = 2.0  # the health monitor's probe period (reserve / decode refuse on its verdict)
    health_probe_timeout_s: float = 5.0  # the engine thread must run a no-op job within this
    # The receiver (control plane + NIXL agent), per the Receiver API contract.
    max_connections: int = 64
    verify_checksum: bool = True
    # Secrets, read once at the entrypoint (expresslane.engine.secrets); never in repr or logs.
    node_token: str | None = field(default=None, repr=False)  # EXPRESS_NODE_TOKEN: bearer token of /pd/* etc.
    peer_secret: bytes | None = field(default=None, repr=False)  # EXPRESSLANE_PEER_SECRET: control-plane HMAC
    attention: str | None = None  # None: engine default for the device (decode.ATTENTION_MODES)
    speculation: bool = True  # exact prompt-lookup speculative decoding (a request may opt out)
    spec_k: int = 4  # most draft tokens per verify step
    compile: bool = False
    cuda_graph: bool | None = None  # None: on for cuda with masked attention (the engine's default)
    lean: bool | None = None  # the fused T = 1 CUDA step: False off, None where it applies, True or fail
    lean_gemv: str = "auto"  # its GEMV kernels (models/lean.py): auto, cuda-core, tensor-core, per-request
    seats: int | None = None  # requests decoded at once (decode/batch.py); None = auto (resolve_seats)
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


#: The smallest hidden size whose node runs a GEMV family per request by default (resolve_lean_gemv).
PER_REQUEST_MIN_HIDDEN = 4096


def resolve_lean_gemv(choice: str, *, device_type: str, speculation: bool, lean: bool | None,
                      cuda_graph: bool | None, attention: str | None, hidden_size: int) -> str:
    """The node's --lean-gemv, resolved when its engine is built (the model's hidden size is the checkpoint's):
    `auto` is per-request (decode/family.py: a runner of each GEMV family, each request on the one its prompt
    suits) where the lean step runs and speculates (a cuda device, the lean step not off, a CUDA graph over split-KV
    attention, speculation on) on a model of hidden size PER_REQUEST_MIN_HIDDEN or more, else the engine's auto
    (one family, cuda-core).

    Measured on an H100 (docs/bench/2026-12-06-per-request-ab/, docs/bench/2026-12-06-per-request-gate/): at the
    8B shape (hidden 4096) every request within 1 % of the faster one-family engine in two runs (within 3 % either
    way), up to 1.39x the cuda-core engine on text that repeats and the same on text that does not. At the 1B shape
    (hidden 2048) the choice still gains 1.25-1.31x on the agentic request but the engine ran 0.93-0.99x the
    cuda-core one on the rest, inside what two builds of one 1B engine differ by (a five-row verify 2.20-2.36 ms
    across four builds), while the tensor-core family's one-row step costs 11 % more there (22 % on an H200; 4-6 %
    at 8B): what a request put on it wrongly loses. Hidden sizes between are not measured: they keep one family."""
    from ..decode.engine import PER_REQUEST, default_attention, parse_attention, resolve_cuda_graph
    from ..models.attention import AttentionKind

    if choice != "auto" or device_type != "cuda" or not speculation or lean is False:
        return choice
    kind = parse_attention(attention or default_attention(device_type))
    if kind is not AttentionKind.SPLIT_KV or not resolve_cuda_graph(cuda_graph, device_type, kind):
        return choice
    return PER_REQUEST if hidden_size >= PER_REQUEST_MIN_HIDDEN else choice


#: A node's seats at most, and a CPU node's by default (--seats auto).
MAX_SEATS = 8
CPU_SEATS = 4


def resolve_seats(choice: int | None, *, device_type: str, seat_bytes: int, free_bytes: int | None,
                  multi_seat_step: str | None) -> tuple[int, str]:
    """The node's seats and why. `choice` None is auto: CPU_SEATS on a CPU; on a GPU as many seats (at most
    MAX_SEATS) as fit in 80 % of the device memory left after the weights, each seat holding one max_seq_len
    request's KV twice (the engine's cache and its receive region). `multi_seat_step`: why this engine cannot
    step several users together (None: it can); then auto is 1 and an explicit choice above 1 is a ValueError."""
    if choice is not None:
        if not 1 <= choice <= MAX_SEATS:
            raise ValueError(f"--seats must be in [1, {MAX_SEATS}], got {choice}")
        if choice > 1 and multi_seat_step:
            raise ValueError(f"--seats {choice}: {multi_seat_step}")
        return choice, "as configured"
    if multi_seat_step:
        return 1, multi_seat_step
    if device_type != "cuda" or free_bytes is None:
        return CPU_SEATS, f"the CPU default ({CPU_SEATS})"
    fit = int(0.8 * free_bytes) // (2 * seat_bytes)
    seats = max(1, min(MAX_SEATS, fit))
    return seats, (f"{fit} seats of {2 * seat_bytes / 2**30:.2f} GiB (KV and receive region at max_seq_len) fit "
                   f"in 80 % of {free_bytes / 2**30:.1f} GiB free: {seats}")


def _positive(ap: argparse.ArgumentParser, a: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")


def parse_args(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> ServerConfig:
    """The command line (and, for the two secrets only, the environment: NAME or NAME_FILE)."""
    from ..decode import CUDA_GRAPH_CHOICES, SpeculationConfig, default_attention, resolve_cuda_graph
    from ..decode.engine import ATTENTION_MODES

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
    ap.add_argument("--max-timeout-s", type=float, default=300.0,
                    help="largest timeout_s a /pd/decode may ask for (400 above it)")
    ap.add_argument("--reservation-ttl-s", type=float, default=60.0, help="cap on /pd/reserve's ttl_s")
    ap.add_argument("--request-deadline-s", type=float, default=600.0,
                    help="bound on one /pd/decode, KV wait + decode (then deadline_exceeded, cancel, release)")
    ap.add_argument("--stall-timeout-s", type=float, default=30.0,
                    help="no token for this long mid-decode -> decode stalled error, cancel, release")
    ap.add_argument("--health-interval-s", type=float, default=2.0, help="period of the node's own health probe")
    ap.add_argument("--health-probe-timeout-s", type=float, default=5.0,
                    help="the engine thread must answer a no-op job within this, else /health 503")
    ap.add_argument("--max-connections", type=int, default=64, help="control-plane connection cap")
    ap.add_argument("--no-verify-checksum", dest="verify_checksum", action="store_false",
                    help="skip the KV checksum check before inject (production speed switch; on by default)")
    ap.add_argument("--attention", choices=ATTENTION_MODES, default=None,
                    help="attention kernel (default: split on cuda, live elsewhere)")
    ap.add_argument("--speculation", choices=["on", "off"], default="on",
                    help="exact speculative decoding by prompt lookup (greedy output identical; requests may opt "
                         "out with sampling.speculative=false)")
    ap.add_argument("--spec-k", type=int, default=SpeculationConfig.k, help="most draft tokens per verify step")
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    ap.add_argument("--cuda-graph", choices=["auto", "on", "off"], default="auto",
                    help="replay the decode step as one CUDA graph (auto: on for cuda with masked attention)")
    ap.add_argument("--lean", choices=["auto", "on", "off"], default="auto",
                    help="the fused T = 1 decode step on CUDA (6 Triton kernels a layer; needs --cuda-graph and split "
                         "attention): auto = wherever it applies (the default), on = or fail at start, off = the "
                         "PyTorch step")
    ap.add_argument("--lean-gemv", choices=["auto", "cuda-core", "tensor-core", "per-request"], default="auto",
                    help="the lean step's GEMV kernels: cuda-core (the fastest one-token step; each further row of "
                         "a speculative verify costs about one more step) or tensor-core (a verify of 5 rows "
                         "costs about one row: for traffic that repeats, e.g. agentic and code edits; one row ~4 %% "
                         "slower at 8B, 22 %% at 1B, so text that never repeats runs ~4 %% slower); per-request: "
                         "both, each request on the family its prompt suits (a cuda device and --speculation on; "
                         "the warm-up builds both families); auto (the default): per-request where the lean step "
                         "speculates on a cuda device and the model's hidden size is 4096 or more, else cuda-core")
    ap.add_argument("--seats", default="auto",
                    help=f"requests decoded at once, each bit-identical to alone (1..{MAX_SEATS}; auto: "
                         f"{CPU_SEATS} on a CPU, on a GPU as many as its free memory holds at --max-seq-len, "
                         f"at most {MAX_SEATS})")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: one per --cpu-bind CPU, else torch's default)")
    ap.add_argument("--cpu-bind", default=None, metavar="LIST",
                    help="pin the node to these CPUs, e.g. 1 or 2-3 (taskset -c syntax); empty or 'auto' = inherit")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    ap.add_argument("--log-level", default="info")
    a = ap.parse_args(argv)
    if a.max_seq_len < 2:
        ap.error("--max-seq-len must be >= 2")
    _positive(ap, a, "kv_timeout_s", "max_timeout_s", "reservation_ttl_s", "request_deadline_s", "stall_timeout_s",
              "health_interval_s", "health_probe_timeout_s", "max_connections")
    if a.kv_timeout_s > a.max_timeout_s:
        ap.error(f"--kv-timeout-s {a.kv_timeout_s} exceeds --max-timeout-s {a.max_timeout_s}")
    try:
        node_token = read_secret(NODE_TOKEN, os.environ if env is None else env)
        peer_secret = read_secret(PEER_SECRET, os.environ if env is None else env)
    except SecretError as e:
        ap.error(str(e))
    cpu_bind = None
    if a.cpu_bind and a.cpu_bind.strip() not in ("", "auto"):
        try:
            cpu_bind = parse_cpu_list(a.cpu_bind)
        except ValueError as e:
            ap.error(f"--cpu-bind: {e}")
    cuda_graph = CUDA_GRAPH_CHOICES[a.cuda_graph]
    device_type = a.device.split(":")[0]
    try:
        resolve_cuda_graph(cuda_graph, device_type, a.attention or default_attention(device_type))
    except ValueError as e:
        ap.error(f"--cuda-graph {a.cuda_graph}: {e}")
    lean = {"auto": None, "on": True, "off": False}[a.lean]
    if lean and device_type != "cuda":
        ap.error(f"--lean on needs a cuda device, not {a.device}")
    if a.lean_gemv == "per-request" and (device_type != "cuda" or a.speculation != "on" or lean is False):
        ap.error(f"--lean-gemv per-request chooses a lean-step GEMV family for what speculation earns: it needs a "
                 f"cuda device, the lean step and --speculation on (got --device {a.device} --lean {a.lean} "
                 f"--speculation {a.speculation})")
    if a.threads is not None and a.threads < 1:
        ap.error("--threads must be >= 1")
    seats = None
    if a.seats != "auto":
        try:
            seats = int(a.seats)
        except ValueError:
            ap.error(f"--seats must be auto or an integer, got {a.seats!r}")
        if not 1 <= seats <= MAX_SEATS:
            ap.error(f"--seats must be in [1, {MAX_SEATS}], got {seats}")
    try:
        SpeculationConfig(k=a.spec_k)
    except ValueError as e:
        ap.error(f"--spec-k: {e}")
    return ServerConfig(
        model=a.model, dtype=a.dtype, device=a.device, max_seq_len=a.max_seq_len, host=a.host,
        advertise_host=a.advertise_host, ctrl_port=a.ctrl_port, http_port=a.http_port,
        kv_timeout_s=a.kv_timeout_s, max_timeout_s=a.max_timeout_s, reservation_ttl_s=a.reservation_ttl_s,
        request_deadline_s=a.request_deadline_s, stall_timeout_s=a.stall_timeout_s,
        health_interval_s=a.health_interval_s, health_probe_timeout_s=a.health_probe_timeout_s,
        max_connections=a.max_connections, verify_checksum=a.verify_checksum, node_token=node_token,
        peer_secret=peer_secret.encode() if peer_secret else None, attention=a.attention, compile=a.compile,
        cuda_graph=cuda_graph, lean=lean,
        lean_gemv=a.lean_gemv,
        speculation=a.speculation == "on", spec_k=a.spec_k,
        seats=seats, threads=a.threads,
        cpu_bind=cpu_bind, warmup=a.warmup, log_level=a.log_level,
    )
