"""ExpressLaneConnector: the vLLM V1 KV connector of the express lane (prefill side, kv_producer).

A thin facade, like vLLM's own nixl/connector.py: scheduler-side calls go to ExpressLaneScheduler,
worker-side calls to ExpressLaneWorker; the two talk only through ExpressLaneConnectorMetadata.
It never loads KV, never delays block freeing, and does nothing for requests without the marker.
Implements SupportsHMA: without it MultiConnector turns the hybrid KV cache manager off on the prefill
only, and every native-lane NixlConnector request fails the compatibility-hash check.
Its numbers go through vLLM's KV-connector stats interface (``get_kv_connector_stats``,
``build_kv_connector_stats``, ``build_prom_metrics``; see stats.py) onto the prefill's own /metrics.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from expresslane.engine.connector.config import ExpressLaneConnectorConfig
from expresslane.engine.connector.metadata import ExpressLaneConnectorMetadata, ExpressLaneWorkerMeta
from expresslane.engine.connector.scheduler import ExpressLaneScheduler
from expresslane.engine.connector.stats import ExpressLanePromMetrics, ExpressLaneStats
from expresslane.engine.connector.worker import ExpressLaneWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def _route_logs_to_vllm() -> None:
    """Send the ``expresslane`` loggers through vLLM's handlers (vLLM only configures ``vllm``)."""
    ours, theirs = logging.getLogger("expresslane"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


class ExpressLaneConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _route_logs_to_vllm()
        if not self._kv_transfer_config.is_kv_producer or self._kv_transfer_config.is_kv_consumer:
            raise ValueError("ExpressLaneConnector is a prefill-side connector: use kv_role=kv_producer")
        self.config = ExpressLaneConnectorConfig.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config, env=os.environ)
        self.connector_scheduler: ExpressLaneScheduler | None = None
        self.connector_worker: ExpressLaneWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.config.warn_if_open()
            self.connector_scheduler = ExpressLaneScheduler(
                self.config, self.config.staging_max_tokens or vllm_config.model_config.max_model_len,
                world_size=vllm_config.parallel_config.tensor_parallel_size)
        else:
            self.connector_worker = ExpressLaneWorker(vllm_config, kv_cache_config, self.config)

    @property
    def requires_kv_delivery(self) -> bool:
        # The KV is copied out inside the step that completes the prompt; nothing depends on the blocks after.
        return False

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # a producer never loads KV

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        return None

    def on_new_request(self, request: "Request") -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.on_new_request(request)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self.connector_scheduler is not None
        meta = connector_output.kv_connector_worker_meta  # MultiConnector hands each child its own
        self.connector_scheduler.update_worker_meta(meta if isinstance(meta, ExpressLaneWorkerMeta) else None)

    def has_pending_push_work(self) -> bool:
        # Keeps vLLM stepping while a shipped rid's send is in flight, so its numbers reach /metrics.
        return self.connector_scheduler is not None and self.connector_scheduler.has_pending_push_work()

    # ---------------------------------------------------------------- stats (both roles)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.connector_worker is not None:
            return self.connector_worker.get_stats()
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return ExpressLaneStats(data=data) if data is not None else ExpressLaneStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics:
        config = ExpressLaneConnectorConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config)
        return ExpressLanePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues,
                                      staging_slots=config.staging_slots,
                                      tp_size=vllm_config.parallel_config.tensor_parallel_size)

    # ---------------------------------------------------------------- worker side

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.connector_worker.build_worker_meta() if self.connector_worker is not None else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return None  # the whole-request copy happens once per step in wait_for_save

    def wait_for_save(self) -> None:
        assert self.connector_worker is not None
        meta = self._connector_metadata
        assert meta is None or isinstance(meta, ExpressLaneConnectorMetadata)
        self.connector_worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # never holds blocks, so never reports asynchronous completions

    def shutdown(self) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
