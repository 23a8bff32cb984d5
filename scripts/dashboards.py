#!/usr/bin/env python3
"""expresslane observability as code: Prometheus scrape config, Grafana dashboards, their docs.

    python scripts/dashboards.py write                 # regenerate every generated file (JSON, prometheus.yml, docs table)
    python scripts/dashboards.py check                 # exit 1 if a generated file is stale (CI)
    python scripts/dashboards.py lint                  # offline checks of the dashboards (same as the unit test)
    python scripts/dashboards.py queries [--rate-interval 1m --range 15m --json]
    python scripts/dashboards.py render-prometheus [--compose | --dev [--port-base N] | --targets job=host:port,...]
                                                   [--scrape-interval 5s] [-o FILE]
    python scripts/dashboards.py push   [--folder expresslane]        # needs a running Grafana
    python scripts/dashboards.py verify [--datasource UID|NAME] [--require-data]

Grafana connection (push / verify), read here and nowhere else: GRAFANA_URL (default http://localhost:3000),
GRAFANA_TOKEN (a service-account token) or GRAFANA_USER (default admin) + GRAFANA_PASSWORD (required: there is no
default password; the compose stack's is in the grafana container at /var/lib/grafana/admin-password).

Everything below is the ONE source for: the Prometheus job list (compose and local dev stacks), the metric
contract the dashboards may reference, and every panel (its PromQL, unit and meaning). The JSON under
grafana/dashboards/, compose/prometheus/prometheus.yml and the panel tables in docs/dashboards.md are
generated from it; tests/unit/test_dashboards_lint.py fails when they drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parent.parent
DASHBOARD_DIR = REPO / "grafana" / "dashboards"
PROMETHEUS_YML = REPO / "compose" / "prometheus" / "prometheus.yml"
DOCS = REPO / "docs" / "dashboards.md"
DOCS_BEGIN = "<!-- BEGIN GENERATED: scripts/dashboards.py write -->"
DOCS_END = "<!-- END GENERATED -->"

# ================================================================================================
# Prometheus jobs: the one list. Compose scrapes service names; the dev stack scrapes 127.0.0.1.
# ================================================================================================


@dataclasses.dataclass(frozen=True)
class Job:
    name: str  # the Prometheus `job` label the dashboards filter on
    compose_target: str  # host:port inside the compose network
    dev_port: int  # port on 127.0.0.1 in scripts/dev_stack.py (before --port-base)
    what: str


JOBS: tuple[Job, ...] = (
    Job("router", "router:8080", 8080, "OpenAI router (expresslane.router)"),
    Job("prefill", "prefill:8000", 8000, "stock vLLM prefill server"),
    Job("decode-native", "decode-native:8100", 8100, "stock vLLM native-lane decode server"),
    Job("decode-express", "decode-express:5557", 5557, "express-lane decode server"),
    Job("prometheus", "prometheus:9090", 9090, "Prometheus itself (by service name: production binds it to the node address)"),
)
JOB_NAMES = tuple(j.name for j in JOBS)


def _target(value: str) -> tuple[str, str, str]:
    """'host:port' or 'http://host:port[/path]' -> (scheme, host:port, metrics path)."""
    if "://" not in value:
        return "http", value, "/metrics"
    u = urlparse(value)
    path = u.path.rstrip("/")
    return u.scheme, u.netloc, (path if path.endswith("/metrics") else path + "/metrics")


def prometheus_config(targets: dict[str, str | list[str]], scrape_interval: str = "5s",
                      rule_files: tuple[str, ...] = (), extra_jobs: dict[str, list[str]] | None = None) -> dict:
    """The scrape config as a dict. `targets` maps job name -> 'host:port' or a base URL, or a list of them (a
    pool: every member one target of the job; one scheme and path for all); `rule_files` are alert/recording rule
    globs (compose: the mounted compose/prometheus/rules/); `extra_jobs` are exporters outside the metric contract
    (DCGM in the GPU overlays): job name -> host:port targets."""
    unknown = set(targets) - set(JOB_NAMES)
    if unknown:
        raise ValueError(f"unknown jobs {sorted(unknown)}; jobs are {list(JOB_NAMES)}")
    scrape_configs = []
    for job in JOBS:
        if job.name not in targets:
            continue
        value = targets[job.name]
        parsed = [_target(v) for v in ([value] if isinstance(value, str) else value)]
        if len({(scheme, path) for scheme, _, path in parsed}) != 1:
            raise ValueError(f"job {job.name}: every target needs the same scheme and metrics path: {value}")
        scheme, _, path = parsed[0]
        cfg = {"job_name": job.name}
        if scheme != "http":
            cfg["scheme"] = scheme
        if path != "/metrics":
            cfg["metrics_path"] = path
        cfg["static_configs"] = [{"targets": [hostport for _, hostport, _ in parsed]}]
        scrape_configs.append(cfg)
    config = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval,
                   "scrape_timeout": scrape_interval},
    }
    for name, hostports in (extra_jobs or {}).items():
        scrape_configs.append({"job_name": name, "static_configs": [{"targets": list(hostports)}]})
    if rule_files:
        config["rule_files"] = list(rule_files)
    config["scrape_configs"] = scrape_configs
    return config


def render_prometheus(targets: dict[str, str | list[str]], scrape_interval: str = "5s", header: str = "",
                      rule_files: tuple[str, ...] = (), extra_jobs: dict[str, list[str]] | None = None) -> str:
    import yaml

    body = yaml.safe_dump(prometheus_config(targets, scrape_interval, rule_files, extra_jobs), sort_keys=False,
                          default_flow_style=False)
    return header + body


def compose_targets() -> dict[str, str]:
    return {j.name: j.compose_target for j in JOBS}


# compose/overlays/pools.yaml: the pool members beside the base stack's, one service each (a member added there is
# added here, and `write` regenerates compose/prometheus/prometheus-pools.yml, which that overlay mounts).
PROMETHEUS_POOLS_YML = REPO / "compose" / "prometheus" / "prometheus-pools.yml"
COMPOSE_POOL_MEMBERS: dict[str, tuple[str, ...]] = {"prefill": ("prefill-2:8000",),
                                                    "decode-native": ("decode-native-2:8100",)}


def compose_pool_targets() -> dict[str, str | list[str]]:
    """The compose targets with every pool member of compose/overlays/pools.yaml a target of its job."""
    targets: dict[str, str | list[str]] = dict(compose_targets())
    for job, members in COMPOSE_POOL_MEMBERS.items():
        targets[job] = [compose_targets()[job], *members]
    return targets


def dev_targets(port_base: int = 0, host: str = "127.0.0.1") -> dict[str, str]:
    return {j.name: f"{host}:{j.dev_port + port_base}" for j in JOBS}


# GPU overlays: the same jobs plus NVIDIA's DCGM exporter (GPU metrics; port 9401).
PROMETHEUS_GPU_YML = REPO / "compose" / "prometheus" / "prometheus-gpu.yml"  # production: one per GPU node
PROMETHEUS_GPU_SINGLE_YML = REPO / "compose" / "prometheus" / "prometheus-gpu-single.yml"
DCGM_JOBS_PRODUCTION = {"dcgm": ["prefill:9401", "decode-native:9401", "decode-express:9401"]}
DCGM_JOBS_SINGLE = {"dcgm": ["dcgm-exporter:9401"]}

# Where compose mounts compose/prometheus/rules/ (alert and recording rules, tested with promtool).
COMPOSE_RULE_FILES = ("/etc/prometheus/rules/*.yml",)
RULES_DIR = REPO / "compose" / "prometheus" / "rules"

COMPOSE_HEADER = (
    "# GENERATED by `python scripts/dashboards.py write` from the JOBS table in scripts/dashboards.py.\n"
    "# Do not edit by hand. Local dev stack: `python scripts/dashboards.py render-prometheus --dev`.\n"
)

# ================================================================================================
# The metric contract: every name a dashboard may reference, its type, labels and exporting jobs.
# ================================================================================================


@dataclasses.dataclass(frozen=True)
class Metric:
    type: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    jobs: tuple[str, ...]
    # Where a job exports it only on some nodes (the live test on the CPU stack does not ask for it there)
    only: str = ""


def _m(type_: str, labels: str, jobs: str) -> Metric:
    return Metric(type_, tuple(labels.split()), tuple(jobs.split()))


# Our components' metrics are read from the code's own registries (never a hand-kept copy): the router's
# RouterMetrics and the decode node's DecodeMetrics built on a fresh registry (the router with the compose
# config, so every per-pool series exists), and the connector's METRICS table (connector/metric_table.py,
# standard library only, read by path so vLLM is not imported). The connector reports through vLLM's
# KV-connector stats interface, so its series are on the prefill's /metrics with vLLM's labels.
CONNECTOR_TABLE = REPO / "engine" / "src" / "expresslane" / "engine" / "connector" / "metric_table.py"
ROUTER_CONFIG = REPO / "compose" / "config" / "router.yaml"


def _registry_catalog(registry, job: str) -> dict[str, Metric]:
    out = {}
    for collector in list(registry._collector_to_names):
        names = getattr(collector, "_labelnames", None)
        for fam in collector.collect():
            labels = tuple(names) if names is not None else tuple(
                sorted({k for smp in fam.samples for k in smp.labels} - {"le"}))
            name = fam.name + "_total" if fam.type == "counter" else fam.name
            out[name] = Metric(fam.type, labels, (job,))
    return out


def _code_catalog() -> dict[str, Metric]:
    for src in (REPO / "engine" / "src", REPO / "router" / "src"):
        if str(src) not in sys.path:
            sys.path.insert(0, str(src))
    import importlib.util

    from prometheus_client import CollectorRegistry

    from expresslane.engine.decode.family import FAMILIES
    from expresslane.engine.decode.speculative import SpecStats, StepCosts
    from expresslane.engine.server.metrics import DecodeMetrics, SpeculationCollector
    from expresslane.router.config import load_config
    from expresslane.router.metrics import RouterMetrics

    router, decode = CollectorRegistry(), CollectorRegistry()
    RouterMetrics(load_config(ROUTER_CONFIG, {}), router)
    DecodeMetrics(decode)
    # the node's speculation counters, as a node whose costs are measured and that chooses a family per request
    # exports them (server/app.py registers this collector over its engine)
    decode.register(SpeculationCollector(SpecStats, 4, lambda: StepCosts((1, 2), (1.0, 1.1), (1.2, 1.3)),
                                         lambda: dict.fromkeys(FAMILIES, 0)))
    spec = importlib.util.spec_from_file_location("expresslane_connector_metric_table", CONNECTOR_TABLE)
    table = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = table  # dataclasses looks its module up
    spec.loader.exec_module(table)
    connector = {s.exposed_name: Metric(s.prom_type, ("model_name", "engine") + ((s.label,) if s.label else ()),
                                        ("prefill",)) for s in table.METRICS}
    decode_metrics = _registry_catalog(decode, "decode-express")
    family = "expresslane_decode_spec_family_requests_total"
    decode_metrics[family] = dataclasses.replace(
        decode_metrics[family], only="express nodes that choose a GEMV family per request (--lean-gemv per-request: "
                                     "a CUDA node's default for hidden size >= 4096)")
    return {**_registry_catalog(router, "router"), **decode_metrics, **connector}


_VLLM_JOBS = "prefill decode-native"
_VLLM_LABELS = "model_name engine"
# Exact names as vLLM 0.32 exports them (vllm/v1/metrics/loggers.py, .../kv_connector/v1/nixl/stats.py);
# the unit test greps the installed vLLM for each. NIXL transfer histograms are observed by the side that
# moves the bytes (the decode in vLLM's default pull mode); both sides export them (zeros on the other).
_VLLM = {
    "vllm:time_to_first_token_seconds": _m("histogram", _VLLM_LABELS, _VLLM_JOBS),
    "vllm:inter_token_latency_seconds": _m("histogram", _VLLM_LABELS, _VLLM_JOBS),
    "vllm:e2e_request_latency_seconds": _m("histogram", _VLLM_LABELS, _VLLM_JOBS),
    "vllm:request_queue_time_seconds": _m("histogram", _VLLM_LABELS, _VLLM_JOBS),
    "vllm:request_prefill_time_seconds": _m("histogram", _VLLM_LABELS, _VLLM_JOBS),
    "vllm:request_decode_time_seconds": _m("histogram", _VLLM_LABELS, _VLLM_JOBS),
    "vllm:kv_cache_usage_perc": _m("gauge", _VLLM_LABELS, _VLLM_JOBS),
    "vllm:num_requests_running": _m("gauge", _VLLM_LABELS, _VLLM_JOBS),
    "vllm:num_requests_waiting": _m("gauge", _VLLM_LABELS, _VLLM_JOBS),
    "vllm:prompt_tokens_total": _m("counter", _VLLM_LABELS, _VLLM_JOBS),
    "vllm:generation_tokens_total": _m("counter", _VLLM_LABELS, _VLLM_JOBS),
    "vllm:request_success_total": _m("counter", _VLLM_LABELS + " finished_reason", _VLLM_JOBS),
    "vllm:num_preemptions_total": _m("counter", _VLLM_LABELS, _VLLM_JOBS),
    "vllm:nixl_xfer_time_seconds": _m("histogram", _VLLM_LABELS, _VLLM_JOBS),
    "vllm:nixl_post_time_seconds": _m("histogram", _VLLM_LABELS, _VLLM_JOBS),
    "vllm:nixl_bytes_transferred": _m("histogram", _VLLM_LABELS, _VLLM_JOBS),
    "vllm:nixl_num_failed_transfers_total": _m("counter", _VLLM_LABELS, _VLLM_JOBS),
    "vllm:nixl_num_kv_expired_reqs_total": _m("counter", _VLLM_LABELS, _VLLM_JOBS),
}
_PROMETHEUS = {"up": _m("gauge", "", " ".join(JOB_NAMES))}  # synthesized by Prometheus per target

METRICS: dict[str, Metric] = {**_code_catalog(), **_VLLM, **_PROMETHEUS}
VLLM_METRICS = tuple(_VLLM)
GENERIC_LABELS = {"job", "instance"}

# ================================================================================================
# PromQL helpers. Timeseries panels use rate(...[$__rate_interval]); stat-like panels are instant
# queries over the whole dashboard range ($__range), so they keep their value when traffic stops.
# ================================================================================================
RI = "$__rate_interval"
RANGE = "$__range"


def _by(*labels: str) -> str:
    return ", ".join(labels)


def quantile(q: float, metric: str, by: tuple[str, ...] = (), window: str = RI, sel: str = "") -> str:
    fn = "rate" if window == RI else "increase"
    return f"histogram_quantile({q}, sum by ({_by('le', *by)}) ({fn}({metric}_bucket{sel}[{window}])))"


def rate(metric: str, by: tuple[str, ...] = (), sel: str = "", window: str = RI) -> str:
    fn = "rate" if window == RI else "increase"
    agg = f"sum by ({_by(*by)})" if by else "sum"
    return f"{agg} ({fn}({metric}{sel}[{window}]))"


def mean(metric: str, by: tuple[str, ...] = (), window: str = RI) -> str:
    """Mean of a histogram's observations: sum / count."""
    return f"{rate(metric + '_sum', by, window=window)} / {rate(metric + '_count', by, window=window)}"


def ratio(num: str, den: str, by: tuple[str, ...] = (), window: str = RI) -> str:
    return f"{rate(num, by, window=window)} / {rate(den, by, window=window)}"


def or_zero(expr: str) -> str:
    """For failure counters whose labelled series appear only on the first failure: show 0, not No data.
    The live test separately checks that the metric itself is exported (target metadata)."""
    return f"({expr}) or on() vector(0)"


# ================================================================================================
# Panel / dashboard builders (plain dicts; Grafana schemaVersion 39).
# ================================================================================================
DS = {"type": "prometheus", "uid": "${datasource}"}
TOKS = "suffix: tok/s"
INSTANT_TYPES = {"stat", "bargauge", "piechart", "table"}


@dataclasses.dataclass
class T:
    """One query of a panel."""

    expr: str
    legend: str = ""
    # True where a healthy smoke run may leave every value at 0 (failure counters, sampled gauges): the live
    # test then accepts a flat zero; everywhere else it demands a non-zero value (the metric moved).
    zero_ok: bool = False


def Z(expr: str, legend: str = "") -> T:
    return T(expr, legend, zero_ok=True)


@dataclasses.dataclass
class P:
    """One panel: type, title, unit, queries, and what it means (goes into the docs table)."""

    type: str
    title: str
    unit: str
    targets: list[T]
    meaning: str
    w: int = 12
    h: int = 8
    stack: bool = False
    max: float | None = None


@dataclasses.dataclass
class Row:
    title: str


def ts(title, unit, targets, meaning, **kw) -> P:
    return P("timeseries", title, unit, targets, meaning, **kw)


def stat(title, unit, targets, meaning, **kw) -> P:
    kw.setdefault("w", 6)
    kw.setdefault("h", 5)
    return P("stat", title, unit, targets, meaning, **kw)


def bars(title, unit, targets, meaning, **kw) -> P:
    kw.setdefault("w", 8)
    return P("bargauge", title, unit, targets, meaning, **kw)


def pie(title, unit, targets, meaning, **kw) -> P:
    kw.setdefault("w", 6)
    kw.setdefault("h", 5)
    return P("piechart", title, unit, targets, meaning, **kw)


def _panel_json(p: P, pid: int, x: int, y: int) -> dict:
    instant = p.type in INSTANT_TYPES
    targets = []
    for i, t in enumerate(p.targets):
        targets.append({
            "refId": chr(ord("A") + i),
            "datasource": dict(DS),
            "editorMode": "code",
            "expr": t.expr,
            "legendFormat": t.legend or "__auto",
            "instant": instant,
            "range": not instant,
        })
    defaults: dict = {"unit": p.unit}
    if p.max is not None:
        defaults.update(min=0, max=p.max)
    options: dict
    if p.type == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "auto", "spanNulls": True,
            "stacking": {"mode": "normal" if p.stack else "none", "group": "A"},
        }
        options = {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                              "calcs": ["lastNotNull", "max"]},
                   "tooltip": {"mode": "multi", "sort": "desc"}}
    elif p.type == "stat":
        defaults["color"] = {"mode": "thresholds"}
        defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": "green", "value": None}]}
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "colorMode": "value", "graphMode": "none", "textMode": "value_and_name", "orientation": "auto",
                   "justifyMode": "auto"}
    elif p.type == "bargauge":
        defaults["color"] = {"mode": "palette-classic"}
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "displayMode": "gradient", "orientation": "horizontal", "showUnfilled": True}
    elif p.type == "piechart":
        defaults["color"] = {"mode": "palette-classic"}
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "pieType": "donut", "legend": {"displayMode": "table", "placement": "right", "showLegend": True,
                                                  "values": ["value", "percent"]}}
    else:
        raise ValueError(f"unsupported panel type {p.type}")
    return {
        "id": pid,
        "type": p.type,
        "title": p.title,
        "description": p.meaning,
        "datasource": dict(DS),
        "gridPos": {"h": p.h, "w": p.w, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": targets,
    }


@dataclasses.dataclass(frozen=True)
class Built:
    json: dict
    zero_ok: frozenset[tuple[str, str]]  # (panel title, refId) of targets that may stay at 0


def dashboard(uid: str, title: str, description: str, items: list, tags: tuple[str, ...] = ()) -> Built:
    zero_ok = frozenset((i.title, chr(ord("A") + n)) for i in items if isinstance(i, P)
                        for n, t in enumerate(i.targets) if t.zero_ok)
    panels, pid, x, y, row_h = [], 1, 0, 0, 0
    for item in items:
        if isinstance(item, Row):
            y, x, row_h = y + row_h, 0, 0
            panels.append({"id": pid, "type": "row", "title": item.title, "collapsed": False, "panels": [],
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
            y += 1
        else:
            if x + item.w > 24:
                y, x, row_h = y + row_h, 0, 0
            panels.append(_panel_json(item, pid, x, y))
            x += item.w
            row_h = max(row_h, item.h)
        pid += 1
    return Built({
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["expresslane", *tags],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "tags": ["expresslane"], "asDropdown": True, "title": "expresslane",
                   "includeVars": False, "keepTime": True}],
        "templating": {"list": [{
            "name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "refresh": 1, "regex": "", "includeAll": False, "multi": False,
            "options": [], "skipUrlSync": False,
        }]},
        "panels": panels,
    }, zero_ok)


# ================================================================================================
# The dashboards.
# ================================================================================================
R = "expresslane_router_"
D = "expresslane_decode_"
S = "expresslane_decode_spec_"
C = "expresslane_connector_"
NON_2XX = '{status!~"2.."}'
VLLM_SEL = '{job=~"prefill|decode-native"}'


def _p50_p95(metric: str, by: tuple[str, ...], legend: str, sel: str = "") -> list[T]:
    return [T(quantile(0.5, metric, by, sel=sel), f"{legend} p50"),
            T(quantile(0.95, metric, by, sel=sel), f"{legend} p95")]


def lanes_overview() -> Built:
    lane = ("lane",)
    items = [
        Row("At a glance (whole time range)"),
        stat("Requests by lane", "short", [T(rate(R + "requests_total", lane, window=RANGE), "{{lane}}")],
             "Client requests finished per lane over the selected range (lane=none: rejected before routing).",
             w=5),
        stat("Error ratio", "percentunit",
             [Z(f"({or_zero(rate(R + 'requests_total', sel=NON_2XX, window=RANGE))}) / "
                f"{rate(R + 'requests_total', window=RANGE)}", "non-2xx")],
             "Share of client requests answered with a non-2xx HTTP status over the range.", w=3),
        stat("TTFT p50", "s", [T(quantile(0.5, R + "time_to_first_token_seconds", lane, RANGE), "{{lane}}")],
             "Median time to first token per lane over the range, as the client sees it (router).", w=4),
        stat("ITL p50", "s", [T(quantile(0.5, R + "inter_token_latency_seconds", lane, RANGE), "{{lane}}")],
             "Median gap between streamed token chunks per lane over the range.", w=4),
        stat("User tokens/s p50", TOKS,
             [T(quantile(0.5, R + "user_tokens_per_second", lane, RANGE), "{{lane}}")],
             "Median per-request decode speed per lane over the range (tokens after the first / time after it).",
             w=4),
        pie("Traffic split", "short", [T(rate(R + "requests_total", lane, window=RANGE), "{{lane}}")],
            "Share of client requests per lane over the range.", w=4),
        Row("Latency and speed per lane"),
        ts("Time to first token", "s", _p50_p95(R + "time_to_first_token_seconds", lane, "{{lane}}"),
           "Router-measured TTFT per lane (arrival to first streamed token), p50 and p95.", w=8),
        ts("Inter-token latency", "s", _p50_p95(R + "inter_token_latency_seconds", lane, "{{lane}}"),
           "Router-measured gap between streamed token chunks per lane, p50 and p95.", w=8),
        ts("End-to-end latency", "s", _p50_p95(R + "e2e_request_latency_seconds", lane, "{{lane}}"),
           "Arrival to last byte per lane, p50 and p95.", w=8),
        ts("User tokens/s per request", TOKS, _p50_p95(R + "user_tokens_per_second", lane, "{{lane}}"),
           "Per-request decode speed per lane, p50 and p95: what one user sees.", w=12),
        ts("Generated tokens/s (all requests)", TOKS,
           [T(rate(R + "generated_tokens_total", lane), "{{lane}}")],
           "Aggregate completion tokens per second returned to clients, per lane.", w=12),
        Row("Health and failover"),
        stat("Upstream nodes serving", "bool_on_off",
             [T(f"max by (lane, pool, node) ({R}upstream_healthy)", "{{lane}} {{node}}")],
             "1 per decode/prefill node the router's health monitor keeps in rotation, 0 while it is ejected.",
             w=6, h=8),
        ts("Ejections/s", "reqps",
           [Z(or_zero(rate(R + "upstream_ejections_total", ("lane", "node", "reason"))),
              "{{lane}} {{node}} {{reason}}")],
           "Nodes taken out of rotation per second, by lane, node and reason (0 when none).", w=6),
        ts("Lane failovers/s", "reqps",
           [Z(or_zero(rate(R + "failovers_total", ("from_lane", "to_lane", "reason"))),
              "{{from_lane}} -> {{to_lane}} {{reason}}")],
           "Requests moved to another lane before their first token, per second, by reason (0 when none).", w=6),
        ts("Mid-stream failovers and retries/s", "reqps",
           [Z(or_zero(rate(R + "midstream_failovers_total", ("pool", "outcome"))), "mid-stream {{pool}} {{outcome}}"),
            Z(or_zero(rate(R + "retries_total", ("lane", "pool", "reason"))), "retry {{lane}} {{pool}} {{reason}}")],
           "Streams resumed on another node after tokens had flowed (by outcome), and native retries on another "
           "node (by reason), per second (0 when none).", w=6),
        ts("Outlier detection decisions/s", "reqps",
           [Z(or_zero(rate(R + "outlier_decisions_total", ("pool", "node", "decision", "reason"))),
              "{{pool}} {{node}} {{decision}} {{reason}}")],
           "Outlier detection per pool (router fleet/outlier.py), per second: eject (the rule that tripped), keep (a "
           "rule tripped but a guard refused: the pool's last serving node, max_ejection_percent; once per node and "
           "interval), readmit (ejection time over, or a passing probe). 0 when none.", w=12),
        ts("Health probes/s", "reqps",
           [Z(or_zero(rate(R + "health_probes_total", ("lane", "result"))), "{{lane}} {{result}}")],
           "Active health checks per second by result: passed, failed, slow (no answer in time from a node that "
           "showed life on the request path: neither).", w=4),
        ts("Pools in panic", "bool_on_off", [Z(f"max by (pool) ({R}pool_panic)", "{{pool}}")],
           "1 while too few of a pool's members are healthy and not ejected: it routes to all of them.", w=4,
           max=1),
        ts("Router saturated/s", "reqps",
           [Z(or_zero(rate(R + "upstream_pool_saturated_total", ("client",))), "{{client}}")],
           "Upstream calls the router refused itself (503 router_saturated): its own pool had no free connection "
           "(never counted against a node). 0 when none.", w=4),
        ts("Router event loop lag", "s",
           [T(quantile(0.99, R + "event_loop_lag_seconds", ("instance",)), "p99 {{instance}}")],
           "How late each router's event loop ran a 0.5 s timer (router server/loop_lag.py), p99: near 0 when "
           "healthy. A lag delays every timeout and stall window of that moment by as much: an upstream error beside "
           "it is the router's (a blocked loop) or its host's (no CPU), not the node's.", w=6),
        Row("Pools"),
        stat("Pool members", "short", [T(f"max by (pool) ({R}pool_members)", "{{pool}}")],
             "Current members of each pool (prefill, native and express pools): static nodes plus the addresses "
             "their DNS name resolves to (router discovery.py).", w=6, h=8),
        ts("Prefill legs/s by member", "reqps",
           [T(rate(R + "prefill_requests_total", ("member", "choice")), "{{member}} {{choice}}")],
           "Prefill legs sent to each prefill pool member per second, by why it was chosen: affinity (the prompt's "
           "prefix hash), least_loaded (the preferred member was busy or down), retry (another member failed).",
           w=8),
        ts("Prefill legs in flight by member", "short",
           [Z(f"max by (member) ({R}prefill_inflight)", "{{member}}")],
           "Prefill legs in flight on each prefill pool member (the balance the least-loaded fallback reads).",
           w=5),
        ts("Pool DNS failures/s", "reqps",
           [Z(or_zero(rate(R + "pool_dns_failures_total", ("pool",))), "{{pool}}")],
           "Failed DNS resolutions of a pool's name per second (the pool kept its last answer); 0 when none.",
           w=5),
        Row("Traffic and errors"),
        ts("Requests/s by lane and status", "reqps",
           [T(rate(R + "requests_total", ("lane", "status")), "{{lane}} {{status}}")],
           "Finished client requests per second by lane and HTTP status.", w=12),
        ts("Non-2xx responses/s", "reqps",
           [Z(or_zero(rate(R + "requests_total", ("lane", "alias", "status"), sel=NON_2XX)),
              "{{lane}} {{alias}} {{status}}")],
           "Client requests answered with an error status, per second (0 when there were none).", w=12),
        bars("Errors since process start", "short",
             [T(or_zero(f"sum by (lane, alias, status) ({R}requests_total{NON_2XX})"),
                "{{lane}} {{alias}} {{status}}")],
             "Raw non-2xx counters since the router started: a single error is visible here even when rate() "
             "cannot see it (a series created by its first increment).", w=8),
        ts("Upstream errors/s", "reqps",
           [Z(or_zero(rate(R + "upstream_errors_total", ("lane", "stage", "type"))),
              "{{lane}} {{stage}} {{type}}")],
           "Failed router-to-upstream calls per second by lane, stage (prefill/decode) and error type.", w=8),
        stat("Scrape targets up", "bool_on_off",
             [T('up{job=~"router|prefill|decode-native|decode-express"}', "{{job}}")],
             "Whether Prometheus reached each component's /metrics on its last scrape.", w=8, h=8),
    ]
    return dashboard("expresslane-lanes", "expresslane / Lanes overview",
                     "Native vs express lane side by side, as the client sees them through the router.",
                     items, ("overview",))


def express_lane() -> Built:
    items = [
        Row("Express pool (router)"),
        ts("Decode node full", "bool_on_off", [Z(f"max by (instance) ({D}busy)", "{{instance}}")],
           "1 while every seat of the express decode node is held (a TileRT node has one seat).", w=6, max=1),
        ts("In-flight requests per node", "short",
           [Z(f"sum by (pool, node) ({R}inflight_requests)", "{{pool}} {{node}}")],
           "Requests the router has in flight per decode node (an express node: its busy seats).", w=6),
        ts("Express seats", "short",
           [Z(f"sum by (pool) ({R}express_seats)", "{{pool}} seats"),
            Z(f"sum by (pool) ({R}express_seats_busy)", "{{pool}} busy")],
           "Seats of each express pool's nodes (each node's /capabilities seats; 1 until known) and how many the "
           "router holds.", w=6),
        ts("Queue depth", "short", [Z(f"sum by (pool) ({R}queue_depth)", "{{pool}}")],
           "Express requests waiting for a free seat, per pool.", w=6),
        ts("Queue wait", "s", _p50_p95(R + "queue_wait_seconds", (), "wait"),
           "Time express requests waited for a node, p50 and p95.", w=8),
        ts("Rejected/s", "reqps",
           [Z(or_zero(rate(R + "rejected_total", ("pool", "reason"))), "{{pool}} {{reason}}")],
           "Express requests refused with 429 per second, by pool and reason (queue_full, queue_timeout, ...).",
           w=8),
        ts("Spillover/s", "reqps",
           [Z(or_zero(rate(R + "spillover_total", ("from_pool", "to_pool"))), "{{from_pool}} -> {{to_pool}}")],
           "Express requests served by their spill pool per second.", w=8),
        Row("Express decode server"),
        ts("Node healthy", "bool_on_off", [Z(f"min by (instance) ({D}healthy)", "{{instance}}")],
           "1 while the node's /health passes every check (engine, control plane, NIXL).", w=12, max=1),
        ts("Reservations/s by outcome", "reqps",
           [Z(or_zero(rate(D + "reservations_total", ("outcome",))), "{{outcome}}")],
           "POST /pd/reserve per second by outcome (reserved, busy, not_ready, expired, ...).", w=12),
        stat("Decode requests by status", "short",
             [T(rate(D + "requests_total", ("status",), window=RANGE), "{{status}}")],
             "Requests the decode server finished over the range, by status.", w=6),
        stat("Cancellations / KV timeouts", "short",
             [Z(rate(D + "cancellations_total", window=RANGE), "cancelled"),
              Z(rate(D + "kv_timeouts_total", window=RANGE), "KV timeout")],
             "Requests cancelled by the client, and requests whose KV never arrived, over the range.", w=6),
        stat("Handoff p50", "s", [T(quantile(0.5, D + "handoff_seconds", window=RANGE), "handoff")],
             "Median KV handoff time over the range (prefill done to KV resident on the node).", w=6),
        stat("Decode tokens/s p50", TOKS, [T(quantile(0.5, D + "tokens_per_second", window=RANGE), "tok/s")],
             "Median per-request decode speed of the node over the range.", w=6),
        ts("Phase breakdown (mean)", "s",
           [T(mean(D + "phase_seconds", ("phase",)), "{{phase}}")],
           "Mean time per request in each phase: wire_wait (KV on the wire), convert, inject, decode. Stacked.",
           stack=True),
        bars("Phase breakdown over the range (mean)", "s",
             [T(mean(D + "phase_seconds", ("phase",), window=RANGE), "{{phase}}")],
             "Mean time per request in each phase over the whole range.", w=12),
        ts("Handoff time", "s", _p50_p95(D + "handoff_seconds", (), "handoff"),
           "KV handoff time per request as the decode server measures it, p50 and p95.", w=8),
        ts("Handoff throughput", "GBs", _p50_p95(D + "handoff_throughput_gigabytes_per_second", (), "GB/s"),
           "KV bytes / handoff time per request, p50 and p95.", w=8),
        ts("Received KV bytes/s", "Bps", [T(rate(D + "handoff_bytes_total"), "KV in")],
           "KV bytes arriving at the decode node per second.", w=8),
        ts("Decode tokens/s per request", TOKS, _p50_p95(D + "tokens_per_second", (), "tok/s"),
           "Per-request decode speed of the node, p50 and p95.", w=12),
        ts("Generated tokens/s and requests/s", TOKS,
           [T(rate(D + "generated_tokens_total"), "tokens/s"),
            T(rate(D + "requests_total", ("status",)), "requests/s {{status}}")],
           "Tokens the node generates per second and the requests it finishes per second by status.", w=12),
        Row("Seats (express decode server)"),
        ts("Seats held", "short",
           [Z(f"sum by (instance) ({D}seats_busy)", "{{instance}} held"),
            Z(f"sum by (instance) ({D}seats)", "{{instance}} seats")],
           "Requests the node holds (reserved, waiting for KV, injecting, decoding) against its seats: each "
           "seat decodes one user, all of them in one forward a step.", w=8),
        ts("Rows per decode step", "short",
           [Z(or_zero(mean(D + "step_rows")), "mean"), T(quantile(0.95, D + "step_rows"), "p95")],
           "Rows of each forward: every active user's token plus the drafts it verifies. Rows of several users "
           "share one read of the weights.", w=8),
        ts("Decode step time by rows (mean)", "s",
           [Z(or_zero(mean(D + "step_seconds", ("rows",))), "{{rows}} rows")],
           "Wall time of one decode step (forward, sampling, emission) by its row count: what each user's "
           "token costs at that width.", w=8),
        Row("Speculation (express decode server)"),
        ts("Tokens from accepted drafts", "percentunit",
           [Z(or_zero(f"{rate(S + 'accepted_tokens_total')} / ({rate(S + 'accepted_tokens_total')} + "
                      f"{rate(S + 'verify_steps_total')} + {rate(S + 'plain_steps_total')} > 0)"), "share")],
           "The share of generated tokens that were accepted drafts: the forwards speculation saved. Near 0 on "
           "text that never repeats (the drafter then takes plain steps), high on code edits and agentic loops.",
           w=8, max=1),
        ts("Drafts kept per verify step", "short",
           [Z(or_zero(f"{rate(S + 'accepted_per_verify_step_sum')} / "
                      f"({rate(S + 'accepted_per_verify_step_count')} > 0)"), "mean")],
           "Mean draft tokens a verify forward kept (0 .. k): what a verify earns beyond its own token.", w=8),
        ts("Forwards/s: verify and plain", "short",
           [Z(rate(S + "verify_steps_total"), "verify"), T(rate(S + "plain_steps_total"), "plain")],
           "Decode forwards per second that verified drafts, and plain one-token forwards.", w=8),
        ts("Drafted and accepted tokens/s", TOKS,
           [Z(rate(S + "drafted_tokens_total"), "drafted"), Z(rate(S + "accepted_tokens_total"), "accepted")],
           "Draft tokens proposed (prompt lookup) and kept per second.", w=8),
        ts("Requests/s by GEMV family", "reqps",
           [Z(or_zero(rate(S + "family_requests_total", ("family",))), "{{family}}")],
           "Requests per second by the lean-step GEMV family they ran, on a node that chooses one per request "
           "from the prompt (--lean-gemv per-request; a CUDA node's default for hidden size >= 4096): "
           "tensor-core for prompts that repeat, cuda-core for the rest. 0 on nodes with one family.", w=8),
        bars("Forward cost by rows (warm-up)", "s",
             [T(f"max by (rows, context_tokens) ({S}step_seconds)", "{{rows}} rows @ {{context_tokens}}")],
             "What a forward of 1 .. k + 1 rows cost when the node measured it at warm-up, near the start and the "
             "end of its cache: the costs the drafter weighs a verify by (the default family's).", w=8),
    ]
    return dashboard("expresslane-express", "expresslane / Express lane",
                     "The express decode node and its pool: occupancy, queue, handoff breakdown, speed, speculation.",
                     items, ("express",))


def native_lane() -> Built:
    by = ("job",)
    sel = VLLM_SEL
    items = [
        Row("At a glance (whole time range)"),
        stat("Requests finished", "short",
             [T(rate("vllm:request_success_total", ("job", "finished_reason"), sel, RANGE),
                "{{job}} {{finished_reason}}")],
             "Requests vLLM finished over the range, per server and finish reason (the prefill leg finishes "
             "with length after its single token).", w=8),
        stat("TTFT p50", "s",
             [T(quantile(0.5, "vllm:time_to_first_token_seconds", by, RANGE, sel), "{{job}}")],
             "Median time to first token inside each vLLM server over the range.", w=8),
        stat("Preemptions", "short",
             [Z(rate("vllm:num_preemptions_total", by, sel, RANGE), "{{job}}")],
             "Requests preempted (KV cache pressure) over the range.", w=8),
        Row("Load"),
        ts("Running requests", "short",
           [Z(f"sum by (job, instance) (vllm:num_requests_running{sel})", "{{job}} {{instance}}")],
           "Requests in the running batch of each vLLM server.", w=8),
        ts("Waiting requests", "short",
           [Z(f"sum by (job, instance) (vllm:num_requests_waiting{sel})", "{{job}} {{instance}}")],
           "Requests queued in each vLLM server's scheduler.", w=8),
        ts("KV cache usage", "percentunit",
           [Z(f"max by (job, instance) (vllm:kv_cache_usage_perc{sel})", "{{job}} {{instance}}")],
           "Fraction of KV cache blocks in use per server (1 = full).", w=8, max=1),
        ts("Prompt tokens/s", TOKS, [T(rate("vllm:prompt_tokens_total", by, sel), "{{job}}")],
           "Prompt tokens processed per second (the prefill server does the real prefill; a native decode "
           "counts the prompt it received KV for).", w=12),
        ts("Generation tokens/s", TOKS, [T(rate("vllm:generation_tokens_total", by, sel), "{{job}}")],
           "Tokens generated per second per server (the prefill generates one per request).", w=12),
        Row("Latency inside vLLM"),
        ts("Time to first token", "s",
           _p50_p95("vllm:time_to_first_token_seconds", by, "{{job}}", sel),
           "vLLM-measured TTFT per server, p50 and p95.", w=8),
        ts("Inter-token latency", "s",
           _p50_p95("vllm:inter_token_latency_seconds", by, "{{job}}", sel),
           "vLLM-measured inter-token latency per server, p50 and p95 (the native decode server's is the "
           "native lane's ITL; the prefill emits one token).", w=8),
        ts("End-to-end latency", "s",
           _p50_p95("vllm:e2e_request_latency_seconds", by, "{{job}}", sel),
           "vLLM-measured request latency per server, p50 and p95.", w=8),
        ts("Queue time p50", "s",
           [T(quantile(0.5, "vllm:request_queue_time_seconds", by, sel=sel), "{{job}}")],
           "Median time requests waited in vLLM's scheduler queue per server.", w=12),
        ts("Prefill and decode time p50", "s",
           [T(quantile(0.5, "vllm:request_prefill_time_seconds", by, sel=sel), "{{job}} prefill"),
            T(quantile(0.5, "vllm:request_decode_time_seconds", by, sel=sel), "{{job}} decode")],
           "Median time requests spent in the prefill and in the decode phase, per server.", w=12),
    ]
    return dashboard("expresslane-native", "expresslane / Native lane (vLLM)",
                     "The stock vLLM servers: the prefill server (both lanes) and the native decode server.",
                     items, ("native", "vllm"))


def kv_handoff() -> Built:
    nixl_tput = ratio("vllm:nixl_bytes_transferred_sum", "vllm:nixl_xfer_time_seconds_sum")
    express_tput = ratio(D + "handoff_bytes_total", D + "handoff_seconds_sum")
    items = [
        Row("Both paths (whole time range)"),
        stat("Handoff throughput", "Bps",
             [T(ratio(D + "handoff_bytes_total", D + "handoff_seconds_sum", window=RANGE), "express"),
              T(ratio("vllm:nixl_bytes_transferred_sum", "vllm:nixl_xfer_time_seconds_sum", window=RANGE),
                "native (NIXL)")],
             "KV bytes moved / time spent moving them, over the range: express handoff vs vLLM NIXL transfers.",
             w=8),
        stat("KV bytes per request", "bytes",
             [T(ratio(D + "handoff_bytes_total", D + "handoff_seconds_count", window=RANGE), "express"),
              T(ratio("vllm:nixl_bytes_transferred_sum", "vllm:nixl_bytes_transferred_count", window=RANGE),
                "native (NIXL)")],
             "Mean KV bytes per handoff (express) and per NIXL transfer (native) over the range.", w=8),
        stat("Mean handoff time", "s",
             [T(mean(D + "handoff_seconds", window=RANGE), "express"),
              T(mean("vllm:nixl_xfer_time_seconds", window=RANGE), "native (NIXL)")],
             "Mean time per handoff (express) and per NIXL transfer (native) over the range.", w=8),
        ts("Handoff throughput, both paths", "Bps",
           [T(express_tput, "express (decode server)"), T(nixl_tput, "native (NIXL)")],
           "Bytes per second of transfer time on each path.", w=12),
        ts("KV bytes/s, both paths", "Bps",
           [T(rate(C + "sent_bytes_total"), "express sent (connector)"),
            T(rate(D + "handoff_bytes_total"), "express received (decode)"),
            T(rate("vllm:nixl_bytes_transferred_sum"), "native (NIXL)")],
           "KV bytes moved per second on each path.", w=12),
        Row("Express path: connector (inside the prefill)"),
        ts("Claimed vs unclaimed requests/s", "reqps",
           [T(rate(C + "claimed_requests_total"), "claimed (express)"),
            T(rate(C + "unclaimed_requests_total"), "unclaimed (native)")],
           "Prefill requests the connector claimed for the express lane vs passed through.", w=8),
        ts("Staging copy time", "s", _p50_p95(C + "staging_copy_seconds", (), "copy"),
           "Time to copy a finished prompt's KV blocks into the staging buffer (inside the forward window).",
           w=8),
        ts("Staging bytes/s", "Bps",
           [T(rate(C + "staging_bytes_total"), "bytes"), T(rate(C + "staging_copies_total"), "copies/s")],
           "KV bytes (and copies) per second into the staging buffer.", w=8),
        ts("Send time", "s", _p50_p95(C + "send_seconds", (), "send"),
           "Staged to acked by the decode node (queue, control, NIXL WRITE) per request, p50 and p95.", w=6),
        ts("Send throughput", "Bps",
           [T(ratio(C + "sent_bytes_total", C + "send_seconds_sum"), "sent bytes / send time")],
           "Connector-side KV bytes per second of send time.", w=6),
        ts("Sends and send failures/s", "reqps",
           [T(rate(C + "sent_requests_total"), "sent"),
            Z(or_zero(rate(C + "send_failures_total", ("reason",))), "failed {{reason}}")],
           "Requests whose KV was sent per second, and failed sends by reason (0 when none).", w=6),
        ts("Free staging slots", "short",
           [T(f"sum by (instance, rank) ({C}staging_slots_free)", "{{instance}} rank {{rank}}")],
           "Staging buffer slots free per prefill TP rank; 0 means a claimed request finds no slot and fails "
           "(no_staging_slot).", w=6),
        ts("Staging slots in use", "short",
           [Z(f"sum by (instance, rank) ({C}staging_slots_in_use)", "{{instance}} rank {{rank}}")],
           "Staging buffer slots holding a request's KV per prefill TP rank (0 when idle).", w=8),
        ts("Send aborts/s", "reqps",
           [Z(or_zero(rate(C + "send_aborts_total", ("reason",))), "{{reason}}")],
           "Background sends given up after the claim and reported to the node as an abort frame, by reason.",
           w=8),
        ts("Refused destinations/s", "reqps",
           [Z(or_zero(rate(C + "refused_destinations_total")), "refused")],
           "Claims whose express destination is outside EXPRESSLANE_ALLOWED_DESTINATIONS (never contacted).", w=8),
        Row("Express path: decode server"),
        ts("Handoff time (decode side)", "s", _p50_p95(D + "handoff_seconds", (), "handoff"),
           "Handoff time per request measured on the decode node, p50 and p95.", w=8),
        ts("Handoff GB/s (decode side)", "GBs",
           _p50_p95(D + "handoff_throughput_gigabytes_per_second", (), "GB/s"),
           "Per-request handoff throughput measured on the decode node, p50 and p95.", w=8),
        ts("Wire wait", "s",
           [T(quantile(0.5, D + "phase_seconds", ("phase",), sel='{phase="wire_wait"}'), "wire_wait p50")],
           "Median time the decode node waited for KV bytes on the wire.", w=8),
        ts("KV transfer failures/s (decode side)", "reqps",
           [Z(or_zero(rate(D + "kv_transfer_failures_total", ("reason",))), "{{reason}}")],
           "Handoffs the decode node's KV receiver failed, by reason (aborted by the prefill, sender vanished, "
           "checksum mismatch, ...); 0 when none.", w=24),
        Row("Native path: vLLM NIXL"),
        ts("NIXL transfer time", "s", _p50_p95("vllm:nixl_xfer_time_seconds", ("job",), "{{job}}"),
           "Duration of NIXL KV transfers, p50 and p95, on the side that moves the bytes (the decode server "
           "in vLLM's pull mode).", w=8),
        ts("NIXL post time p50", "s",
           [T(quantile(0.5, "vllm:nixl_post_time_seconds", ("job",)), "{{job}}")],
           "Median time to post a NIXL transfer.", w=8),
        ts("NIXL bytes per transfer p50", "bytes",
           [T(quantile(0.5, "vllm:nixl_bytes_transferred", ("job",)), "{{job}}")],
           "Median KV bytes per NIXL transfer.", w=8),
        ts("NIXL throughput", "Bps", [T(nixl_tput, "NIXL")],
           "NIXL bytes per second of transfer time.", w=12),
        stat("NIXL failures / expired KV", "short",
             [Z(rate("vllm:nixl_num_failed_transfers_total", window=RANGE), "failed transfers"),
              Z(rate("vllm:nixl_num_kv_expired_reqs_total", window=RANGE), "KV expired")],
             "Failed NIXL transfers (incl. handshakes, notifications) and requests whose KV lease expired "
             "before decode read it, over the range.", w=12, h=8),
    ]
    return dashboard("expresslane-kv-handoff", "expresslane / KV handoff",
                     "Moving KV from prefill to decode on both paths: express (connector -> decode node) and "
                     "native (vLLM NIXL).", items, ("kv",))


BUILDERS = {
    "lanes-overview.json": lanes_overview,
    "express-lane.json": express_lane,
    "native-lane.json": native_lane,
    "kv-handoff.json": kv_handoff,
}


def build_dashboards() -> dict[str, dict]:
    return {name: fn().json for name, fn in BUILDERS.items()}


def zero_ok_targets() -> set[tuple[str, str, str]]:
    """(dashboard uid, panel title, refId) of the queries a healthy smoke run may leave at 0."""
    out = set()
    for fn in BUILDERS.values():
        built = fn()
        out |= {(built.json["uid"], title, ref) for title, ref in built.zero_ok}
    return out


def dump(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=False) + "\n"


def load_committed() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


# ================================================================================================
# Queries: every panel target, with Grafana's variables substituted for a plain Prometheus.
# ================================================================================================


@dataclasses.dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    panel_type: str
    ref: str
    expr: str  # as in the dashboard (Grafana variables)
    instant: bool
    zero_ok: bool = False  # a healthy smoke run may leave it at 0 (see T.zero_ok)

    def substituted(self, rate_interval: str, rng: str, interval: str | None = None) -> str:
        return substitute(self.expr, rate_interval=rate_interval, rng=rng, interval=interval or rate_interval)


def substitute(expr: str, *, rate_interval: str, rng: str, interval: str) -> str:
    out = expr.replace("$__rate_interval", rate_interval).replace("$__range", rng).replace("$__interval", interval)
    if "$" in out:
        raise ValueError(f"unsubstituted variable in {out!r}")
    return out


def iter_queries(dashboards: dict[str, dict] | None = None) -> list[Query]:
    dashboards = dashboards if dashboards is not None else load_committed()
    zero_ok = zero_ok_targets()
    out = []
    for dash in dashboards.values():
        for panel in dash["panels"]:
            for t in panel.get("targets", []):
                out.append(Query(dash["uid"], panel["title"], panel["type"], t["refId"], t["expr"],
                                 bool(t.get("instant")), (dash["uid"], panel["title"], t["refId"]) in zero_ok))
    return out


def grafana_rate_interval(step_s: float, scrape_s: float) -> str:
    """What Grafana substitutes for $__rate_interval: max($__interval + scrape interval, 4 * scrape interval)."""
    return f"{int(math.ceil(max(step_s + scrape_s, 4 * scrape_s)))}s"


# ================================================================================================
# Lint: offline checks shared by the CLI and tests/unit/test_dashboards_lint.py.
# ================================================================================================
_NAME_RE = re.compile(r"(?<![A-Za-z0-9_:])(expresslane_[a-z0-9_]+|vllm:[a-z0-9_:]+|up)(?![A-Za-z0-9_:])(\{[^}]*\})?")
_MATCHER_RE = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*\"")
_BY_RE = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_RATE_RE = re.compile(r"\b(rate|irate|increase)\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)")
_HIST_SUFFIXES = ("_bucket", "_sum", "_count")
GRAFANA_UNITS = {"s", "ms", "short", "none", "reqps", "ops", "Bps", "GBs", "bytes", "percentunit", "bool_on_off"}


def resolve_metric(name: str) -> tuple[str, str] | None:
    """Series name -> (contract name, series kind: value|bucket|sum|count), or None if unknown."""
    if name in METRICS:
        return name, "value"
    for suf in _HIST_SUFFIXES:
        if name.endswith(suf) and METRICS.get(name[: -len(suf)], Metric("", (), ())).type == "histogram":
            return name[: -len(suf)], suf[1:]
    return None


def metrics_in(expr: str) -> list[tuple[str, str]]:
    """[(series name, selector braces or '')] referenced by a PromQL expression."""
    return [(m.group(1), m.group(2) or "") for m in _NAME_RE.finditer(expr)]


def lint_expr(expr: str, instant: bool) -> list[str]:
    errs = []
    refs = metrics_in(expr)
    if not refs:
        errs.append("references no known metric")
    allowed = set(GENERIC_LABELS)
    for series, sel in refs:
        r = resolve_metric(series)
        if r is None:
            errs.append(f"unknown metric {series!r} (not in the contract / vLLM names)")
            continue
        base, kind = r
        metric = METRICS[base]
        if metric.type == "histogram" and kind == "value":
            errs.append(f"histogram {base!r} used without _bucket/_sum/_count")
        allowed |= set(metric.labels) | ({"le"} if kind == "bucket" else set())
        for label, _ in _MATCHER_RE.findall(sel):
            if label not in set(metric.labels) | GENERIC_LABELS:
                errs.append(f"{series}: label {label!r} not exported (labels: {metric.labels})")
    for group in _BY_RE.findall(expr):
        for label in filter(None, (s.strip() for s in group.split(","))):
            if label not in allowed:
                errs.append(f"grouping label {label!r} is not a label of the referenced metrics")
    for fn, series in _RATE_RE.findall(expr):
        r = resolve_metric(series)
        if r and METRICS[r[0]].type == "gauge":
            errs.append(f"{fn}() over gauge {series!r}")
        if r and METRICS[r[0]].type == "counter" and not series.endswith("_total"):
            errs.append(f"counter {series!r} without _total")
    if "histogram_quantile" in expr and "_bucket" in expr:
        for group in _BY_RE.findall(expr):
            if "le" not in [s.strip() for s in group.split(",")]:
                errs.append("histogram_quantile over buckets aggregated without `le`")
    if instant and "$__rate_interval" in expr:
        errs.append("instant (stat-like) query uses $__rate_interval: it goes empty/NaN when traffic pauses; "
                    "aggregate over $__range")
    if not instant and "$__range" in expr:
        errs.append("timeseries query uses $__range: every point would cover the whole range")
    if expr.count("(") != expr.count(")"):
        errs.append("unbalanced parentheses")
    return errs


def lint_dashboards(dashboards: dict[str, dict]) -> list[str]:
    errs: list[str] = []
    uids: dict[str, str] = {}
    for fname, dash in dashboards.items():
        where = fname
        uid = dash.get("uid")
        if not uid:
            errs.append(f"{where}: no uid")
        elif uid in uids:
            errs.append(f"{where}: uid {uid!r} also used by {uids[uid]}")
        else:
            uids[uid] = fname
        if not dash.get("title"):
            errs.append(f"{where}: no title")
        variables = {v["name"]: v for v in dash.get("templating", {}).get("list", [])}
        dsvar = variables.get("datasource")
        if not dsvar or dsvar.get("type") != "datasource" or dsvar.get("query") != "prometheus":
            errs.append(f"{where}: needs a template variable `datasource` of type datasource, query prometheus")
        ids = set()
        titles = set()
        for panel in dash.get("panels", []):
            pw = f"{where} / {panel.get('title')!r}"
            if panel.get("id") in ids:
                errs.append(f"{pw}: duplicate panel id {panel.get('id')}")
            ids.add(panel.get("id"))
            if panel.get("type") == "row":
                continue
            if panel.get("title") in titles:
                errs.append(f"{pw}: duplicate panel title")
            titles.add(panel.get("title"))
            if panel.get("datasource") != DS:
                errs.append(f"{pw}: panel datasource must be {DS}, got {panel.get('datasource')}")
            unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
            if not unit or not (unit in GRAFANA_UNITS or unit.startswith("suffix:")):
                errs.append(f"{pw}: unit {unit!r} is not set / not a known Grafana unit")
            if not panel.get("description"):
                errs.append(f"{pw}: no description")
            targets = panel.get("targets") or []
            if not targets:
                errs.append(f"{pw}: no queries")
            refs = [t.get("refId") for t in targets]
            if len(set(refs)) != len(refs):
                errs.append(f"{pw}: duplicate refIds {refs}")
            for t in targets:
                tw = f"{pw} [{t.get('refId')}]"
                if t.get("datasource") != DS:
                    errs.append(f"{tw}: target datasource must be {DS}, got {t.get('datasource')}")
                want_instant = panel["type"] in INSTANT_TYPES
                if bool(t.get("instant")) != want_instant or bool(t.get("range")) == want_instant:
                    errs.append(f"{tw}: instant/range flags do not fit a {panel['type']} panel")
                errs += [f"{tw}: {e}: {t.get('expr')}" for e in lint_expr(t.get("expr", ""), want_instant)]
        blob = json.dumps(dash)
        if re.search(r'"uid":\s*"(?!\$\{datasource\}|' + re.escape(str(uid)) + r'")', blob):
            errs.append(f"{where}: a hard-coded uid other than the dashboard's own (use ${{datasource}})")
    return errs


# ================================================================================================
# Docs: one table per dashboard (panel | metric | PromQL | meaning).
# ================================================================================================


def docs_tables(dashboards: dict[str, dict]) -> str:
    out = []
    for fname, dash in dashboards.items():
        out.append(f"### {dash['title']}\n")
        out.append(f"`grafana/dashboards/{fname}` (uid `{dash['uid']}`). {dash['description']}\n")
        out.append("| panel | metric | PromQL | meaning |")
        out.append("|---|---|---|---|")
        for panel in dash["panels"]:
            if panel["type"] == "row":
                out.append(f"| **{panel['title']}** | | | |")
                continue
            names = sorted({resolve_metric(n)[0] for t in panel["targets"] for n, _ in metrics_in(t["expr"])
                            if resolve_metric(n)})
            exprs = "<br>".join(f"`{t['expr'].replace('|', chr(92) + '|')}`" for t in panel["targets"])
            unit = panel["fieldConfig"]["defaults"]["unit"]
            out.append(f"| {panel['title']} ({unit}) | {', '.join(f'`{n}`' for n in names)} | {exprs} | "
                       f"{panel['description']} |")
        out.append("")
    return "\n".join(out)


def render_docs(current: str, dashboards: dict[str, dict]) -> str:
    if DOCS_BEGIN not in current or DOCS_END not in current:
        raise ValueError(f"{DOCS} lacks the markers {DOCS_BEGIN!r} ... {DOCS_END!r}")
    head, rest = current.split(DOCS_BEGIN, 1)
    _, tail = rest.split(DOCS_END, 1)
    return f"{head}{DOCS_BEGIN}\n\n{docs_tables(dashboards)}\n{DOCS_END}{tail}"


# ================================================================================================
# Generated files.
# ================================================================================================


def generated_files() -> dict[Path, str]:
    dashboards = build_dashboards()
    files = {DASHBOARD_DIR / name: dump(d) for name, d in dashboards.items()}
    files[PROMETHEUS_YML] = render_prometheus(compose_targets(), "5s", COMPOSE_HEADER, COMPOSE_RULE_FILES)
    files[PROMETHEUS_GPU_YML] = render_prometheus(compose_targets(), "5s", COMPOSE_HEADER, COMPOSE_RULE_FILES,
                                                  DCGM_JOBS_PRODUCTION)
    files[PROMETHEUS_GPU_SINGLE_YML] = render_prometheus(compose_targets(), "5s", COMPOSE_HEADER, COMPOSE_RULE_FILES,
                                                         DCGM_JOBS_SINGLE)
    files[PROMETHEUS_POOLS_YML] = render_prometheus(compose_pool_targets(), "5s", COMPOSE_HEADER, COMPOSE_RULE_FILES)
    if DOCS.exists():
        files[DOCS] = render_docs(DOCS.read_text(), dashboards)
    return files


def stale_files() -> list[str]:
    stale = [str(p.relative_to(REPO)) for p, text in generated_files().items()
             if not p.exists() or p.read_text() != text]
    wanted = {f"{n}" for n in BUILDERS}
    stale += [f"grafana/dashboards/{p.name} (not generated: remove it)" for p in DASHBOARD_DIR.glob("*.json")
              if p.name not in wanted]
    return stale


# ================================================================================================
# Grafana (push / verify) through grafana-client.
# ================================================================================================


def grafana_api():
    from grafana_client import GrafanaApi

    url = os.environ.get("GRAFANA_URL", "http://localhost:3000")
    token = os.environ.get("GRAFANA_TOKEN")
    password = os.environ.get("GRAFANA_PASSWORD")
    if not token and not password:
        raise SystemExit("dashboards: set GRAFANA_TOKEN, or GRAFANA_PASSWORD (and GRAFANA_USER); there is no default")
    cred = token if token else (os.environ.get("GRAFANA_USER", "admin"), password)
    api = GrafanaApi.from_url(url=url, credential=cred, timeout=30.0)
    api.connect()
    return api


def push(folder: str) -> int:
    from grafana_client.client import GrafanaClientError

    api = grafana_api()
    folder_uid = re.sub(r"[^a-z0-9-]", "-", folder.lower())
    try:
        api.folder.get_folder(folder_uid)
    except GrafanaClientError:
        api.folder.create_folder(folder, uid=folder_uid)
    for name, dash in load_committed().items():
        body = {"dashboard": {**dash, "id": None}, "folderUid": folder_uid, "overwrite": True,
                "message": "scripts/dashboards.py push"}
        res = api.dashboard.update_dashboard(body)
        print(f"pushed {name}: uid={res.get('uid')} url={res.get('url')} status={res.get('status')}")
    return 0


def _pick_datasource(api, wanted: str | None) -> dict:
    sources = [d for d in api.datasource.list_datasources() if d.get("type") == "prometheus"]
    if wanted:
        sources = [d for d in sources if wanted in (d.get("uid"), d.get("name"))]
    elif len(sources) > 1:
        sources = [d for d in sources if d.get("isDefault")] or sources[:1]
    if not sources:
        raise SystemExit(f"no Prometheus data source{f' named {wanted!r}' if wanted else ''} in Grafana: the "
                         "${datasource} variable of every dashboard would resolve to nothing")
    return sources[0]


def _exprs(dash: dict) -> list[tuple[str, str, str]]:
    return [(p["title"], t.get("refId", ""), t.get("expr", "")) for p in dash.get("panels", [])
            for t in p.get("targets", [])]


def verify(datasource: str | None, require_data: bool, time_from: str) -> int:
    from grafana_client.client import GrafanaException

    api = grafana_api()
    ds = _pick_datasource(api, datasource)
    print(f"datasource ${{datasource}} -> {ds['name']} (uid {ds['uid']})")
    failures, empty, total = [], [], 0
    local = load_committed()
    for name, dash in local.items():
        try:
            remote = api.dashboard.get_dashboard(dash["uid"])["dashboard"]
        except GrafanaException as e:
            failures.append(f"{name}: dashboard uid {dash['uid']} not found in Grafana ({e})")
            continue
        if lint_dashboards({name: remote}):
            failures += [f"{name} (in Grafana): {e}" for e in lint_dashboards({name: remote})]
        if _exprs(remote) != _exprs(dash):
            failures.append(f"{name}: queries in Grafana differ from grafana/dashboards/{name} (push again)")
        for q in iter_queries({name: remote}):
            total += 1
            body = {"from": time_from, "to": "now", "queries": [{
                "refId": q.ref, "datasource": {"type": "prometheus", "uid": ds["uid"]}, "expr": q.expr,
                "instant": q.instant, "range": not q.instant, "intervalMs": 15000, "maxDataPoints": 500}]}
            where = f"{q.dashboard} / {q.panel} [{q.ref}]"
            try:
                res = api.client.POST("/ds/query", json=body)
            except GrafanaException as e:
                failures.append(f"{where}: query failed: {e}\n    {q.expr}")
                continue
            result = res.get("results", {}).get(q.ref, {})
            if result.get("error"):
                failures.append(f"{where}: {result['error']}\n    {q.expr}")
            elif not any(f.get("data", {}).get("values") and f["data"]["values"][-1]
                         for f in result.get("frames", [])):
                empty.append(f"{where}: no data\n    {q.expr}")
    for line in failures:
        print("FAIL", line)
    for line in empty:
        print("EMPTY" if require_data else "empty (warning)", line)
    print(f"{total} queries: {len(failures)} failed, {len(empty)} returned no data")
    return 1 if failures or (require_data and empty) else 0


# ================================================================================================
# CLI
# ================================================================================================


def _parse_targets(spec: str) -> dict[str, str]:
    out = {}
    for item in filter(None, spec.split(",")):
        job, _, target = item.partition("=")
        if not target:
            raise SystemExit(f"bad target {item!r}: want job=host:port")
        out[job.strip()] = target.strip()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("write", help="regenerate dashboards JSON, compose prometheus.yml, docs tables")
    sub.add_parser("check", help="exit 1 if a generated file is stale")
    sub.add_parser("lint", help="offline checks of grafana/dashboards/*.json")
    q = sub.add_parser("queries", help="print every panel query, Grafana variables substituted")
    q.add_argument("--rate-interval", default="1m")
    q.add_argument("--range", dest="rng", default="15m")
    q.add_argument("--interval", default=None)
    q.add_argument("--json", action="store_true")
    rp = sub.add_parser("render-prometheus", help="print a Prometheus scrape config")
    g = rp.add_mutually_exclusive_group()
    g.add_argument("--compose", action="store_true", help="compose service names (the default)")
    g.add_argument("--dev", action="store_true", help="everything on 127.0.0.1 (scripts/dev_stack.py ports)")
    g.add_argument("--targets", help="job=host:port,... (jobs: " + ", ".join(JOB_NAMES) + ")")
    rp.add_argument("--port-base", type=int, default=0)
    rp.add_argument("--scrape-interval", default="5s")
    rp.add_argument("-o", "--output")
    p = sub.add_parser("push", help="push the dashboards to the Grafana at GRAFANA_URL")
    p.add_argument("--folder", default="expresslane")
    v = sub.add_parser("verify", help="check the dashboards in Grafana: datasource resolves, every query runs")
    v.add_argument("--datasource", help="Prometheus data source uid or name (default: the default one)")
    v.add_argument("--require-data", action="store_true", help="also fail on queries that return no data")
    v.add_argument("--from", dest="time_from", default="now-30m")
    a = ap.parse_args(argv)

    if a.cmd == "write":
        for path, text in generated_files().items():
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
                print(f"wrote {path.relative_to(REPO)}")
        return 0
    if a.cmd == "check":
        stale = stale_files()
        for s in stale:
            print(f"stale: {s} (run: python scripts/dashboards.py write)")
        return 1 if stale else 0
    if a.cmd == "lint":
        errs = lint_dashboards(load_committed())
        for e in errs:
            print(e)
        print(f"{len(errs)} problem(s)")
        return 1 if errs else 0
    if a.cmd == "queries":
        rows = [dict(dataclasses.asdict(x), promql=x.substituted(a.rate_interval, a.rng, a.interval))
                for x in iter_queries()]
        if a.json:
            print(json.dumps(rows, indent=2))
        else:
            for r in rows:
                print(f"# {r['dashboard']} / {r['panel']} [{r['ref']}] {'instant' if r['instant'] else 'range'}")
                print(r["promql"])
        return 0
    if a.cmd == "render-prometheus":
        if a.targets:
            targets = _parse_targets(a.targets)
        elif a.dev:
            targets = dev_targets(a.port_base)
        else:
            targets = compose_targets()
        text = render_prometheus(targets, a.scrape_interval)
        if a.output:
            Path(a.output).write_text(text)
        else:
            sys.stdout.write(text)
        return 0
    if a.cmd == "push":
        return push(a.folder)
    if a.cmd == "verify":
        return verify(a.datasource, a.require_data, a.time_from)
    return 2


if __name__ == "__main__":
    sys.exit(main())
