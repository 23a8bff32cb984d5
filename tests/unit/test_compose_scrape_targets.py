"""Every compose service that exports metrics is a target of the Prometheus that stack runs, under its job.

Each shipped single-host combination is rendered by the Compose CLI (`docker compose config`: extends, overlays,
`!override` applied as compose applies them); the scrape config read is the file the rendered Prometheus service
mounts at /etc/prometheus/prometheus.yml. A service exports metrics when it runs one of the launch scripts below;
its target is `<service>:<its listen port from its environment>` (each service listens on its default port inside
the stack). The reverse holds too: every target names a service of the stack. Needs the Compose v2 CLI only (no
Docker engine); skipped without it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BASE = "compose/compose.yaml"
COMBOS = {
    "default": [BASE],
    "pools": [BASE, "compose/overlays/pools.yaml"],
    "development": [BASE, "compose/overlays/dev.yaml"],
    "offline": [BASE, "compose/overlays/offline.yaml"],
    "one GPU": [BASE, "compose/overlays/gpu-single.yaml"],
}
# launch script -> (Prometheus job, the environment variable holding the port its /metrics is on)
EXPORTERS = {
    "scripts/launch/router.sh": ("router", "ROUTER_PORT"),
    "scripts/launch/prefill.sh": ("prefill", "PREFILL_PORT"),
    "scripts/launch/decode-native.sh": ("decode-native", "DECODE_NATIVE_PORT"),
    "scripts/launch/decode-express.sh": ("decode-express", "EXPRESS_HTTP_PORT"),
}
CONFIG_PATH = "/etc/prometheus/prometheus.yml"


def _compose() -> list[str]:
    for cli in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cli[0]) and subprocess.run([*cli, "version"], capture_output=True).returncode == 0:
            return cli
    pytest.skip("no Compose v2 CLI (docker compose / docker-compose); .ci/compose-e2e.sh installs one")


def rendered(files: list[str]) -> dict:
    args = [*_compose(), *(a for f in files for a in ("-f", f)), "config", "--format", "json"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "EXPRESS", "PREFILL", "DECODE"))}
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def expected_targets(services: dict) -> dict[str, set[str]]:
    """job -> {service:port} for every service that runs a metrics-exporting launch script."""
    want: dict[str, set[str]] = {}
    for name, svc in services.items():
        command = " ".join([*(svc.get("entrypoint") or []), *(svc.get("command") or [])])
        for script, (job, port_var) in EXPORTERS.items():
            if script in command:
                port = (svc.get("environment") or {})[port_var]
                want.setdefault(job, set()).add(f"{name}:{port}")
    if "prometheus" in services:
        want.setdefault("prometheus", set()).add("prometheus:9090")
    return want


def scrape_targets(services: dict) -> dict[str, set[str]]:
    mounts = [v for v in services["prometheus"].get("volumes", []) if v.get("target") == CONFIG_PATH]
    assert len(mounts) == 1 and mounts[0]["type"] == "bind", mounts
    config = yaml.safe_load(Path(mounts[0]["source"]).read_text())
    return {c["job_name"]: {t for sc in c.get("static_configs", []) for t in sc["targets"]}
            for c in config["scrape_configs"]}


@pytest.mark.parametrize("combo", list(COMBOS))
def test_every_exporting_service_is_scraped_under_its_job(combo):
    services = rendered(COMBOS[combo])["services"]
    want, have = expected_targets(services), scrape_targets(services)
    assert {"router", "prefill", "decode-native", "decode-express"} <= set(want)
    for job, targets in want.items():
        missing = targets - have.get(job, set())
        assert not missing, f"{combo}: job {job} does not scrape {sorted(missing)} (scrapes {sorted(have.get(job, ()))})"
    for job, targets in have.items():
        if job in want:
            stale = {t for t in targets if t.split(":")[0] not in services}
            assert not stale, f"{combo}: job {job} scrapes {sorted(stale)}, which are not services of this stack"


def test_the_pools_stack_scrapes_both_members_of_each_pool():
    have = scrape_targets(rendered(COMBOS["pools"])["services"])
    assert {"prefill:8000", "prefill-2:8000"} <= have["prefill"]
    assert {"decode-native:8100", "decode-native-2:8100"} <= have["decode-native"]
