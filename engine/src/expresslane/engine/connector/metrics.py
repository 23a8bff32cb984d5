"""The optional side port (``metrics_port``): the connector's numbers on a separate Prometheus endpoint
of the worker process, port + global rank. Off unless configured.

The one source is vLLM's own ``/metrics`` (stats.py); the side port is kept for tools that still scrape
it, and is fed from the same payloads (the worker's drained stats each step and, on rank 0, the
scheduler's ``stats_delta``), with the same names and no vLLM labels.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from expresslane.engine.connector.stats import ExpressLanePromMetrics

logger = logging.getLogger(__name__)


class SidePortMetrics:
    def __init__(self, staging_slots: int, rank: int = 0, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.prom = ExpressLanePromMetrics(None, {}, [], {0: []}, registry=self.registry)
        self.prom.observe({"staging_slots_free": {str(rank): staging_slots}, "staging_slots_in_use": {str(rank): 0}})
        self._server = None

    def observe(self, payload: dict[str, Any]) -> None:
        self.prom.observe(payload)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.registry.get_sample_value(name, labels or {})

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        logger.info("expresslane connector side-port metrics on http://%s:%d/metrics (the same numbers are on "
                    "vLLM's /metrics)", host, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
