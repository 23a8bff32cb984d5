"""The connector's typed config, read once from kv_connector_extra_config (unknown keys are an error)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ExpressLaneConnectorConfig:
    metrics_port: int | None = None     # Prometheus endpoint of the worker: port + global rank; None: off
    metrics_host: str = "0.0.0.0"
    staging_slots: int = 2              # requests that may be in flight (staged, not yet acked) per rank
    staging_max_tokens: int | None = None  # longest shippable prompt; None: the model's max_model_len
    staging_device: str = "cpu"         # "cpu" (pinned when the KV cache is on CUDA) or "device"
    nixl_backends: tuple[str, ...] = ("UCX",)
    connect_timeout_s: float = 3.0
    io_timeout_s: float = 10.0
    write_timeout_s: float = 30.0
    busy_retry_s: float = 10.0
    # CPU backend: put the forward thread back on its OpenMP core after NixlConnector moved it (cpu_affinity.py)
    restore_omp_affinity: bool = True

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "ExpressLaneConnectorConfig":
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"ExpressLaneConnector: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(known)}")
        if "nixl_backends" in extra:
            extra["nixl_backends"] = tuple(extra["nixl_backends"])
        cfg = cls(**extra)
        if cfg.staging_slots < 1:
            raise ValueError("ExpressLaneConnector: staging_slots must be >= 1")
        if cfg.staging_device not in ("cpu", "device"):
            raise ValueError("ExpressLaneConnector: staging_device must be 'cpu' or 'device'")
        if cfg.metrics_port is not None and not 0 < int(cfg.metrics_port) < 65536:
            raise ValueError(f"ExpressLaneConnector: bad metrics_port {cfg.metrics_port}")
        return cfg
