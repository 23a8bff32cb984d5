"""The router's loop-lag monitor (server/loop_lag.py): a blocked loop is measured and named in the log."""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Histogram

from expresslane.router.server.loop_lag import LoopLagMonitor


def _hist() -> tuple[Histogram, CollectorRegistry]:
    r = CollectorRegistry()
    return Histogram("lag_seconds", "lag", buckets=(0.01, 0.1, 1, 10), registry=r), r


async def test_a_blocked_loop_is_measured_and_logged(caplog):
    h, r = _hist()
    mon = LoopLagMonitor(h, interval_s=0.05, warn_s=0.2)
    with caplog.at_level(logging.WARNING, logger="expresslane.router.loop"):
        with mon.running():
            await asyncio.sleep(0.12)  # a few quiet ticks
            time.sleep(0.4)  # the loop blocked: the monitor's timer is late by about as much
            await asyncio.sleep(0.12)
    assert 0.3 <= mon.worst_s < 2.0, mon.worst_s
    assert r.get_sample_value("lag_seconds_count") >= 3
    assert r.get_sample_value("lag_seconds_bucket", {"le": "0.1"}) >= 1  # the quiet ticks
    assert any("event loop ran" in rec.getMessage() for rec in caplog.records)


async def test_a_quiet_loop_logs_nothing(caplog):
    h, _ = _hist()
    mon = LoopLagMonitor(h, interval_s=0.02, warn_s=0.5)
    with caplog.at_level(logging.WARNING, logger="expresslane.router.loop"):
        with mon.running():
            await asyncio.sleep(0.15)
    assert mon.worst_s < 0.5 and not caplog.records
