"""python -m expresslane.engine.server --model DIR [--dtype float32] [--device cpu] [--max-seq-len 4096]
    [--host 0.0.0.0] [--advertise-host 127.0.0.1] [--ctrl-port 5556] [--http-port 5557] [--kv-timeout-s 120]
    [--threads N] [--cpu-bind LIST] [--max-timeout-s 300] [--reservation-ttl-s 60] [--request-deadline-s 600]
    [--stall-timeout-s 30] [--health-interval-s 2] [--health-probe-timeout-s 5] [--max-connections 64]
    [--no-verify-checksum] [--attention live|split|masked] [--speculation on|off] [--spec-k 4]
Secrets from the environment only: EXPRESS_NODE_TOKEN(_FILE), EXPRESSLANE_PEER_SECRET(_FILE)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch
import uvicorn

from ..decode import DecodeEngine, KVGeometry, SpeculationConfig, default_attention, parse_dtype
from ..decode.engine import multi_seat_unsupported
from ..models.config import ModelConfig
from ..secrets import NODE_TOKEN, PEER_SECRET, describe
from .app import create_app
from .config import ServerConfig, parse_args, resolve_lean_gemv, resolve_seats
from .receiver import build_receiver

log = logging.getLogger("expresslane.engine.server")


def apply_cpu_placement(config: ServerConfig) -> None:
    """Pin the process (every thread it starts later inherits it) and size torch's intra-op pool."""
    if config.cpu_bind is not None:
        try:
            os.sched_setaffinity(0, config.cpu_bind)
        except OSError as e:
            raise SystemExit(f"--cpu-bind {','.join(map(str, config.cpu_bind))}: {e} "
                             f"(this process may use CPUs {sorted(os.sched_getaffinity(0))})") from None
    threads = config.threads or (len(config.cpu_bind) if config.cpu_bind is not None else None)
    if threads:
        torch.set_num_threads(threads)


def node_lean_gemv(config: ServerConfig) -> str:
    """The GEMV family choice the node's engine is built with: --lean-gemv auto resolved against the checkpoint's
    hidden size (config.resolve_lean_gemv), anything else as given."""
    if config.lean_gemv != "auto" or torch.device(config.device).type != "cuda":
        return config.lean_gemv  # (a CPU node's checkpoint is not read twice)
    return resolve_lean_gemv(config.lean_gemv, device_type="cuda",
                             speculation=config.speculation, lean=config.lean, cuda_graph=config.cuda_graph,
                             attention=config.attention,
                             hidden_size=ModelConfig.from_model_dir(config.model).hidden_size)


def weight_bytes(mc: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of a checkpoint's weights in `dtype` (projections, embeddings, norms; biases ignored)."""
    h, layers = mc.hidden_size, mc.num_layers
    per_layer = h * (mc.q_size + 2 * mc.kv_size) + mc.q_size * h + 3 * h * mc.intermediate_size + 2 * h
    embed = mc.vocab_size * h * (1 if mc.tie_word_embeddings else 2)
    return (layers * per_layer + embed + h) * torch.empty((), dtype=dtype).element_size()


def node_engine_options(config: ServerConfig) -> tuple[str, int]:
    """The engine's GEMV family choice and seats. Several seats are the default wherever the engine can step
    several users together (their GEMVs on a GPU: the tensor-core family); where it cannot, or the node is asked
    for one seat, the family as a one-seat node resolves it (node_lean_gemv: per-request at 8B)."""
    device = torch.device(config.device)
    if config.seats == 1:
        return node_lean_gemv(config), 1
    gemv = "tensor-core" if device.type == "cuda" and config.lean_gemv == "auto" else config.lean_gemv
    seats = node_seats(config, gemv)
    return (gemv, seats) if seats > 1 else (node_lean_gemv(config), 1)


def node_seats(config: ServerConfig, lean_gemv: str) -> int:
    """The node's seats (config.resolve_seats), logged with why and what a seat costs at start."""
    device = torch.device(config.device)
    attention = config.attention or default_attention(device.type)
    why = multi_seat_unsupported(device.type, attention, config.cuda_graph, lean_gemv, config.lean)
    mc = ModelConfig.from_model_dir(config.model)
    if why is None and device.type == "cuda" and (mc.qk_norm or mc.head_dim % 2):
        why = "the lean step does not cover this model (per-head q/k norms or an odd head_dim)"
    dtype = parse_dtype(config.dtype)
    seat_bytes = KVGeometry(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.max_seq_len, dtype,
                            device).seat_bytes()
    free = None
    if device.type == "cuda":  # the engine is not built yet: what its weights will take, from the config
        free = max(0, torch.cuda.mem_get_info(device)[0] - weight_bytes(mc, dtype))
    try:
        seats, reason = resolve_seats(config.seats, device_type=device.type, seat_bytes=seat_bytes,
                                      free_bytes=free, multi_seat_step=why)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    log.info("seats: %d (%s); KV per seat %.1f MB at max_seq_len %d", seats, reason, seat_bytes / 1e6,
             config.max_seq_len)
    return seats


def build_engine(config: ServerConfig) -> DecodeEngine:
    t0 = time.perf_counter()
    lean_gemv, seats = node_engine_options(config)
    engine = DecodeEngine.from_pretrained(config.model, dtype=config.dtype, device=config.device,
                                          max_seq_len=config.max_seq_len, attention=config.attention,
                                          compile=config.compile, cuda_graph=config.cuda_graph, lean=config.lean,
                                          lean_gemv=lean_gemv, seats=seats,
                                          speculation=SpeculationConfig(k=config.spec_k) if config.speculation
                                          else None)
    if config.warmup:
        try:
            engine.warmup()  # compiles the decode step when --compile is on
        except Exception as e:  # noqa: BLE001 - torch.compile fails in many ways (no C compiler, inductor bugs)
            if not engine.compile:
                raise
            log.warning("torch.compile of the decode step failed, decoding without it: %s: %s",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            engine.disable_compile()
            engine.warmup()
    log.info("engine ready in %.1fs: %s %s on %s, max_seq_len=%d, %.1f MB of weights, attention=%s, compile=%s, "
             "cuda_graph=%s, lean=%s (gemv %s), speculation=%s, seats=%d",
             time.perf_counter() - t0, engine.config.model_type, config.dtype, config.device, config.max_seq_len,
             engine.weight_bytes() / 1e6, engine.attention, engine.compile, engine.cuda_graph,
             engine.runner.lean, engine.lean_gemv if engine.families else engine.runner.lean_gemv,
             f"k={config.spec_k}" if config.speculation else "off", engine.seats)
    if engine.warmup_report:
        log.info("warm-up: %s", json.dumps(engine.warmup_report))
    if engine.speculation is not None:
        rel = lambda costs: " ".join(f"{t / costs[0]:.2f}" for t in costs)  # noqa: E731
        for family in engine.families or (None,):  # a per-request engine: each family's own costs
            if family is not None:
                engine.use_family(family)
            c, who = engine.step_costs, f" ({family} GEMVs)" if family else ""
            if c.measured:
                log.info("step costs%s, what the drafter weighs a verify by (1..%d rows, x one row): at %d tokens "
                         "%s (one row %.3f ms), at %d tokens %s (one row %.3f ms)", who, len(c.short), c.lengths[0],
                         rel(c.short), 1e3 * c.short[0], c.lengths[1], rel(c.long), 1e3 * c.long[0])
            else:
                log.info("step costs%s assumed, not measured (no warm-up): 1..%d rows cost %s x one row", who,
                         len(c.short), rel(c.short))
        if engine.families:
            engine.use_family(engine.families[0])
    return engine


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    apply_cpu_placement(config)
    for name, value in ((NODE_TOKEN, config.node_token), (PEER_SECRET, config.peer_secret)):
        if value:
            log.info("%s", describe(name))
        else:
            log.warning("%s not set: %s is open to anyone who can reach it (dev / CI only)", name,
                        "/pd/*, /decode_status, /capabilities" if name == NODE_TOKEN else "the control plane")
    engine = build_engine(config)
    receiver = build_receiver(config, engine)
    app = create_app(config, engine, receiver)
    uvicorn.run(app, host=config.host, port=config.http_port, log_level=config.log_level, access_log=False)


if __name__ == "__main__":
    sys.exit(main())
