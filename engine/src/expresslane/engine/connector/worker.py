"""Worker side: copy a shipping request's KV into staging inside the forward step, hand it to the sender.

Hook: ``wait_for_save`` (called once per step by vLLM's model runner, after the target and draft
forwards, with this step's metadata still bound; see vllm/v1/worker/kv_connector_model_runner_mixin.py).
At that point every layer's KV for the step is in the paged cache (CPU: synchronously; CUDA: the gather
is enqueued on the same stream after the forward), and the request's blocks cannot be reused before the
step's output is processed, so one gather per layer into a pre-registered staging slot is all the forward
pays. ``save_kv_layer`` would cost a Python call per layer per step for every request; it is a no-op.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import torch

from expresslane.engine.connector.config import ExpressLaneConnectorConfig
from expresslane.engine.connector.cpu_affinity import restore_forward_affinity
from expresslane.engine.connector.metadata import ExpressLaneConnectorMetadata, ExpressLaneWorkerMeta, ShipRequest
from expresslane.engine.connector.metrics import SidePortMetrics
from expresslane.engine.connector.stats import ExpressLaneStats, StatsRecorder
from expresslane.engine.kv_layout import PagedKVLayout, UnsupportedKVLayout, derive_paged_layout, layer_index
from expresslane.engine.protocol.layout import KVLayoutSpec, dtype_name, model_fingerprint
from expresslane.engine.transfer.nixl_transport import NixlEndpoint
from expresslane.engine.transfer.sender import KVSender, SenderConfig, SendJob, SendObserver
from expresslane.engine.transfer.staging import StagingPool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


class _StatsObserver(SendObserver):
    """Sender-thread events -> the worker's stats, and each job's end -> a done rid for the scheduler."""

    def __init__(self, worker: "ExpressLaneWorker") -> None:
        self.worker = worker

    def on_sent(self, job: SendJob, seconds: float) -> None:
        stats = self.worker.stats
        stats.inc("sent_requests")
        stats.inc("sent_bytes", job.nbytes)
        stats.observe("send_seconds", seconds)
        self._end(job)

    def on_failure(self, job: SendJob | None, reason: str) -> None:
        self.worker.stats.inc("send_failures", 1, reason)
        if job is not None:
            self._end(job)

    def _end(self, job: SendJob) -> None:
        if job.slot is not None:
            job.slot.release()  # idempotent (the sender releases it too): its gauge change comes before done
        self.worker.job_done(job.rid)

    def on_abort_sent(self, job: SendJob, reason: str) -> None:
        self.worker.stats.inc("send_aborts", 1, reason)
        if job.abort_reason:  # an abort-only job ends here (a KV job's abort precedes its on_failure)
            self.worker.job_done(job.rid)


def _model_fingerprint(vllm_config: "VllmConfig") -> str:
    """The checkpoint's fingerprint (protocol.layout.model_fingerprint) from vLLM's model directory."""
    model = vllm_config.model_config.model
    if not os.path.isdir(model):
        logger.warning("expresslane connector: model %r is not a local directory; the KV handshake cannot "
                       "check model identity (serve the prefill from a checkpoint directory)", model)
        return ""
    return model_fingerprint(model)


def _parallel_ranks() -> tuple[int, int, int]:
    """(tp_rank, tp_size, pp_size) of this worker; (0, 1, 1) outside a distributed context (tests)."""
    try:
        from vllm.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(), get_pp_group().world_size
    except (AssertionError, AttributeError, RuntimeError):
        return 0, 1, 1


class ExpressLaneWorker:
    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                 config: ExpressLaneConnectorConfig) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.config = config
        self.stats = StatsRecorder()  # drained by get_stats each step (vLLM's get_kv_connector_stats)
        self.tp_rank, self.tp_size, pp_size = _parallel_ranks()
        self.side_port: SidePortMetrics | None = (
            SidePortMetrics(config.staging_slots, self.tp_rank) if config.metrics_port else None)
        if pp_size != 1:
            raise NotImplementedError("ExpressLaneConnector does not support pipeline parallelism yet")
        self._layers: list[torch.Tensor] = []
        self._layer_groups: list[int] = []
        self._layouts: list[PagedKVLayout] = []
        self.layout_spec: KVLayoutSpec | None = None
        self.pool: StagingPool | None = None
        self.sender: KVSender | None = None
        self._device_staging = False
        if config.restore_omp_affinity and vllm_config.device_config.device_type == "cpu":
            restore_forward_affinity()

    # ------------------------------------------------------------------ setup

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        vc = self.vllm_config
        group_of: dict[str, tuple[int, object]] = {}
        for g, group in enumerate(self.kv_cache_config.kv_cache_groups):
            specs = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {}
            for name in group.layer_names:
                group_of[name] = (g, specs.get(name, group.kv_cache_spec))
        names = sorted(kv_caches, key=layer_index)
        if len({layer_index(n) for n in names}) != len(names):
            raise NotImplementedError(f"ExpressLaneConnector: several KV caches per layer index ({names}); "
                                      "draft/cross-attention layers are not supported")
        backends = self._backends(names)
        layouts: dict[tuple, PagedKVLayout] = {}
        for name in names:
            g, spec = group_of[name]
            if not isinstance(spec, FullAttentionSpec) or spec.sliding_window is not None:
                raise NotImplementedError(f"ExpressLaneConnector ships full-attention KV only; layer {name} has "
                                          f"{type(spec).__name__}")
            tensor = kv_caches[name]
            isa = self._cpu_isa(name, tensor, spec.head_size) if backends[name] == "CPU_ATTN" else None
            key = (backends[name], tuple(tensor.shape), tensor.dtype, spec.block_size, isa)
            if key not in layouts:
                layouts[key] = derive_paged_layout(
                    backends[name], num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                    head_dim_v=spec.head_size_v, dtype=spec.dtype, block_size=spec.block_size, layer=tensor,
                    cpu_isa=isa)
            self._layers.append(tensor)
            self._layer_groups.append(g)
            self._layouts.append(layouts[key])
        first = self._layouts[0]
        if len({(lay.num_kv_heads, lay.head_dim, lay.dtype) for lay in self._layouts}) != 1:
            raise NotImplementedError("ExpressLaneConnector: layers differ in KV heads/head size/dtype")
        total_heads = vc.model_config.get_total_num_kv_heads()
        if first.num_kv_heads * self.tp_size != total_heads:
            raise NotImplementedError(f"ExpressLaneConnector: {total_heads} KV heads over TP {self.tp_size} "
                                      f"gives {first.num_kv_heads} per rank (replicated KV heads unsupported)")
        max_tokens = self.config.staging_max_tokens or vc.model_config.max_model_len
        self.layout_spec = KVLayoutSpec(len(names), total_heads, first.head_dim, dtype_name(first.dtype), max_tokens)
        self._setup_transfer(self._layers[0].device, max_tokens)
        logger.info("expresslane connector: %d layers, backend %s (K %s, V %s), %d local KV heads x %d, %s, "
                    "block %d/kernel %d; staging %d x %d B on %s", len(names), first.backend, first.k, first.v,
                    first.num_kv_heads, first.head_dim, first.dtype, first.block_size, first.kernel_block_size,
                    self.pool.num_slots, self.pool.slot_nbytes, self.pool.buffer.device)

    def _cpu_isa(self, name: str, tensor: torch.Tensor, head_size: int) -> str:
        """The ISA CPU_ATTN's metadata builder set on the layer (built before register_kv_caches), else the
        same function called with the builder's arguments (model dtype, kernel block size, head size)."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        layer = get_layers_from_vllm_config(self.vllm_config, Attention, [name]).get(name)
        isa = getattr(layer, "isa", None)
        if isa is None:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(self.vllm_config.model_config.dtype, tensor.shape[2], head_size,
                                self.vllm_config.cache_config.cache_dtype)
        return isa

    def _backends(self, names: list[str]) -> dict[str, str]:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        return {name: get_current_attn_backends(self.vllm_config, [name])[0].get_name() for name in names}

    def _setup_transfer(self, kv_device: torch.device, max_tokens: int) -> None:
        assert self.layout_spec is not None
        heads = self._layouts[0].num_kv_heads
        on_cuda = kv_device.type == "cuda"
        self._device_staging = on_cuda and self.config.staging_device == "device"
        stats, rank = self.stats, self.tp_rank

        def on_change(in_use: int) -> None:
            stats.set_gauge("staging_slots_in_use", rank, in_use)
            stats.set_gauge("staging_slots_free", rank, self.config.staging_slots - in_use)

        self.pool = StagingPool(self.config.staging_slots, self.layout_spec.request_nbytes(max_tokens, heads),
                                device=kv_device if self._device_staging else "cpu",
                                pin_memory=on_cuda and not self._device_staging, on_change=on_change)
        on_change(0)
        endpoint = NixlEndpoint(f"expresslane-prefill-r{self.tp_rank}", self.config.nixl_backends)
        region = endpoint.register(self.pool.buffer)
        cfg = self.config
        self.sender = KVSender(
            endpoint, region, self.layout_spec, rank=self.tp_rank, world_size=self.tp_size,
            head_start=self.tp_rank * heads, num_heads=heads,
            config=SenderConfig(connect_timeout_s=cfg.connect_timeout_s, connect_retries=cfg.connect_retries,
                                io_timeout_s=cfg.io_timeout_s, write_timeout_s=cfg.write_timeout_s,
                                busy_retry_s=cfg.busy_retry_s, checksum=cfg.checksum),
            observer=_StatsObserver(self), peer_secret=cfg.peer_secret,
            model_fingerprint=_model_fingerprint(self.vllm_config),
        )
        self.sender.start()
        if self.side_port is not None:
            dp_rank = self.vllm_config.parallel_config.data_parallel_rank or 0
            self.side_port.serve(int(cfg.metrics_port) + dp_rank * self.tp_size + self.tp_rank, cfg.metrics_host)

    # ------------------------------------------------------------------ stats (vLLM's interface)

    def job_done(self, rid: str) -> None:
        self.stats.mark_done(rid)

    def get_stats(self) -> ExpressLaneStats | None:
        """This step's events (None: nothing happened); also fed to the side port when it is on."""
        stats = self.stats.drain()
        if stats is not None and self.side_port is not None:
            self.side_port.observe(stats.data)
        return stats

    def build_worker_meta(self) -> ExpressLaneWorkerMeta | None:
        """Rids whose send ended and whose numbers the last get_stats handed over (vLLM calls get_stats
        first in every step)."""
        done = self.stats.take_done()
        return ExpressLaneWorkerMeta(done) if done else None

    # ------------------------------------------------------------------ per step

    def wait_for_save(self, meta: ExpressLaneConnectorMetadata | None) -> None:
        if meta is None or meta.is_empty():
            return
        if meta.stats_delta and self.tp_rank == 0 and self.side_port is not None:
            self.side_port.observe(meta.stats_delta)  # the scheduler's counts (vLLM gets them directly)
        for ship in meta.ship:
            self._stage(ship)

    def _fail(self, ship: ShipRequest, reason: str) -> None:
        self.stats.inc("send_failures", 1, reason)
        if self.sender is not None:
            self.sender.submit_abort(ship.claim.rid, ship.claim.host, ship.claim.port, reason)
        else:
            self.job_done(ship.claim.rid)

    def _stage(self, ship: ShipRequest) -> None:
        if self.pool is None or self.sender is None:
            logger.error("expresslane: rid=%s claimed but the connector has no KV caches registered",
                         ship.claim.rid)
            self.stats.inc("send_failures", 1, "not_ready")
            self.job_done(ship.claim.rid)
            return
        if not self.config.allows(ship.claim.host, ship.claim.port):  # the scheduler filters; belt and braces
            logger.error("expresslane: rid=%s names %s:%d outside the allow-list; nothing sent", ship.claim.rid,
                         ship.claim.host, ship.claim.port)
            self.stats.inc("refused_destinations")
            self.job_done(ship.claim.rid)
            return
        assert self.layout_spec is not None
        if ship.num_tokens > self.layout_spec.max_seq_len:
            logger.error("expresslane: rid=%s has %d prompt tokens > staging_max_tokens %d; not shipping",
                         ship.claim.rid, ship.num_tokens, self.layout_spec.max_seq_len)
            self._fail(ship, "too_long")
            return
        slot = self.pool.acquire()
        if slot is None:
            logger.error("expresslane: no free staging slot for rid=%s (%d in flight); increase staging_slots. "
                         "Not shipping (the forward never waits)", ship.claim.rid, self.pool.num_slots)
            self._fail(ship, "no_staging_slot")
            return
        t0 = time.monotonic()
        try:
            ready = self._copy(ship, slot)
        except Exception:
            slot.release()
            logger.exception("expresslane: staging copy failed for rid=%s", ship.claim.rid)
            self._fail(ship, "staging_copy")
            return
        stage_s = time.monotonic() - t0
        lay = self._layouts[0]
        nbytes = self.layout_spec.request_nbytes(ship.num_tokens, lay.num_kv_heads)
        self.stats.inc("staging_copies")
        self.stats.inc("staging_bytes", nbytes)
        self.stats.observe("staging_copy_seconds", stage_s)
        self.sender.submit(SendJob(rid=ship.claim.rid, host=ship.claim.host, port=ship.claim.port,
                                   num_tokens=ship.num_tokens, slot=slot, nbytes=nbytes, ready=ready,
                                   stage_s=stage_s))

    def _copy(self, ship: ShipRequest, slot) -> "callable | None":
        """Gather the request's KV (all layers) into the slot in wire layout. Returns a readiness wait."""
        lay = self._layouts[0]
        T = ship.num_tokens
        k_out, v_out = slot.dense_kv(len(self._layers), T, lay.num_kv_heads, lay.head_dim, lay.dtype)
        device = self._layers[0].device
        index_cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        direct = device == slot.pool.buffer.device
        tmp_k = tmp_v = None
        if not direct:
            shape = (len(self._layers), T, lay.num_kv_heads, lay.head_dim)
            tmp_k = torch.empty(shape, dtype=lay.dtype, device=device)
            tmp_v = torch.empty(shape, dtype=lay.dtype, device=device)
        for i, (layer, g, layout) in enumerate(zip(self._layers, self._layer_groups, self._layouts)):
            key = (g, id(layout))
            if key not in index_cache:
                index_cache[key] = layout.token_index(ship.block_ids[g], T, device)
            blk, off = index_cache[key]
            if direct:
                layout.gather_layer(layer, blk, off, k_out[i], v_out[i])
            else:
                layout.gather_layer(layer, blk, off, tmp_k[i], tmp_v[i])
        if direct and device.type != "cuda":
            return None
        if not direct:
            k_out.copy_(tmp_k, non_blocking=True)
            v_out.copy_(tmp_v, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        keep = (tmp_k, tmp_v)  # keep the temporaries alive until the copy has run

        def ready(event=event, keep=keep) -> None:
            event.synchronize()

        return ready

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.stop()
        if self.side_port is not None:
            self.side_port.close()
