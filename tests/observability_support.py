"""Shared helpers for the observability tests: a real Prometheus process, smoke traffic, panel queries.

The `prometheus` fixture starts the `prometheus` binary (apt-get install prometheus) with a scrape config generated
from the same JOBS table as compose/prometheus/prometheus.yml (scripts/dashboards.py), scraping the `live_stack`
fixture's services every second. Without the binary it skips, except under CI=true, where it fails.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent


def load_dashboards_module():
    """scripts/dashboards.py as a module (scripts/ is not a package)."""
    name = "expresslane_dashboards"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "dashboards.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


dashboards = load_dashboards_module()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def stack_targets(stack) -> dict[str, str]:
    """job -> base URL, from an object with the live_stack attributes."""
    return {
        "router": stack.router_url,
        "prefill": stack.prefill_url,  # vLLM's /metrics, with our connector's series
        "decode-native": stack.native_url,
        "decode-express": stack.express_url,
    }


# ---------------------------------------------------------------------------------------------
# A real Prometheus
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Prometheus:
    url: str
    scrape_interval_s: float
    targets: dict[str, str]
    workdir: Path
    proc: subprocess.Popen | None = None
    client: httpx.Client = dataclasses.field(default_factory=lambda: httpx.Client(timeout=30.0))

    # -- lifecycle ------------------------------------------------------------------------
    @classmethod
    def start(cls, targets: dict[str, str], workdir: Path, scrape_interval_s: float = 1.0,
              binary: str = "prometheus") -> "Prometheus":
        port = free_port()
        targets = {**targets, "prometheus": f"127.0.0.1:{port}"}
        interval = f"{scrape_interval_s:g}s"
        config = workdir / "prometheus.yml"
        config.write_text(dashboards.render_prometheus(targets, interval))
        log = open(workdir / "prometheus.log", "wb")
        proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1d"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        prom = cls(f"http://127.0.0.1:{port}", scrape_interval_s, targets, workdir, proc)
        try:
            prom.wait_ready()
        except Exception:
            prom.stop()
            raise
        return prom

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.client.close()

    def log_tail(self, n: int = 30) -> str:
        path = self.workdir / "prometheus.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc and self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.client.get(self.url + "/-/ready").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {timeout_s}s:\n{self.log_tail()}")

    def wait_targets_scraped(self, scrapes: int = 2, timeout_s: float = 60.0) -> None:
        """Until every target is up and has been scraped `scrapes` times (so counters have a baseline
        before traffic: rate() needs a sample from before the first increment)."""
        deadline = time.monotonic() + timeout_s
        first_up: dict[str, float] = {}
        status = ""
        while time.monotonic() < deadline:
            active = self.client.get(self.url + "/api/v1/targets").json()["data"]["activeTargets"]
            status = "\n".join(f"  {t['labels']['job']:15} {t['scrapeUrl']:40} {t['health']:8} {t['lastError']}"
                               for t in active)
            now = time.monotonic()
            for t in active:
                if t["health"] == "up":
                    first_up.setdefault(t["labels"]["job"], now)
            if len(active) == len(self.targets) and all(
                    now - first_up.get(j, now) >= scrapes * self.scrape_interval_s for j in self.targets):
                return
            time.sleep(self.scrape_interval_s / 2)
        raise TimeoutError(f"not every scrape target came up within {timeout_s}s:\n{status}")

    def wait_scrapes(self, n: int = 3) -> None:
        time.sleep(n * self.scrape_interval_s + 0.5)

    # -- queries ----------------------------------------------------------------------------
    def _api(self, path: str, params: dict, method: str = "POST") -> dict:
        if method == "POST":
            r = self.client.post(self.url + path, data=params)
        else:
            r = self.client.get(self.url + path, params=params)
        body = r.json()
        if body.get("status") != "success":
            raise PromQLError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def instant(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self._api("/api/v1/query", params)["result"]

    def range(self, expr: str, start: float, end: float, step_s: float) -> list[dict]:
        return self._api("/api/v1/query_range",
                         {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}"})["result"]

    def target_metadata(self) -> dict[str, set[str]]:
        """job -> the metric names its target announces (HELP/TYPE), whether or not they have samples yet.
        Names are normalised to what a query uses: counters get `_total`."""
        out: dict[str, set[str]] = {}
        for row in self._api("/api/v1/targets/metadata", {"match_target": '{job=~".+"}'}, "GET"):
            name = row["metric"]
            if row.get("type") == "counter" and not name.endswith("_total"):
                name += "_total"
            out.setdefault(row["target"]["job"], set()).add(name)
        return out


class PromQLError(RuntimeError):
    pass


def prometheus_binary() -> str | None:
    return os.environ.get("PROMETHEUS_BIN") or shutil.which("prometheus")


def require_prometheus_binary() -> str:
    binary = prometheus_binary()
    if binary:
        return binary
    reason = "no `prometheus` binary (apt-get install -y prometheus, or set PROMETHEUS_BIN)"
    if in_ci():
        pytest.fail(reason + "; CI=true, so this is a failure, not a skip")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def prometheus(live_stack, tmp_path_factory):
    """A real Prometheus scraping every live_stack service once a second; stopped at the end."""
    binary = require_prometheus_binary()
    prom = Prometheus.start(stack_targets(live_stack), tmp_path_factory.mktemp("prometheus"), 1.0, binary)
    try:
        prom.wait_targets_scraped()
        yield prom
    finally:
        prom.stop()


# ---------------------------------------------------------------------------------------------
# Smoke traffic through the router
# ---------------------------------------------------------------------------------------------
NATIVE_ALIAS = "tiny-llama"
EXPRESS_ALIAS = "tiny-llama-express"


@dataclasses.dataclass
class TrafficReport:
    started: float
    finished: float
    statuses: list[tuple[str, bool, int]]


def send_smoke_traffic(router_url: str, *, rounds: int = 2, pause_s: float = 2.5,
                       aliases: tuple[str, ...] = (NATIVE_ALIAS, EXPRESS_ALIAS), max_tokens: int = 12,
                       path: str = "/v1/completions") -> TrafficReport:
    """Streaming and non-streaming requests through every alias, `rounds` times with `pause_s` between rounds
    (so the second round is an increase rate() can see), then one unknown-model request (404)."""
    started = time.time()
    statuses = []
    with httpx.Client(base_url=router_url, timeout=httpx.Timeout(120.0, connect=10.0)) as client:
        for rnd in range(rounds):
            if rnd:
                time.sleep(pause_s)
            for alias in aliases:
                for stream in (False, True):
                    body = {"model": alias, "prompt": f"hello world round {rnd} the quick brown fox",
                            "max_tokens": max_tokens, "temperature": 0, "stream": stream}
                    if stream:
                        with client.stream("POST", path, json=body) as r:
                            for _ in r.iter_lines():
                                pass
                            status = r.status_code
                    else:
                        status = client.post(path, json=body).status_code
                    statuses.append((alias, stream, status))
        r = client.post(path, json={"model": "no-such-model", "prompt": "x", "max_tokens": 1})
        statuses.append(("no-such-model", False, r.status_code))
    return TrafficReport(started, time.time(), statuses)


# ---------------------------------------------------------------------------------------------
# Running every panel query
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class QueryResult:
    query: object  # dashboards.Query
    promql: str
    series: int
    finite: bool
    error: str = ""
    peak: float | None = None  # the largest |value| among finite values

    @property
    def moved(self) -> bool:
        return bool(self.peak) or bool(getattr(self.query, "zero_ok", False))

    @property
    def ok(self) -> bool:
        return not self.error and self.series > 0 and self.finite and self.moved

    def describe(self) -> str:
        q = self.query
        if self.ok:
            why = f"{self.series} series"
        elif self.error or not self.series:
            why = self.error or "no series"
        elif not self.finite:
            why = f"{self.series} series, all NaN/Inf"
        else:
            why = f"{self.series} series, every value 0: the metric never moved during the traffic"
        return f"{q.dashboard} / {q.panel} [{q.ref}] ({'instant' if q.instant else 'range'}): {why}\n    {self.promql}"


def _peak(result: list[dict]) -> float | None:
    """Largest |value| among the finite values of every series; None if there is none."""
    peak = None
    for series in result:
        values = series.get("values") or ([series["value"]] if "value" in series else [])
        for _, v in values:
            if math.isfinite(float(v)):
                peak = max(peak or 0.0, abs(float(v)))
    return peak


def summary(results: list[QueryResult]) -> str:
    lines = [f"{'ok' if r.ok else 'EMPTY':5} {r.series:3} series  peak={r.peak!s:24.24} "
             f"{r.query.dashboard} / {r.query.panel} [{r.query.ref}]" for r in results]
    return "\n".join(lines)


def run_panel_queries(prom: Prometheus, start: float, end: float, step_s: float = 1.0,
                      queries: list | None = None) -> list[QueryResult]:
    """Every target of every committed dashboard, run the way Grafana would run it over [start, end]:
    timeseries as range queries with Grafana's $__rate_interval for this scrape interval and step; stat-like
    panels as instant queries at `end` with $__range covering [start, end]. A query passes with at least one
    finite value, and a non-zero one unless the builder marked it zero_ok."""
    rate_interval = dashboards.grafana_rate_interval(step_s, prom.scrape_interval_s)
    rng = f"{int(math.ceil(end - start))}s"
    out = []
    for q in (dashboards.iter_queries() if queries is None else queries):
        promql = q.substituted(rate_interval, rng, f"{step_s:g}s")
        try:
            result = prom.instant(promql, at=end) if q.instant else prom.range(promql, start, end, step_s)
            peak = _peak(result)
            out.append(QueryResult(q, promql, len(result), peak is not None, peak=peak))
        except PromQLError as e:
            out.append(QueryResult(q, promql, 0, False, str(e)))
    return out


def missing_metrics(prom: Prometheus) -> list[str]:
    """Metrics a dashboard references that the job expected to export them does not announce."""
    announced = prom.target_metadata()
    referenced = sorted({dashboards.resolve_metric(n)[0] for q in dashboards.iter_queries()
                         for n, _ in dashboards.metrics_in(q.expr) if dashboards.resolve_metric(n)})
    problems = []
    for name in referenced:
        jobs = [j for j in dashboards.METRICS[name].jobs if j in prom.targets]
        if name == "up" or dashboards.METRICS[name].only:  # only: not every node of its job exports it
            continue
        if not any(name in announced.get(j, set()) for j in jobs):
            problems.append(f"{name}: not announced by job(s) {jobs} (announced by: "
                            f"{sorted(j for j, names in announced.items() if name in names) or 'none'})")
    return problems
