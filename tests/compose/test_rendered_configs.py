"""The production configs as compose renders them (`docker compose config`), checked for what issue 12 asks:
only the router listens beyond the node's private address, no default passwords, Prometheus' lifecycle API off,
secrets only as files. Also: the CPU default publishes on 127.0.0.1 only, and Grafana's entrypoint refuses to
start without a password where it must.

Needs the Compose v2 CLI only (no Docker engine): `docker compose` or a `docker-compose` binary. .ci/compose-e2e.sh
installs it; without it these tests are skipped with that reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASE = "compose/compose.yaml"
PROD = "compose/overlays/production.yaml"
ROLES = {"one host": [], "prefill node": ["compose/roles/prefill-node.yaml"],
         "decode node": ["compose/roles/decode-node.yaml"], "express node": ["compose/roles/express-node.yaml"]}
NODES = {"PREFILL_NODE_ADDR": "10.20.0.1", "DECODE_NODE_ADDR": "10.20.0.2", "EXPRESS_NODE_ADDR": "10.20.0.3",
         "NODE_ADDR": "10.20.0.1"}  # NODE_ADDR: this host's address (per-node exporters)
PRIVATE = set(NODES.values())
# Each service's listen address as the rendered config sets it (env var, or a flag in its command).
LISTEN_ENV = ("BIND_HOST", "GF_SERVER_HTTP_ADDR")
SECRET_NAMES = ("EXPRESSLANE_PEER_SECRET", "EXPRESS_NODE_TOKEN", "VLLM_API_KEY", "ROUTER_API_KEYS", "ROUTER_API_KEY",
                "GF_SECURITY_ADMIN_PASSWORD", "GRAFANA_ADMIN_PASSWORD")


def compose_cli() -> list[str]:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("no Compose v2 CLI (docker compose / docker-compose); .ci/compose-e2e.sh installs one")


def render(files: list[str], env: dict[str, str] | None = None, profiles: tuple[str, ...] = ()) -> dict:
    args = [*compose_cli()]
    for f in files:
        args += ["-f", f]
    for p in profiles:
        args += ["--profile", p]
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("COMPOSE_", "PUBLISH_", "GRAFANA_", "ROUTER_", "VLLM_", "EXPRESS"))}
    proc = subprocess.run([*args, "config", "--format", "json"], cwd=REPO, capture_output=True, text=True,
                          env={**clean, **(env or {})}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def production(role: str) -> dict:
    return render([BASE, PROD, *ROLES[role]], NODES)


def listen_addresses(svc: dict) -> list[str]:
    env = svc.get("environment", {})
    found = [env.get(k) for k in LISTEN_ENV]
    if "DCGM_EXPORTER_LISTEN" in env:
        found.append(env["DCGM_EXPORTER_LISTEN"].rsplit(":", 1)[0] or "0.0.0.0")
    cmd = svc.get("command") or []
    for i, arg in enumerate(cmd):
        if arg.startswith("--web.listen-address="):
            found.append(arg.split("=", 1)[1].rsplit(":", 1)[0])
        if arg in ("--host", "--web.listen-address") and i + 1 < len(cmd):
            found.append(cmd[i + 1].rsplit(":", 1)[0] if arg != "--host" else cmd[i + 1])
    found += [p.get("host_ip", "0.0.0.0") for p in svc.get("ports", [])]
    return [a for a in found if a is not None]


@pytest.mark.parametrize("role", list(ROLES))
def test_only_the_router_listens_beyond_the_private_address(role):
    services = production(role)["services"]
    assert services, role
    for name, svc in services.items():
        addresses = listen_addresses(svc)
        if name == "tilert-convert":  # one-shot weight conversion: listens on nothing
            assert addresses == [], addresses
            continue
        assert addresses, f"{name}: no listen address set in the rendered config"
        if name == "router":
            assert addresses == ["0.0.0.0"], addresses
            continue
        assert set(addresses) <= PRIVATE, f"{name} listens on {addresses}, not a node's private address"
        text = json.dumps(svc)
        assert "0.0.0.0" not in text, f"{name}: 0.0.0.0 in its rendered config"


def test_each_service_binds_its_own_node():
    services = production("one host")["services"]
    want = {"prefill": "10.20.0.1", "router": "0.0.0.0", "prometheus": "10.20.0.1", "grafana": "10.20.0.1",
            "decode-native": "10.20.0.2", "decode-express": "10.20.0.3"}
    for name, addr in want.items():
        assert set(listen_addresses(services[name])) == {addr}, (name, listen_addresses(services[name]))


@pytest.mark.parametrize("role", list(ROLES))
def test_no_default_passwords_and_secrets_only_as_files(role):
    config = production(role)
    for name, svc in config["services"].items():
        env = svc.get("environment", {})
        for key, value in env.items():
            if key in SECRET_NAMES:
                assert value in ("", None), f"{name}: {key} has a literal value in the rendered config"
            if "PASSWORD" in key and not key.endswith("__FILE") and key != "GRAFANA_REQUIRE_ADMIN_PASSWORD":
                assert not value, f"{name}: {key}={value!r}"
            assert str(value).lower() != "admin" or key == "GF_SECURITY_ADMIN_USER", f"{name}: {key}=admin"
        for key, value in env.items():
            if key.endswith("_FILE") or key.endswith("__FILE"):
                assert value.startswith("/run/secrets/"), (name, key, value)
                secret = value.removeprefix("/run/secrets/")
                assert secret in {s["source"] for s in svc.get("secrets", [])}, (name, key, "secret not mounted")
    for key, secret in config.get("secrets", {}).items():
        if key == "build_ca":  # a build-time CA bundle (public certificates), not a secret
            continue
        path = Path(secret["file"])
        assert not path.is_relative_to(REPO), f"secret file inside the repo: {path}"
    if "grafana" in config["services"]:
        env = config["services"]["grafana"]["environment"]
        assert env["GRAFANA_REQUIRE_ADMIN_PASSWORD"] == "1"
        assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
        assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"


@pytest.mark.parametrize("role", list(ROLES))
def test_secrets_in_the_shell_environment_never_reach_a_production_container(role):
    leaked = {name: f"leak-{name.lower()}" for name in SECRET_NAMES}
    text = json.dumps(render([BASE, PROD, *ROLES[role]], {**NODES, **leaked})["services"])  # x-* anchors aside
    assert "leak-" not in text, [v for v in leaked.values() if v in text]


@pytest.mark.parametrize("files", [[BASE], [BASE, PROD], [BASE, "compose/overlays/offline.yaml"]])
def test_prometheus_lifecycle_api_is_off(files):
    config = render(files, NODES)
    for name, svc in config["services"].items():
        assert "--web.enable-lifecycle" not in json.dumps(svc.get("command")), name
    assert config["services"]["prometheus"]["read_only"] is True


def test_the_cpu_default_publishes_on_localhost_only():
    config = render([BASE], profiles=("tools", "host-metrics"))
    for name, svc in config["services"].items():
        for port in svc.get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", (name, port)
        assert "GF_SECURITY_ADMIN_PASSWORD" not in svc.get("environment", {}), name
    assert not any(v.get("type") == "bind" and v["source"].endswith(("/src", "/scripts"))
                   for svc in config["services"].values() for v in svc.get("volumes", [])), "source bind mount"


def test_the_single_gpu_overlay_binds_localhost_and_uses_the_host_checkpoint():
    config = render([BASE, "compose/overlays/gpu-single.yaml"], {"MODELS_HOST_DIR": "/data/ckpt", "MODEL_NAME": "Qwen3-1.7B"})
    services = config["services"]
    assert "model-init" not in services and "dcgm-exporter" in services
    for name, svc in services.items():
        assert set(listen_addresses(svc)) <= {"127.0.0.1"}, (name, listen_addresses(svc))
    for name in ("prefill", "decode-native", "decode-express"):
        svc = services[name]
        assert svc["image"].startswith("expresslane/runtime-gpu:") and svc["pull_policy"] == "build", name
        assert svc["build"]["args"]["BASE_IMAGE"].startswith("vllm/vllm-openai:"), name
        assert svc["environment"]["MODEL_DIR"] == "/models/Qwen3-1.7B", name
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"], name
    assert services["decode-express"]["environment"]["EXPRESS_DEVICE"] == "cuda"
    assert config["volumes"]["models"]["driver_opts"]["device"] == "/data/ckpt"


@pytest.mark.parametrize("files", [[BASE], [BASE, PROD], [BASE, PROD, "compose/roles/express-node.yaml"],
                                   [BASE, "compose/overlays/gpu-single.yaml"], [BASE, "compose/overlays/offline.yaml"]])
def test_code_comes_from_the_images_not_bind_mounts(files):
    for name, svc in render(files, NODES)["services"].items():
        for v in svc.get("volumes", []):
            if v.get("type") == "bind":
                rel = Path(v["source"]).relative_to(REPO) if Path(v["source"]).is_relative_to(REPO) else None
                assert rel is None or rel.parts[0] in ("compose", "grafana"), (name, v["source"])
                assert rel is None or "src" not in rel.parts, (name, v["source"])
        if "build" in svc:
            assert svc.get("pull_policy") == "build", name


def test_images_we_build_are_never_pulled():
    config = render([BASE], profiles=("tools",))
    for name, svc in config["services"].items():
        if "build" in svc:
            assert svc.get("pull_policy") == "build", name
        assert svc.get("logging", {}).get("driver") == "json-file", name
        assert "max-size" in svc["logging"]["options"], name


# ---- grafana/entrypoint.sh: the password rule, run for real (exec of Grafana's /run.sh is where it stops) ----
ENTRYPOINT = REPO / "grafana" / "entrypoint.sh"


def entrypoint(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"]}
    script = ENTRYPOINT.read_text().replace("/var/lib/grafana/admin-password", str(tmp_path / "admin-password"))
    copy = tmp_path / "entrypoint.sh"
    copy.write_text(script)
    return subprocess.run(["sh", str(copy)], env={**base, **env}, capture_output=True, text=True, timeout=30)


def test_grafana_refuses_to_start_without_a_password_in_production(tmp_path):
    proc = entrypoint(tmp_path, GRAFANA_REQUIRE_ADMIN_PASSWORD="1")
    assert proc.returncode == 78 and "refusing to start" in proc.stderr
    proc = entrypoint(tmp_path, GRAFANA_REQUIRE_ADMIN_PASSWORD="1",
                      GF_SECURITY_ADMIN_PASSWORD__FILE=str(tmp_path / "missing"))
    assert proc.returncode == 78 and "missing or empty" in proc.stderr
    proc = entrypoint(tmp_path, GRAFANA_ADMIN_PASSWORD="admin")
    assert proc.returncode == 78 and "admin" in proc.stderr


def test_grafana_starts_with_a_password_file_or_makes_a_random_one(tmp_path):
    secret = tmp_path / "pw"
    secret.write_text("s3cret-pass\n")
    proc = entrypoint(tmp_path, GRAFANA_REQUIRE_ADMIN_PASSWORD="1", GF_SECURITY_ADMIN_PASSWORD__FILE=str(secret))
    assert "refusing" not in proc.stderr and "/run.sh" in proc.stderr  # reached Grafana's own start script
    proc = entrypoint(tmp_path)  # local stack: a random password, kept
    made = (tmp_path / "admin-password").read_text()
    assert len(made) == 24 and made != "admin" and "/run.sh" in proc.stderr
    assert made not in proc.stderr + proc.stdout  # never logged


def test_the_default_stack_is_closed_by_generated_secrets():
    """secrets-init writes the internal secrets, each into a volume of its own, and each volume is mounted read-only in
    exactly the services that read that secret, which name the file (never a value); production leaves secrets-init
    out (its own secret files)."""
    services = render([BASE])["services"]
    want = {"prefill": {"VLLM_API_KEY_FILE", "EXPRESSLANE_PEER_SECRET_FILE"}, "decode-native": {"VLLM_API_KEY_FILE"},
            "decode-express": {"EXPRESS_NODE_TOKEN_FILE", "EXPRESSLANE_PEER_SECRET_FILE"},
            "router": {"VLLM_API_KEY_FILE", "EXPRESS_NODE_TOKEN_FILE"}}
    volume_of = {"VLLM_API_KEY_FILE": "secret-vllm-api-key", "EXPRESS_NODE_TOKEN_FILE": "secret-express-node-token",
                 "EXPRESSLANE_PEER_SECRET_FILE": "secret-peer-secret"}
    secret_volumes = set(volume_of.values()) | {"internal-secrets"}
    for name, svc in services.items():
        mounted = {v["source"]: v for v in svc.get("volumes", []) if v.get("source") in secret_volumes}
        if name == "secrets-init":
            assert set(mounted) == secret_volumes
            continue
        assert set(mounted) == {volume_of[n] for n in want.get(name, ())}, (name, sorted(mounted))
        env = svc.get("environment", {})
        for n in want.get(name, ()):
            v = mounted[volume_of[n]]
            assert v["read_only"] is True and env[n].startswith(v["target"] + "/"), (name, n, env[n], v["target"])
            assert not env.get(n[:-5]), name
        if mounted:  # (the router waits for the others, which wait for secrets-init)
            assert svc["depends_on"].get("secrets-init", {}).get("condition") in (
                None, "service_completed_successfully"), name
    assert "secrets-init" not in render([BASE, PROD], NODES)["services"]


# ---- least privilege on the default stack (issue 42): who can reach what --------------------------------------------

INTERNAL = ("prefill", "decode-native", "decode-express")


def test_the_default_stack_publishes_only_the_router_prometheus_and_grafana():
    """vLLM's --api-key guards only /v1 (/invocations, /tokenize, /pooling, /metrics answer without it): its servers,
    and the express node, are published nowhere; they sit on an internal network the router and Prometheus join."""
    config = render([BASE], profiles=("tools",))
    services = config["services"]
    published = {name for name, svc in services.items() if svc.get("ports")}
    assert published == {"router", "prometheus", "grafana"}, published
    assert config["networks"]["internal"].get("internal") is True
    for name in INTERNAL:
        assert set(services[name]["networks"]) == {"internal"}, (name, services[name].get("networks"))
    assert set(services["router"]["networks"]) == {"default", "internal"}
    assert set(services["prometheus"]["networks"]) == {"default", "internal"}
    assert "internal" not in services["grafana"].get("networks", {"default": None})


def test_the_dev_overlay_publishes_the_internal_services_on_localhost():
    services = render([BASE, "compose/overlays/dev.yaml"])["services"]
    want = {"prefill": {8000}, "decode-native": {8100}, "decode-express": {5556, 5557}}
    for name, ports in want.items():
        got = {int(p["target"]) for p in services[name]["ports"]}
        assert got == ports and all(p["host_ip"] == "127.0.0.1" for p in services[name]["ports"]), name
        assert set(services[name]["networks"]) == {"default", "internal"}, name
