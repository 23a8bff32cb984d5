"""Every panel of every dashboard shows data after smoke traffic, against a live stack and a real Prometheus.

Uses the session fixture `live_stack` (tests/conftest.py: router_url, prefill_url, native_url, express_url,
connector_metrics_url) and `prometheus` (tests/observability_support.py: a real Prometheus binary scraping them
every second). Grafana is not needed: each panel's PromQL runs through Prometheus's HTTP API with Grafana's
variables substituted the way Grafana would substitute them.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from observability_support import (  # noqa: E402
    EXPRESS_ALIAS,
    NATIVE_ALIAS,
    dashboards,
    missing_metrics,
    prometheus,  # noqa: F401  (fixture)
    run_panel_queries,
    send_smoke_traffic,
    summary,
)


@pytest.fixture(scope="module")
def smoke_traffic(live_stack, prometheus):  # noqa: F811
    """Traffic through both lanes after Prometheus has a baseline of every target, then three more scrapes."""
    report = send_smoke_traffic(live_stack.router_url)
    prometheus.wait_scrapes(3)
    return report


def test_smoke_traffic_went_through_both_lanes(smoke_traffic):
    by_alias = {}
    for alias, stream, status in smoke_traffic.statuses:
        by_alias.setdefault(alias, []).append(status)
    assert set(by_alias[NATIVE_ALIAS]) == {200}, by_alias
    assert set(by_alias[EXPRESS_ALIAS]) == {200}, by_alias
    assert by_alias["no-such-model"] == [404], by_alias


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? ([0-9.e+-]+)$", text, re.M):
        labels = dict(re.findall(r'([a-zA-Z_]+)="([^"]*)"', m.group(1) or ""))
        out.append((labels, float(m.group(2))))
    return out


def test_connector_numbers_are_on_the_prefills_own_metrics(live_stack, prometheus, smoke_traffic):  # noqa: F811
    """After express handoffs, vLLM's /metrics (not a side port) has the connector's counters, with vLLM's
    labels, and the sends' numbers have arrived (the connector keeps vLLM stepping until the send ends)."""
    import httpx

    text = httpx.get(f"{live_stack.prefill_url}/metrics", timeout=10, trust_env=False).text
    express = sum(1 for alias, _, status in smoke_traffic.statuses if alias == EXPRESS_ALIAS and status == 200)
    assert express > 0
    got = {}
    for name in ("expresslane_connector_claimed_requests_total", "expresslane_connector_staging_copies_total",
                 "expresslane_connector_sent_requests_total", "expresslane_connector_sent_bytes_total",
                 "expresslane_connector_unclaimed_requests_total"):
        samples = _samples(text, name)
        assert samples, f"{name} is not on the prefill's /metrics"
        assert all({"model_name", "engine"} <= set(lab) for lab, _ in samples), samples
        got[name] = sum(v for _, v in samples)
    print(f"\nprefill /metrics after {express} express requests: {got}")
    assert got["expresslane_connector_claimed_requests_total"] >= express
    assert got["expresslane_connector_staging_copies_total"] >= express
    assert got["expresslane_connector_sent_requests_total"] >= express
    assert got["expresslane_connector_sent_bytes_total"] > 0
    in_use = _samples(text, "expresslane_connector_staging_slots_in_use")
    assert in_use and all(lab.get("rank") == "0" for lab, _ in in_use) and sum(v for _, v in in_use) == 0, in_use
    # Prometheus has them from the prefill job (there is no connector job any more)
    jobs = {r["metric"].get("job") for r in prometheus.instant("expresslane_connector_sent_requests_total")}
    assert jobs == {"prefill"}, jobs


def test_every_dashboard_metric_is_exported(prometheus, smoke_traffic):  # noqa: F811
    """Names first: panels that fall back to `or on() vector(0)` would hide a renamed metric otherwise."""
    problems = missing_metrics(prometheus)
    assert not problems, "dashboard metrics no scrape job announces:\n" + "\n".join(problems)


def test_every_panel_query_returns_data(prometheus, smoke_traffic):  # noqa: F811
    """Each query has a finite value in the traffic window, and a non-zero one unless a healthy system may
    leave it at zero (failure counters, sampled gauges: T.zero_ok in scripts/dashboards.py)."""
    start = smoke_traffic.started - 2 * prometheus.scrape_interval_s
    results = run_panel_queries(prometheus, start, time.time(), step_s=1.0)
    assert results, "no dashboard queries found"
    print(f"\n{len(results)} panel queries over {time.time() - start:.0f}s:\n{summary(results)}")
    empty = [r for r in results if not r.ok]
    assert not empty, (
        f"{len(empty)} of {len(results)} panel queries show no data, NaN or a flat zero after traffic:\n"
        + "\n".join(r.describe() for r in empty)
    )


def test_an_empty_panel_would_be_caught(prometheus, smoke_traffic):  # noqa: F811
    """The detector itself: a misspelt metric, an all-NaN quantile and a flat zero are reported, not passed."""
    bogus = [
        dashboards.Query("x", "misspelt", "timeseries", "A",
                         "sum(rate(expresslane_router_request_total[$__rate_interval]))", False),
        dashboards.Query("x", "nan", "stat", "A", "histogram_quantile(0.5, sum by (le) "
                         "(rate(expresslane_router_time_to_first_token_seconds_bucket{lane=\"none\"}[$__range])))",
                         True),
        dashboards.Query("x", "flat", "timeseries", "A",
                         "sum(rate(expresslane_decode_kv_timeouts_total[$__rate_interval]))", False),
        dashboards.Query("x", "flat but allowed", "timeseries", "A",
                         "sum(rate(expresslane_decode_kv_timeouts_total[$__rate_interval]))", False, zero_ok=True),
    ]
    results = run_panel_queries(prometheus, smoke_traffic.started, time.time(), queries=bogus)
    assert [r.ok for r in results] == [False, False, False, True], summary(results)
