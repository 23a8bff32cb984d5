"""The connector's numbers, through vLLM's own KV-connector stats interface (as NixlConnector does).

Path (vLLM 0.32): both connector roles collect events into an ``ExpressLaneStats`` (``get_kv_connector_stats``
drains it); vLLM aggregates the workers' stats over TP ranks (KVOutputAggregator) and the scheduler's into
them, MultiConnector keys them by class name, the engine core ships them to the API server in
SchedulerStats, and there ``ExpressLanePromMetrics.observe`` (built once by ``build_prom_metrics``) adds
them to vLLM's own registry: the numbers appear on the prefill's ``/metrics`` beside ``vllm:*``, with
vLLM's labels ``model_name`` and ``engine`` (one per DP engine) plus ours (``reason``, and ``rank`` on the
staging gauges, which are per TP rank). ``METRICS`` is the one table of names: the prom builder, the
optional side port and scripts/dashboards.py's metric catalog all read it.

The payload (``to_dict``) is what msgpack carries from the engine core to the API server: plain counters
``{key: n}``, labelled counters ``{key: {reason: n}}``, histogram observations ``{key: [x, ...]}`` and the
gauges as ``{key: {rank: value}}`` (last value wins).

Counters incremented by workers count once per TP rank that did the work: with tensor parallelism N a
request's staging copy, send and failure count N times; bytes are the total over ranks.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from expresslane.engine.connector.metric_table import (
    _SECONDS,
    COUNTER,
    GAUGE,
    HISTOGRAM,
    LABELLED,
    METRICS,
    SPECS,
    MetricSpec,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig


__all__ = ["METRICS", "SPECS", "MetricSpec", "ExpressLaneStats", "StatsRecorder", "ExpressLanePromMetrics"]


def _empty() -> dict[str, Any]:
    return {}


@dataclass
class ExpressLaneStats(KVConnectorStats):
    """Events since the last drain, in the payload form above (serializable as it is)."""

    data: dict[str, Any] = field(default_factory=_empty)

    # ----------------------------------------------------------- recording (one role, one thread at a time)

    def inc(self, key: str, n: float = 1, label: str | None = None) -> None:
        spec = SPECS[key]
        if spec.kind == LABELLED:
            assert label is not None, key
            by = self.data.setdefault(key, {})
            by[label] = by.get(label, 0) + n
        else:
            assert spec.kind == COUNTER, key
            self.data[key] = self.data.get(key, 0) + n

    def observe(self, key: str, value: float) -> None:
        assert SPECS[key].kind == HISTOGRAM, key
        self.data.setdefault(key, []).append(value)

    def set_gauge(self, key: str, rank: int, value: float) -> None:
        assert SPECS[key].kind == GAUGE, key
        self.data.setdefault(key, {})[str(rank)] = value

    # ----------------------------------------------------------- vLLM's KVConnectorStats interface

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data

    def aggregate(self, other: KVConnectorStats) -> "ExpressLaneStats":
        for key, value in other.data.items():
            kind = SPECS[key].kind
            if kind == COUNTER:
                self.data[key] = self.data.get(key, 0) + value
            elif kind == HISTOGRAM:
                self.data.setdefault(key, []).extend(value)
            elif kind == LABELLED:
                by = self.data.setdefault(key, {})
                for label, n in value.items():
                    by[label] = by.get(label, 0) + n
            else:  # GAUGE: per rank, the later value wins
                self.data.setdefault(key, {}).update(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        """One line for vLLM's periodic log ("KV Transfer metrics: ...")."""
        out: dict[str, int | float] = {}
        for key, value in self.data.items():
            kind = SPECS[key].kind
            if kind == COUNTER:
                out[key] = value
            elif kind == LABELLED:
                out.update({f"{key}[{label}]": n for label, n in sorted(value.items())})
            elif kind == HISTOGRAM and value:
                out[f"{key} avg (ms)"] = round(1e3 * sum(value) / len(value), 3)
            elif kind == GAUGE:
                out.update({f"{key}[rank {r}]": v for r, v in sorted(value.items())})
        return out


class StatsRecorder:
    """Thread-safe accumulator for a role whose events come from several threads (the worker: the
    forward thread stages, the sender threads ack or fail). ``drain`` hands the events over once.

    It also keeps the rids whose send has ended (``mark_done``), and ``take_done`` gives only those whose
    events the last ``drain`` handed over: the scheduler stops stepping vLLM for an rid only once its
    numbers (the ack, the slot's release) are on their way to /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = ExpressLaneStats()
        self._done: dict[str, int] = {}   # ended, events not drained yet
        self._ready: dict[str, int] = {}  # ended, events drained

    def mark_done(self, rid: str) -> None:
        with self._lock:
            self._done[rid] = self._done.get(rid, 0) + 1

    def take_done(self) -> dict[str, int]:
        with self._lock:
            out, self._ready = self._ready, {}
            return out

    def inc(self, key: str, n: float = 1, label: str | None = None) -> None:
        with self._lock:
            self._stats.inc(key, n, label)

    def observe(self, key: str, value: float) -> None:
        with self._lock:
            self._stats.observe(key, value)

    def set_gauge(self, key: str, rank: int, value: float) -> None:
        with self._lock:
            self._stats.set_gauge(key, rank, value)

    def drain(self) -> ExpressLaneStats | None:
        with self._lock:
            for rid, n in self._done.items():
                self._ready[rid] = self._ready.get(rid, 0) + n
            self._done = {}
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, ExpressLaneStats()
            return out

    def peek(self) -> ExpressLaneStats:
        """A copy of what has not been drained yet (tests, logs)."""
        with self._lock:
            return ExpressLaneStats(copy.deepcopy(self._stats.data))


def _unregister_ours() -> None:
    """What vLLM's unregister_vllm_metrics does for ``vllm:*`` at every PrometheusStatLogger start, for our
    names in the global registry: a second stat logger in one process must not fail on duplicates."""
    from prometheus_client import REGISTRY

    ours = {s.name for s in METRICS}
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", None) in ours:
            REGISTRY.unregister(collector)


class ExpressLanePromMetrics(KVConnectorPromMetrics):
    """The METRICS table as Prometheus metrics of the classes vLLM hands in (its own registry), labelled
    ``labelnames`` (vLLM's model_name, engine) + the spec's label; ``observe`` applies one payload."""

    def __init__(self, vllm_config: "VllmConfig | None", metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]], *, registry=None,
                 staging_slots: int | None = None, tp_size: int = 1) -> None:
        if vllm_config is not None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        else:  # the side port: plain prometheus_client classes, a private registry
            from prometheus_client import Counter, Gauge, Histogram

            self._gauge_cls, self._counter_cls, self._histogram_cls = (
                metric_types.get(Gauge, Gauge), metric_types.get(Counter, Counter),
                metric_types.get(Histogram, Histogram))
            self._labelnames, self.per_engine_labelvalues = labelnames, per_engine_labelvalues
        extra = {} if registry is None else {"registry": registry}
        if registry is None:
            _unregister_ours()
        self.metrics: dict[str, Any] = {}
        for spec in METRICS:
            names = list(labelnames) + ([spec.label] if spec.label else [])
            if spec.kind in (COUNTER, LABELLED):
                metric = self._counter_cls(name=spec.name, documentation=spec.help, labelnames=names, **extra)
            elif spec.kind == HISTOGRAM:
                metric = self._histogram_cls(name=spec.name, documentation=spec.help, labelnames=names,
                                             buckets=list(_SECONDS), **extra)
            else:
                metric = self._gauge_cls(name=spec.name, documentation=spec.help, labelnames=names,
                                         multiprocess_mode="mostrecent", **extra)
            self.metrics[spec.key] = metric
            if spec.kind in (COUNTER, HISTOGRAM) and labelnames:  # at 0 from the start, as vLLM's own are
                for engine_idx in self.per_engine_labelvalues:
                    self._child(spec.key, engine_idx)
        if staging_slots is not None:  # the gauges exist from the start (the first request may be far off)
            for engine_idx in self.per_engine_labelvalues:
                for rank in range(tp_size):
                    self._child("staging_slots_free", engine_idx, str(rank)).set(staging_slots)
                    self._child("staging_slots_in_use", engine_idx, str(rank)).set(0)

    def _child(self, key: str, engine_idx: int, label: str | None = None):
        values = list(self.per_engine_labelvalues[engine_idx]) + ([label] if label is not None else [])
        metric = self.metrics[key]
        return metric.labels(*values) if values else metric

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            spec = SPECS.get(key)
            if spec is None:
                continue  # a newer worker's key: never break the API server's output loop over metrics
            if spec.kind == COUNTER:
                self._child(key, engine_idx).inc(value)
            elif spec.kind == LABELLED:
                for label, n in value.items():
                    self._child(key, engine_idx, label).inc(n)
            elif spec.kind == HISTOGRAM:
                child = self._child(key, engine_idx)
                for x in value:
                    child.observe(x)
            else:
                for rank, v in value.items():
                    self._child(key, engine_idx, rank).set(v)
