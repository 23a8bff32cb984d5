"""kubernetes/: every overlay renders with `kubectl kustomize`, every object validates strictly against the Kubernetes
1.37 schemas (kubernetes-validate), and the rendered objects keep what docs/deployment.md promises: the four
workloads, probes on real endpoints, requests on every container, non-root and read-only containers, PDBs,
anti-affinity, NetworkPolicies that expose only the router and keep the control-plane and NIXL ports between prefill
and decode pods, no literal secret, and the router's pools pointing at the headless Services.

No cluster is started: this is what can be checked offline.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "kubernetes"
OVERLAYS = ("cpu-demo", "gpu", "tilert")
K8S_VERSION = "1.37"
# $KUBECTL, else the pinned one scripts/install-kubectl.sh put beside the venv's python, else kubectl on PATH
_VENV_KUBECTL = Path(sys.executable).parent / "kubectl"
KUBECTL = os.environ.get("KUBECTL") or (str(_VENV_KUBECTL) if _VENV_KUBECTL.exists() else "kubectl")
WORKLOADS = {("StatefulSet", "prefill"), ("StatefulSet", "decode-native"), ("StatefulSet", "decode-express"),
             ("Deployment", "router")}
POOLS = ("prefill", "decode-native", "decode-express")
COMPONENTS = ("router", "prefill", "decode-native", "decode-express", "prometheus")
OUTSIDE = "outside"  # a client in another namespace or outside the cluster
SECRET_KEYS = {"vllm-api-key", "express-node-token", "peer-secret", "router-api-keys"}


def _copy_tree(tmp: Path) -> Path:
    """kubernetes/ plus what its base loads from the repo (dashboards, alert rules), and cpu-demo's secrets
    written by make-secrets.sh: rendering never writes into the source tree."""
    root = tmp / "repo"
    shutil.copytree(KUBE, root / "kubernetes", ignore=shutil.ignore_patterns("secrets"))
    shutil.copytree(REPO / "grafana", root / "grafana")
    shutil.copytree(REPO / "compose" / "prometheus" / "rules", root / "compose" / "prometheus" / "rules")
    subprocess.run(["bash", str(root / "kubernetes" / "make-secrets.sh"),
                    str(root / "kubernetes" / "overlays" / "cpu-demo" / "secrets")], check=True, capture_output=True)
    return root


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    if shutil.which(KUBECTL) is None:
        pytest.fail(f"{KUBECTL!r} is not installed: these checks need `kubectl kustomize` (scripts/install-dev.sh "
                    "installs the pinned one into .venv/bin; or set KUBECTL to its path)")
    root = _copy_tree(tmp_path_factory.mktemp("kube"))
    out = {}
    for overlay in OVERLAYS:
        proc = subprocess.run([KUBECTL, "kustomize", str(root / "kubernetes" / "overlays" / overlay)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"kubectl kustomize {overlay} failed:\n{proc.stderr}"
        out[overlay] = [d for d in yaml.safe_load_all(proc.stdout) if d]
    out["_secrets_dir"] = root / "kubernetes" / "overlays" / "cpu-demo" / "secrets"  # type: ignore[assignment]
    return out


def objects(rendered, overlay: str, kind: str | None = None) -> list[dict]:
    return [o for o in rendered[overlay] if kind is None or o["kind"] == kind]


def one(rendered, overlay: str, kind: str, name: str) -> dict:
    found = [o for o in objects(rendered, overlay, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{overlay}: {kind}/{name} rendered {len(found)} times"
    return found[0]


def pod_specs(rendered, overlay: str) -> dict[str, dict]:
    """component -> pod template spec, for every workload."""
    out = {}
    for o in rendered[overlay]:
        if o["kind"] in ("StatefulSet", "Deployment"):
            out[o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]] = o["spec"]["template"]
    return out


def configmap(rendered, overlay: str, prefix: str) -> dict:
    found = [o for o in objects(rendered, overlay, "ConfigMap") if re.fullmatch(prefix + r"(-[a-z0-9]{10})?",
                                                                                  o["metadata"]["name"])]
    assert len(found) == 1, f"{overlay}: ConfigMap {prefix}: {[o['metadata']['name'] for o in found]}"
    return found[0]


# ---- rendering and schemas ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_strictly(rendered, overlay):
    assert rendered[overlay], f"{overlay} rendered nothing"
    for obj in rendered[overlay]:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} does not validate: {e.message} "
                        f"at {list(e.path)}")


def test_the_validator_rejects_an_unknown_field():
    """The strict check can fail (a field no schema has)."""
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"bogus": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(svc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_four_workloads_and_their_headless_services(rendered, overlay):
    have = {(o["kind"], o["metadata"]["name"]) for o in rendered[overlay]}
    assert WORKLOADS <= have
    for pool in POOLS:
        sts = one(rendered, overlay, "StatefulSet", pool)
        svc = one(rendered, overlay, "Service", pool)
        assert sts["spec"]["serviceName"] == pool
        assert svc["spec"]["clusterIP"] == "None", f"{pool}: the pool's Service must be headless (one A record each)"
        assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]


# ---- probes, resources, security context -----------------------------------------------------------------------

# The endpoints each server really serves: vLLM has /health only; the router and our express node have /ready and
# /health; TileRT's decode server /health.
PROBES = {"router": ("/ready", "/health"), "prefill": ("/health", "/health"),
          "decode-native": ("/health", "/health"), "decode-express": ("/ready", "/health"),
          "prometheus": ("/-/ready", "/-/healthy")}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_use_real_endpoints(rendered, overlay):
    for comp, tpl in pod_specs(rendered, overlay).items():
        c = tpl["spec"]["containers"][0]
        ready, live = PROBES[comp]
        if overlay == "tilert" and comp == "decode-express":
            ready = "/health"
        assert c["readinessProbe"]["httpGet"]["path"] == ready, comp
        assert c["livenessProbe"]["httpGet"]["path"] == live, comp
        ports = {p["name"] for p in c["ports"]}
        assert c["readinessProbe"]["httpGet"]["port"] in ports and c["livenessProbe"]["httpGet"]["port"] in ports


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_requests_and_security_on_every_container(rendered, overlay):
    for comp, tpl in pod_specs(rendered, overlay).items():
        spec = tpl["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, comp
        assert spec["securityContext"]["runAsUser"] != 0, comp
        assert spec.get("automountServiceAccountToken") is False, comp
        for c in spec["containers"] + spec.get("initContainers", []):
            where = f"{overlay} {comp}/{c['name']}"
            req = c["resources"]["requests"]
            assert "cpu" in req and "memory" in req, where
            assert "memory" in c["resources"]["limits"], where
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert set(sc["capabilities"].get("add", [])) <= {"IPC_LOCK"}, where
            writable = {m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
            if comp != "prometheus":
                assert "/tmp" in writable, f"{where}: a read-only root needs a writable /tmp"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_and_anti_affinity(rendered, overlay):
    pdbs = {tuple(sorted(p["spec"]["selector"]["matchLabels"].items())) for p in objects(rendered, overlay,
                                                                                          "PodDisruptionBudget")}
    for comp, tpl in pod_specs(rendered, overlay).items():
        if comp == "prometheus":
            continue
        labels = tpl["metadata"]["labels"]
        assert any(all(labels.get(k) == v for k, v in sel) for sel in pdbs), f"{comp}: no PodDisruptionBudget"
        anti = tpl["spec"]["affinity"]["podAntiAffinity"]
        terms = [t["podAffinityTerm"] for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])]
        terms += anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])
        assert any(t["topologyKey"] == "kubernetes.io/hostname"
                   and t["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == comp for t in terms), comp
    if overlay == "gpu":  # one GPU per member: two members must never share a node
        for pool in ("prefill", "decode-native"):
            anti = pod_specs(rendered, overlay)[pool]["spec"]["affinity"]["podAntiAffinity"]
            assert anti["requiredDuringSchedulingIgnoredDuringExecution"], pool


# ---- NetworkPolicies: what docs/security.md's port table says --------------------------------------------------

def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
    return True


def _peer_matches(peer: dict, src: str, src_labels: dict | None) -> bool:
    if "ipBlock" in peer:
        return src == OUTSIDE
    if "namespaceSelector" in peer and "podSelector" not in peer:
        return True
    if "namespaceSelector" in peer and peer["namespaceSelector"] != {}:
        return src == OUTSIDE
    if src == OUTSIDE:
        return "namespaceSelector" in peer and _selects(peer["podSelector"], {})
    return src_labels is not None and _selects(peer["podSelector"], src_labels)


def _port_ok(rule: dict, port: int, named: dict[str, int]) -> bool:
    ports = rule.get("ports")
    if not ports:
        return True
    return any(p.get("port") in (port, None) or named.get(p.get("port")) == port for p in ports)


def allowed(rendered, overlay: str, src: str, dst: str, port: int) -> bool:
    """Whether the policies let `src` (a component, or OUTSIDE) open `port` on `dst`: the destination's ingress and
    the source's egress (policies with no rule for a direction deny it: default-deny selects every pod)."""
    pods = pod_specs(rendered, overlay)
    dst_labels = pods[dst]["metadata"]["labels"]
    src_labels = pods[src]["metadata"]["labels"] if src != OUTSIDE else None
    named = {p["name"]: p["containerPort"] for p in pods[dst]["spec"]["containers"][0]["ports"]}
    policies = objects(rendered, overlay, "NetworkPolicy")

    def direction(kind: str, own: dict, peer_name: str, peer_labels: dict | None) -> bool:
        selecting = [p for p in policies if _selects(p["spec"]["podSelector"], own) and kind in p["spec"]["policyTypes"]]
        assert selecting, f"{overlay}: no {kind} policy selects {own} (default deny must)"
        key, peers = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
        for p in selecting:
            for rule in p["spec"].get(key, []):
                if not _port_ok(rule, port, named):
                    continue
                if peers not in rule or any(_peer_matches(x, peer_name, peer_labels) for x in rule[peers]):
                    return True
        return False

    ingress = direction("Ingress", dst_labels, src, src_labels)
    egress = src == OUTSIDE or direction("Egress", src_labels, dst, dst_labels)
    return ingress and egress


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_default_deny_both_directions(rendered, overlay):
    deny = [p for p in objects(rendered, overlay, "NetworkPolicy")
            if p["spec"]["podSelector"] == {} and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
            and not p["spec"].get("ingress") and not p["spec"].get("egress")]
    assert deny, f"{overlay}: no default-deny NetworkPolicy"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_router_is_reachable_from_outside(rendered, overlay):
    assert allowed(rendered, overlay, OUTSIDE, "router", 8080)
    for comp in COMPONENTS:
        if comp == "router" or (overlay == "tilert" and comp == "decode-express"):
            continue  # (tilert's node is on the host network, outside pod policies: its node firewall guards it)
        for port in (8000, 8100, 5557, 5556, 5600, 5601, 9090, 9400):
            assert not allowed(rendered, overlay, OUTSIDE, comp, port), f"{overlay}: {comp}:{port} open to outside"
    for svc in objects(rendered, overlay, "Service"):
        assert svc["spec"].get("type", "ClusterIP") == "ClusterIP", f"{svc['metadata']['name']}: exposed by type"


@pytest.mark.parametrize("overlay", ["cpu-demo", "gpu"])
def test_control_plane_and_nixl_ports_only_between_prefill_and_decode(rendered, overlay):
    peers = {("decode-express", 5556): {"prefill"}, ("decode-native", 5601): {"prefill"},
             ("prefill", 5600): {"decode-native", "decode-express"}}
    for (dst, port), want in peers.items():
        got = {src for src in COMPONENTS if src != dst and allowed(rendered, overlay, src, dst, port)}
        assert got == want, f"{overlay}: {dst}:{port} reachable from {sorted(got)}, want {sorted(want)}"
    # the HTTP legs: router -> each pool; Prometheus scrapes everything
    for dst, port in (("prefill", 8000), ("decode-native", 8100), ("decode-express", 5557)):
        assert allowed(rendered, overlay, "router", dst, port)
        assert allowed(rendered, overlay, "prometheus", dst, port)
        assert not allowed(rendered, overlay, "decode-native" if dst != "decode-native" else "decode-express",
                           "router", 9999)


def test_the_policy_check_can_fail(rendered):
    """The evaluator is not vacuous: without the default deny's company (an allow-all ingress), outside reaches vLLM."""
    doc = {"cpu-demo": rendered["cpu-demo"] + [{"kind": "NetworkPolicy", "metadata": {"name": "open"}, "spec": {
        "podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{}]}}]}
    assert allowed(doc, "cpu-demo", OUTSIDE, "prefill", 8000)
    assert not allowed(rendered, "cpu-demo", OUTSIDE, "prefill", 8000)


# ---- secrets ----------------------------------------------------------------------------------------------------

def test_no_literal_secret_in_the_tree():
    for path in KUBE.rglob("*.yaml"):
        if "secrets" in path.parts or "config" in path.parts:  # (config/: service configs, ${VAR} text)
            continue
        text = path.read_text()
        for doc in yaml.safe_load_all(text):
            if not isinstance(doc, dict):
                continue
            assert doc.get("kind") != "Secret", f"{path}: a Secret object in the repo"
            for gen in doc.get("secretGenerator", []):
                assert "literals" not in gen and "envs" not in gen, f"{path}: secretGenerator must read files"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_come_from_files_only(rendered, overlay):
    secrets = objects(rendered, overlay, "Secret")
    if overlay == "cpu-demo":
        assert len(secrets) == 1 and set(secrets[0]["data"]) == SECRET_KEYS
        files = rendered["_secrets_dir"]
        import base64
        for key, value in secrets[0]["data"].items():  # the generated files' content, nothing from the repo
            assert base64.b64decode(value).decode() == (files / key).read_text()
    else:
        assert secrets == [], f"{overlay}: expects the Secret to exist already (external reference)"
    for comp, tpl in pod_specs(rendered, overlay).items():
        for c in tpl["spec"]["containers"] + tpl["spec"].get("initContainers", []):
            for env in c.get("env", []):
                name = env["name"]
                if re.search(r"(KEY|KEYS|TOKEN|SECRET|PASSWORD)$", name):
                    pytest.fail(f"{overlay} {comp}: {name} set directly (use {name}_FILE from the Secret)")
        for v in tpl["spec"]["volumes"]:
            if "secret" in v:
                assert v["secret"]["secretName"].startswith("expresslane-secrets"), comp
                assert {i["key"] for i in v["secret"]["items"]} <= SECRET_KEYS


# ---- the router's pools, dashboards, scrape config ------------------------------------------------------------

def _env(rendered, overlay: str) -> dict[str, str]:
    return dict(configmap(rendered, overlay, "expresslane-env")["data"])


def router_config(rendered, overlay: str) -> dict:
    from expresslane.router.config import interpolate
    text = configmap(rendered, overlay, "router-config")["data"]["router.yaml"]
    return yaml.safe_load(interpolate(text, _env(rendered, overlay)))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_pools_point_at_the_headless_services(rendered, overlay):
    cfg = router_config(rendered, overlay)
    from expresslane.router.config import parse_config
    typed = parse_config(cfg, source=f"{overlay} router-config")  # the router would start with it
    assert typed.prefill.dns is not None and typed.prefill.static_nodes == []
    assert cfg["prefill"]["dns"]["name"] == "prefill"
    assert cfg["prefill"]["dns"]["port"] == 8000
    assert cfg["pools"]["native"]["dns"]["name"] == "decode-native"
    assert cfg["pools"]["native"]["dns"]["port"] == 8100
    router = pod_specs(rendered, overlay)["router"]["spec"]["containers"][0]
    assert {"name": "ROUTER_CONFIG", "value": "/etc/expresslane/router.yaml"} in router["env"]


def _allow_list(rendered, overlay: str):
    """The prefills' destination allow-list as the connector parses it (a bad entry raises here as in vLLM)."""
    from expresslane.engine.connector.config import ExpressLaneConnectorConfig
    return ExpressLaneConnectorConfig.from_extra_config({}, env=_env(rendered, overlay))


@pytest.mark.parametrize("overlay", ("cpu-demo", "gpu"))
def test_the_express_pool_is_the_headless_service_and_the_allow_list_its_pod_cidr(rendered, overlay):
    """The express pool is every member of the headless Service decode-express (http: /pd/*, ctrl: the control
    plane), re-resolved as the pool scales; its members' pod addresses change on restart, so the prefills'
    allow-list is a CIDR:ctrl_port entry, which lets a pod address in and keeps names and other ports out."""
    import ipaddress

    from expresslane.router.config import parse_config
    cfg = router_config(rendered, overlay)
    assert "nodes" not in cfg["pools"]["express"], "express nodes are resolved from the Service, not listed"
    pool = parse_config(cfg, source=f"{overlay} router-config").pools["express"]
    service = one(rendered, overlay, "Service", "decode-express")
    assert service["spec"]["clusterIP"] == "None"  # headless: one A record per member
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert pool.kind == "expresslane" and pool.dns is not None and pool.dns.name == "decode-express"
    assert (pool.dns.port, pool.dns.ctrl_port) == (ports["http"], ports["ctrl"])
    allow = _allow_list(rendered, overlay)
    networks = [(h, p) for h, p in allow.expresslane_allowed_destinations if not isinstance(h, str)]
    assert networks, "the allow-list names no CIDR: a restarted express pod (new address) would be refused"
    assert all(p == ports["ctrl"] for _, p in networks)
    net = networks[0][0]
    inside = str(net.network_address + 1)
    assert allow.allows(inside, ports["ctrl"]) and not allow.allows(inside, ports["http"])
    assert not allow.allows("decode-express-0.decode-express", ports["ctrl"])
    assert isinstance(net, ipaddress.IPv4Network | ipaddress.IPv6Network) and net.is_private


def test_the_tilert_express_node_is_named_by_its_address_in_the_allow_list(rendered):
    """tilert: one host-network node at the labelled node's private address, which the allow-list names exactly."""
    cfg = router_config(rendered, "tilert")
    allow = _allow_list(rendered, "tilert")
    nodes = cfg["pools"]["express"]["nodes"]
    assert nodes and all(allow.allows(n["ctrl_host"], n["ctrl_port"]) for n in nodes)
    assert all(isinstance(h, str) for h, _ in allow.expresslane_allowed_destinations)


def test_dashboards_configmap_for_grafanas_sidecar(rendered):
    cm = configmap(rendered, "cpu-demo", "expresslane-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    want = {p.name: json.loads(p.read_text()) for p in (REPO / "grafana" / "dashboards").glob("*.json")}
    assert {k: json.loads(v) for k, v in cm["data"].items()} == want


def test_prometheus_scrapes_the_jobs_the_dashboards_use(rendered):
    cfg = yaml.safe_load(configmap(rendered, "cpu-demo", "prometheus-config")["data"]["prometheus.yml"])
    compose = yaml.safe_load((REPO / "compose" / "prometheus" / "prometheus.yml").read_text())
    assert {j["job_name"] for j in cfg["scrape_configs"]} == {j["job_name"] for j in compose["scrape_configs"]}
    services = {s["metadata"]["name"]: s for s in objects(rendered, "cpu-demo", "Service")}
    for job in cfg["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            for name in sd["names"]:
                assert services[name]["spec"]["clusterIP"] == "None", f"{name}: scrape every member"
    rules = configmap(rendered, "cpu-demo", "prometheus-rules")
    assert set(rules["data"]) == {p.name for p in (REPO / "compose" / "prometheus" / "rules").glob("*.yml")}
