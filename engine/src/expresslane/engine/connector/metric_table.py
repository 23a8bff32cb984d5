"""The connector's metrics: the one table (names, kinds, help, labels). Standard library only, so that
scripts/dashboards.py can read it (by path) without importing vLLM; stats.py builds the metrics from it."""

from __future__ import annotations

from dataclasses import dataclass

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

COUNTER, LABELLED, HISTOGRAM, GAUGE = "counter", "labelled", "histogram", "gauge"
PREFIX = "expresslane_connector_"


@dataclass(frozen=True)
class MetricSpec:
    key: str          # the payload key; the Prometheus name is PREFIX + key (+ "_total" for counters)
    kind: str         # COUNTER | LABELLED (counter by label) | HISTOGRAM | GAUGE (per TP rank)
    help: str
    side: str         # "scheduler", "worker" or "both": which connector role records it
    label: str = ""   # LABELLED: the label name; GAUGE: "rank"

    @property
    def name(self) -> str:
        return PREFIX + self.key

    @property
    def exposed_name(self) -> str:
        """The name on /metrics (prometheus_client adds _total to counters)."""
        return self.name + "_total" if self.kind in (COUNTER, LABELLED) else self.name

    @property
    def prom_type(self) -> str:
        return {COUNTER: "counter", LABELLED: "counter", HISTOGRAM: "histogram", GAUGE: "gauge"}[self.kind]


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("claimed_requests", COUNTER, "Requests whose kv_transfer_params carry the express-lane marker",
               "scheduler"),
    MetricSpec("unclaimed_requests", COUNTER, "Requests the connector ignored (no express-lane marker)",
               "scheduler"),
    MetricSpec("refused_destinations", COUNTER, "Claims naming a host:port outside the allow-list (nothing sent)",
               "both"),
    MetricSpec("staging_copies", COUNTER, "Prompt KV copies into the staging buffer (inside the forward step), "
               "per TP rank", "worker"),
    MetricSpec("staging_bytes", COUNTER, "Bytes copied into staging (all TP ranks)", "worker"),
    MetricSpec("staging_copy_seconds", HISTOGRAM, "Time the forward step spent copying KV into staging",
               "worker"),
    MetricSpec("sent_requests", COUNTER, "Requests whose KV the decode node acked, per TP rank", "worker"),
    MetricSpec("sent_bytes", COUNTER, "KV bytes written to decode nodes (all TP ranks)", "worker"),
    MetricSpec("send_seconds", HISTOGRAM, "Staged -> acked by the decode node (queue, control, NIXL WRITE)",
               "worker"),
    MetricSpec("send_failures", LABELLED, "Claimed requests whose KV was not delivered, by reason (the "
               "scheduler's own refusals and each TP rank's send failures)", "both", "reason"),
    MetricSpec("send_aborts", LABELLED, "Abort frames sent to a decode node (its waiter fails at once), by "
               "reason", "both", "reason"),
    MetricSpec("staging_slots_free", GAUGE, "Free staging slots, per TP rank", "worker", "rank"),
    MetricSpec("staging_slots_in_use", GAUGE, "Staging slots held by a request being copied or sent, per TP rank "
               "(0 when idle: proves every path frees its slot)", "worker", "rank"),
)
SPECS: dict[str, MetricSpec] = {s.key: s for s in METRICS}
