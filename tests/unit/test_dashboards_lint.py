"""Offline checks of the Grafana dashboards, Prometheus config and their docs (no Grafana, no Prometheus)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from observability_support import REPO, dashboards  # noqa: E402

DASH_FILES = sorted((REPO / "grafana" / "dashboards").glob("*.json"))


def test_dashboard_files_exist():
    assert {p.name for p in DASH_FILES} == set(dashboards.BUILDERS)


@pytest.mark.parametrize("path", DASH_FILES, ids=lambda p: p.name)
def test_valid_json(path):
    json.loads(path.read_text())


def test_generated_files_are_current():
    """grafana/dashboards/*.json, compose/prometheus/prometheus.yml and the docs tables come from
    scripts/dashboards.py; edit the builder and run `python scripts/dashboards.py write`."""
    assert dashboards.stale_files() == []


def test_lint_clean():
    errors = dashboards.lint_dashboards(dashboards.load_committed())
    assert errors == [], "\n".join(errors)


def test_unique_uids_and_titles():
    dash = dashboards.load_committed()
    uids = [d["uid"] for d in dash.values()]
    titles = [d["title"] for d in dash.values()]
    assert len(set(uids)) == len(uids)
    assert len(set(titles)) == len(titles)


def test_every_panel_and_target_uses_the_datasource_variable():
    for name, dash in dashboards.load_committed().items():
        var = [v for v in dash["templating"]["list"] if v["name"] == "datasource"]
        assert var and var[0]["type"] == "datasource" and var[0]["query"] == "prometheus", name
        for panel in dash["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, (name, panel["title"])
            assert panel["targets"], (name, panel["title"])
            for t in panel["targets"]:
                assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, (name, panel["title"])


def test_every_panel_has_a_unit():
    for name, dash in dashboards.load_committed().items():
        for panel in dash["panels"]:
            if panel["type"] != "row":
                assert panel["fieldConfig"]["defaults"].get("unit"), (name, panel["title"])


def test_every_referenced_metric_is_known():
    unknown = sorted({n for q in dashboards.iter_queries() for n, _ in dashboards.metrics_in(q.expr)
                      if dashboards.resolve_metric(n) is None})
    assert unknown == []


def test_every_component_metric_is_on_some_dashboard():
    """The contract and the dashboards agree both ways: nothing exported goes unseen."""
    used = {dashboards.resolve_metric(n)[0] for q in dashboards.iter_queries()
            for n, _ in dashboards.metrics_in(q.expr) if dashboards.resolve_metric(n)}
    contract = {n for n in dashboards.METRICS if n.startswith("expresslane_")}
    assert contract - used == set()


def _vllm_root() -> Path:
    """The installed vLLM's source directory, found without importing it (importing vLLM takes a minute)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _vllm_exported_names() -> set[str]:
    """Metric names the installed vLLM registers, read from its source (as exposed: counters get _total)."""
    root = _vllm_root()
    files = [root / "v1" / "metrics" / "loggers.py",
             *sorted((root / "distributed" / "kv_transfer" / "kv_connector" / "v1").rglob("*.py"))]
    names = set()
    for f in files:
        text = f.read_text()
        for m in re.finditer(r'(_counter_cls|_gauge_cls|_histogram_cls)\(\s*name="(vllm:[a-z0-9_:]+)"', text):
            kind, name = m.groups()
            names.add(name + "_total" if kind == "_counter_cls" else name)
    assert len(names) > 30, f"found only {len(names)} vLLM metric names; did vLLM move its metrics code?"
    return names


def test_vllm_metric_names_exist_in_installed_vllm():
    exported = _vllm_exported_names()
    missing = [n for n in dashboards.VLLM_METRICS if n not in exported]
    assert missing == [], f"not registered by the installed vLLM: {missing}"


def test_vllm_metric_types_match():
    root = _vllm_root()
    text = (root / "v1" / "metrics" / "loggers.py").read_text() + (
        root / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "nixl" / "stats.py").read_text()
    kinds = {"_counter_cls": "counter", "_gauge_cls": "gauge", "_histogram_cls": "histogram"}
    for m in re.finditer(r'(_counter_cls|_gauge_cls|_histogram_cls)\(\s*name="(vllm:[a-z0-9_:]+)"', text):
        kind, name = kinds[m.group(1)], m.group(2)
        key = name + "_total" if kind == "counter" else name
        if key in dashboards.METRICS:
            assert dashboards.METRICS[key].type == kind, key


def test_prometheus_config_jobs():
    cfg = yaml.safe_load((REPO / "compose" / "prometheus" / "prometheus.yml").read_text())
    jobs = {c["job_name"]: c["static_configs"][0]["targets"] for c in cfg["scrape_configs"]}
    assert jobs == {
        "router": ["router:8080"], "prefill": ["prefill:8000"],
        "decode-native": ["decode-native:8100"], "decode-express": ["decode-express:5557"],
        "prometheus": ["prometheus:9090"],
    }
    assert cfg["global"]["scrape_interval"] == "5s"
    # every job a dashboard filters on is scraped
    for q in dashboards.iter_queries():
        for job in re.findall(r'job=~?"([^"]+)"', q.expr):
            assert set(job.split("|")) <= set(jobs), q.expr


def test_dev_config_and_url_targets():
    cfg = dashboards.prometheus_config(dashboards.dev_targets(port_base=100), "1s")
    targets = {c["job_name"]: c["static_configs"][0]["targets"][0] for c in cfg["scrape_configs"]}
    assert targets["router"] == "127.0.0.1:8180" and targets["prefill"] == "127.0.0.1:8100"
    assert "connector" not in targets  # the connector's numbers are on the prefill's own /metrics
    cfg = dashboards.prometheus_config({"router": "https://h:1/base", "prefill": "http://h:2"}, "1s")
    router, prefill = cfg["scrape_configs"]
    assert router["scheme"] == "https" and router["metrics_path"] == "/base/metrics"
    assert "metrics_path" not in prefill and prefill["static_configs"][0]["targets"] == ["h:2"]
    with pytest.raises(ValueError):
        dashboards.prometheus_config({"nope": "h:1"})


def test_grafana_datasource_timeinterval_matches_scrape_interval():
    ds = yaml.safe_load((REPO / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    prom = yaml.safe_load((REPO / "compose" / "prometheus" / "prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert source["jsonData"]["timeInterval"] == prom["global"]["scrape_interval"]


def test_dashboard_provider_points_at_the_mounted_dir():
    prov = yaml.safe_load((REPO / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml").read_text())
    (provider,) = prov["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/var/lib/grafana/dashboards"
    assert "/var/lib/grafana/dashboards" in (REPO / "docs" / "dashboards.md").read_text()


def test_queries_substitute_every_variable():
    for q in dashboards.iter_queries():
        out = q.substituted("20s", "30m")
        assert "$" not in out, out
        assert ("[30m]" in out) == q.instant or "[" not in out, out


@pytest.mark.parametrize("expr,instant,fragment", [
    ("sum(rate(expresslane_router_nope_total[$__rate_interval]))", False, "unknown metric"),
    ("rate(expresslane_decode_busy[$__rate_interval])", False, "over gauge"),
    ("histogram_quantile(0.5, sum by (lane) (rate(expresslane_router_time_to_first_token_seconds_bucket"
     "[$__rate_interval])))", False, "without `le`"),
    ("sum by (pool) (rate(expresslane_router_requests_total[$__rate_interval]))", False, "grouping label"),
    ('sum(rate(expresslane_router_requests_total{pool="x"}[$__rate_interval]))', False, "not exported"),
    ("sum(rate(expresslane_router_requests_total[$__rate_interval]))", True, "instant"),
    ("sum(increase(expresslane_router_requests_total[$__range]))", False, "$__range"),
    ("sum(rate(expresslane_decode_handoff_seconds[$__rate_interval]))", False, "without _bucket"),
    ("vector(1)", False, "no known metric"),
])
def test_lint_catches(expr, instant, fragment):
    errors = dashboards.lint_expr(expr, instant)
    assert any(fragment in e for e in errors), errors


def test_lint_catches_hard_coded_datasource():
    dash = json.loads(json.dumps(dashboards.build_dashboards()))
    panel = next(p for p in dash["kv-handoff.json"]["panels"] if p["type"] != "row")
    panel["datasource"] = {"type": "prometheus", "uid": "expresslane-prometheus"}
    errors = dashboards.lint_dashboards(dash)
    assert any("panel datasource" in e for e in errors) and any("hard-coded uid" in e for e in errors)


def test_grafana_rate_interval():
    assert dashboards.grafana_rate_interval(15, 5) == "20s"
    assert dashboards.grafana_rate_interval(60, 5) == "65s"
    assert dashboards.grafana_rate_interval(1, 1) == "4s"


# ---- push / verify against a stand-in Grafana HTTP API (the real server cannot be installed here) ----------


class _FakeGrafana:
    """Just enough of Grafana's HTTP API for `push` and `verify`: records every request."""

    def __init__(self):
        import http.server
        import threading

        self.requests: list[tuple[str, str, dict | None]] = []
        self.dashboards: dict[str, dict] = {}
        self.datasources = [{"id": 1, "uid": "prom-a", "name": "Prometheus", "type": "prometheus",
                             "isDefault": True, "access": "proxy"},
                            {"id": 2, "uid": "loki", "name": "Loki", "type": "loki", "access": "proxy"}]
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.requests.append(("GET", self.path, None))
                if self.path == "/api/frontend/settings":  # grafana-client's connect() / version
                    return self._reply(200, {"buildInfo": {"version": "11.3.0"}})
                if self.path == "/api/datasources":
                    return self._reply(200, fake.datasources)
                if self.path.startswith("/api/folders/"):
                    return self._reply(404, {"message": "folder not found"})
                if self.path.startswith("/api/dashboards/uid/"):
                    uid = self.path.rsplit("/", 1)[1]
                    if uid in fake.dashboards:
                        return self._reply(200, {"dashboard": fake.dashboards[uid], "meta": {}})
                    return self._reply(404, {"message": "Dashboard not found"})
                self._reply(404, {"message": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                fake.requests.append(("POST", self.path, body))
                if self.path == "/api/folders":
                    return self._reply(200, {"uid": body.get("uid"), "title": body["title"]})
                if self.path == "/api/dashboards/db":
                    d = body["dashboard"]
                    fake.dashboards[d["uid"]] = d
                    return self._reply(200, {"uid": d["uid"], "url": f"/d/{d['uid']}", "status": "success"})
                if self.path == "/api/ds/query":
                    (q,) = body["queries"]
                    frame = {"schema": {}, "data": {"values": [[1], [0.5]]}}
                    return self._reply(200, {"results": {q["refId"]: {"status": 200, "frames": [frame]}}})
                self._reply(404, {"message": "not found"})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_grafana(monkeypatch):
    pytest.importorskip("grafana_client")
    fake = _FakeGrafana()
    monkeypatch.setenv("GRAFANA_URL", fake.url)
    monkeypatch.setenv("GRAFANA_USER", "admin")
    monkeypatch.setenv("GRAFANA_PASSWORD", "secret")
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    yield fake
    fake.close()


def test_push_then_verify(fake_grafana, capsys):
    assert dashboards.main(["push", "--folder", "expresslane"]) == 0
    posted = [b for m, p, b in fake_grafana.requests if p == "/api/dashboards/db"]
    assert sorted(b["dashboard"]["uid"] for b in posted) == sorted(
        d["uid"] for d in dashboards.load_committed().values())
    assert all(b["overwrite"] and b["folderUid"] == "expresslane" and b["dashboard"]["id"] is None for b in posted)
    assert any(p == "/api/folders" for _, p, _ in fake_grafana.requests)

    assert dashboards.main(["verify", "--require-data"]) == 0, capsys.readouterr().out
    queries = [b["queries"][0] for m, p, b in fake_grafana.requests if p == "/api/ds/query"]
    assert len(queries) == len(dashboards.iter_queries())
    # ${datasource} resolved to the Prometheus data source; Grafana's own $__ variables left for Grafana
    assert {q["datasource"]["uid"] for q in queries} == {"prom-a"}
    assert any("$__rate_interval" in q["expr"] for q in queries)
    assert all(q["instant"] != q["range"] for q in queries)


def test_verify_fails_on_missing_dashboard_and_drift(fake_grafana, capsys):
    assert dashboards.main(["verify"]) == 1
    assert "not found in Grafana" in capsys.readouterr().out
    dashboards.main(["push"])
    uid = next(iter(fake_grafana.dashboards))
    fake_grafana.dashboards[uid]["panels"][1]["targets"][0]["expr"] = "vector(1)"
    assert dashboards.main(["verify"]) == 1
    assert "differ from grafana/dashboards" in capsys.readouterr().out


def test_verify_fails_without_a_prometheus_datasource(fake_grafana):
    fake_grafana.datasources = [d for d in fake_grafana.datasources if d["type"] != "prometheus"]
    with pytest.raises(SystemExit, match="no Prometheus data source"):
        dashboards.main(["verify"])


class _ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags (`!reset`, `!override`: how a file's value replaces the one it extends); the
    tagged value is read as written."""


for _tag in ("!reset", "!override"):
    _ComposeLoader.add_constructor(_tag, lambda loader, node: (
        loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode)
        else loader.construct_mapping(node) if isinstance(node, yaml.MappingNode) else loader.construct_scalar(node)))


def test_compose_mounts_match_provisioning():
    """compose/compose.yaml mounts what the provisioning files and prometheus.yml expect; Grafana is on by default
    (no profile) and takes its admin password from the environment (grafana/entrypoint.sh), never a default."""
    path = REPO / "compose" / "compose.yaml"
    if not path.exists():
        pytest.skip("no compose/compose.yaml yet")
    services = yaml.load(path.read_text(), Loader=_ComposeLoader)["services"]
    prom_volumes = services["prometheus"]["volumes"]
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom_volumes
    assert "./prometheus/rules:/etc/prometheus/rules:ro" in prom_volumes
    rule_dir = yaml.safe_load((REPO / "compose" / "prometheus" / "prometheus.yml").read_text())["rule_files"]
    assert rule_dir == ["/etc/prometheus/rules/*.yml"]
    grafana = services["grafana"]
    assert "profiles" not in grafana
    volumes = grafana["volumes"]
    assert "../grafana/provisioning:/etc/grafana/provisioning:ro" in volumes
    assert "../grafana/dashboards:/var/lib/grafana/dashboards:ro" in volumes
    assert "GF_SECURITY_ADMIN_PASSWORD" not in grafana["environment"]  # only through grafana/entrypoint.sh
    assert "GRAFANA_ADMIN_PASSWORD" in grafana["environment"]
    assert "../grafana/entrypoint.sh:/etc/grafana/expresslane-entrypoint.sh:ro" in volumes
    home = grafana["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert Path(home).name in dashboards.BUILDERS, home
    # every compose service the scrape config names exists
    for job in dashboards.JOBS:
        host = job.compose_target.split(":")[0]
        assert host == "localhost" or host in services, job


def test_metric_catalog_is_the_code_registries():
    """The catalog is read from the code (router and decode registries, the connector's table), so a metric
    added, renamed or relabelled there changes it; spot-check that it is not a stale copy."""
    from prometheus_client import CollectorRegistry

    from expresslane.engine.server.metrics import DecodeMetrics

    reg = CollectorRegistry()
    DecodeMetrics(reg)
    for name in reg._names_to_collectors:
        if name.endswith(("_created", "_bucket", "_sum", "_count")) and name not in dashboards.METRICS:
            continue
        assert name in dashboards.METRICS or name + "_total" in dashboards.METRICS, name
    connector = {n: m for n, m in dashboards.METRICS.items() if n.startswith("expresslane_connector_")}
    assert len(connector) == 13 and all(m.jobs == ("prefill",) for m in connector.values())
    assert connector["expresslane_connector_send_failures_total"].labels == ("model_name", "engine", "reason")
    assert connector["expresslane_connector_staging_slots_free"].labels == ("model_name", "engine", "rank")
