"""The node's health: the engine thread (alive and answering), the control plane's accept loop and the NIXL
agent (from the KV source). A monitor task in the app's lifespan probes every health_interval_s; /health probes
on demand; /pd/reserve and /pd/decode refuse at once (503 not_ready) on the latest verdict."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from .kv_source import KVSource
from .metrics import DecodeMetrics
from .runner import DecodeRunner

log = logging.getLogger(__name__)

CHECKS = ("engine", "control_plane", "nixl")


@dataclass(frozen=True)
class HealthReport:
    checks: dict[str, str] = field(default_factory=lambda: {c: "ok" for c in CHECKS})

    @property
    def ok(self) -> bool:
        return all(v == "ok" for v in self.checks.values())

    def body(self) -> dict:
        return {"status": "ok" if self.ok else "unhealthy", "checks": dict(self.checks)}


class HealthMonitor:
    def __init__(self, runner: DecodeRunner, source: KVSource, metrics: DecodeMetrics, *,
                 interval_s: float, probe_timeout_s: float) -> None:
        self.runner, self.source, self.metrics = runner, source, metrics
        self.interval_s, self.probe_timeout_s = interval_s, probe_timeout_s
        self.last = HealthReport({c: "not yet checked" for c in CHECKS})
        self.draining = False

    def source_checks(self) -> dict[str, str]:
        try:
            h = self.source.health()
        except Exception as e:  # noqa: BLE001 - a receiver that cannot even say how it is, is not healthy
            return {"control_plane": f"health() failed: {type(e).__name__}", "nixl": "unknown"}
        return {"control_plane": str(h.get("control_plane", "not reported")), "nixl": str(h.get("nixl", "not reported"))}

    async def check(self) -> HealthReport:
        engine = await self.runner.probe_engine(self.probe_timeout_s)
        report = HealthReport({"engine": engine, **self.source_checks()})
        if report.ok != self.last.ok:
            if report.ok:
                log.info("node healthy again")
            else:
                log.warning("node unhealthy: %s", {k: v for k, v in report.checks.items() if v != "ok"})
        self.last = report
        self.metrics.healthy.set(1 if report.ok else 0)
        return report

    def current(self) -> HealthReport:
        """The latest engine verdict with the source's checks read now (cheap: no I/O)."""
        report = HealthReport({"engine": self.last.checks["engine"], **self.source_checks()})
        if not report.ok:
            self.metrics.healthy.set(0)
        return report

    async def run(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:  # noqa: BLE001 - the monitor must outlive any one failed probe
                log.exception("health probe failed")
            await asyncio.sleep(self.interval_s)
