"""Connector metrics: own registry, served by the worker process on metrics_port + rank."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

logger = logging.getLogger(__name__)

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# stats_delta keys (scheduler -> worker) and the failure reasons the scheduler itself detects
CLAIMED = "claimed"
UNCLAIMED = "unclaimed"
FAIL_PREFIX = "failure:"
REFUSED_DESTINATION = "refused_destination"


class ConnectorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.claimed = Counter("expresslane_connector_claimed_requests",
                               "Requests whose kv_transfer_params carry the express-lane marker", registry=r)
        self.unclaimed = Counter("expresslane_connector_unclaimed_requests",
                                 "Requests the connector ignored (no express-lane marker)", registry=r)
        self.staging_copies = Counter("expresslane_connector_staging_copies",
                                      "Prompt KV copies into the staging buffer (inside the forward step)",
                                      registry=r)
        self.staging_bytes = Counter("expresslane_connector_staging_bytes", "Bytes copied into staging",
                                     registry=r)
        self.staging_copy_seconds = Histogram("expresslane_connector_staging_copy_seconds",
                                              "Time the forward step spent copying KV into staging",
                                              buckets=_SECONDS, registry=r)
        self.sent = Counter("expresslane_connector_sent_requests", "Requests whose KV the decode node acked",
                            registry=r)
        self.sent_bytes = Counter("expresslane_connector_sent_bytes", "KV bytes written to decode nodes",
                                  registry=r)
        self.send_seconds = Histogram("expresslane_connector_send_seconds",
                                      "Staged -> acked by the decode node (queue, control, NIXL WRITE)",
                                      buckets=_SECONDS, registry=r)
        self.send_failures = Counter("expresslane_connector_send_failures",
                                     "Claimed requests whose KV was not delivered, by reason",
                                     ["reason"], registry=r)
        self.staging_slots_free = Gauge("expresslane_connector_staging_slots_free", "Free staging slots",
                                        registry=r)
        self.staging_slots_in_use = Gauge("expresslane_connector_staging_slots_in_use",
                                          "Staging slots held by a request being copied or sent (0 when idle: "
                                          "proves every path frees its slot)", registry=r)
        self.send_aborts = Counter("expresslane_connector_send_aborts",
                                   "Abort frames sent to a decode node (its waiter fails at once), by reason",
                                   ["reason"], registry=r)
        self.refused_destinations = Counter("expresslane_connector_refused_destinations",
                                            "Claims naming a host:port outside the allow-list (nothing sent)",
                                            registry=r)
        self._server = None

    def apply_delta(self, delta: dict[str, int]) -> None:
        for key, n in delta.items():
            if key == CLAIMED:
                self.claimed.inc(n)
            elif key == UNCLAIMED:
                self.unclaimed.inc(n)
            elif key == REFUSED_DESTINATION:
                self.refused_destinations.inc(n)
            elif key.startswith(FAIL_PREFIX):
                self.send_failures.labels(key[len(FAIL_PREFIX):]).inc(n)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        logger.info("expresslane connector metrics on http://%s:%d/metrics", host, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
