"""scripts/soak.py --compose on the default stack, which publishes only the router and Prometheus: the soak reaches
the internal services at their containers' addresses, looked up again each time (a restarted container may come back
at another), and reads the generated secrets at their per-secret paths. `docker` is faked (no engine needed)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests" / "integration"))

import soak  # noqa: E402


class FakeDocker:
    def __init__(self) -> None:
        self.ips = {"cid-prefill": "172.30.0.2", "cid-decode-native": "172.30.0.3", "cid-decode-express": "172.30.0.4"}
        self.calls: list[list[str]] = []

    def __call__(self, cmd: list[str]) -> str:
        self.calls.append(cmd)
        if cmd[:2] == ["docker", "compose"] and "ps" in cmd:
            return f"cid-{cmd[-1]}\n"
        if cmd[:2] == ["docker", "inspect"]:
            return self.ips[cmd[-1]] + " \n"
        raise AssertionError(cmd)


def test_unpublished_services_are_reached_at_their_container_addresses(monkeypatch):
    docker = FakeDocker()
    monkeypatch.setattr(soak.ComposeTarget, "_bearer", lambda self, name: {"Authorization": f"Bearer {name}"})
    target = soak.ComposeTarget("p", [], {"router": 8080, "prometheus": 9090})
    monkeypatch.setattr(target, "_run", docker)
    ep = target.endpoints
    assert ep.router == "http://127.0.0.1:8080" and ep.prometheus == "http://127.0.0.1:9090"
    assert ep.prefill == "http://172.30.0.2:8000"
    assert ep.health == {"decode-express": "http://172.30.0.4:5557/health",
                         "decode-native": "http://172.30.0.3:8100/health", "prefill": "http://172.30.0.2:8000/health"}
    assert ep.express_status == "http://172.30.0.4:5557/decode_status"
    assert ep.node_headers == {"Authorization": "Bearer express_node_token"}
    docker.ips["cid-decode-express"] = "172.30.0.9"  # restarted elsewhere: the next look-up follows it
    assert target.endpoints.express_status == "http://172.30.0.9:5557/decode_status"
    # a service given in --ports (the dev overlay publishes them) is reached there instead
    published = soak.ComposeTarget("p", [], {"router": 8080, "prefill": 8000})
    monkeypatch.setattr(published, "_run", docker)
    assert published.endpoints.prefill == "http://127.0.0.1:8000"


def test_secrets_are_read_at_their_per_secret_paths(monkeypatch):
    seen = []

    class Done:
        returncode, stdout = 0, "s3cret\n"

    monkeypatch.setattr(soak.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or Done())
    target = soak.ComposeTarget("p", [], {"router": 8080})
    assert target._headers[1] == {"Authorization": "Bearer s3cret"}
    assert ["exec", "-T", "router", "cat", "/run/expresslane/secrets/vllm_api_key/vllm_api_key"] == seen[1][-5:]


def test_a_refusal_is_blamed_on_the_service_its_message_names():
    from fault_support import Outcome

    def b(msg: str) -> str | None:
        return soak.blamed(Outcome(status=503, error_type="service_unavailable", error=msg))

    assert b("no prefill server takes traffic (unhealthy by its health probes); retry later") == "prefill"
    assert b("prefill: cannot connect to <upstream> (refused)") == "prefill"
    assert b("the express lane cannot serve this request now (no_healthy_node: ...)") == "decode-express"
    assert b("no decode node of pool 'native' takes traffic (unhealthy by its probes)") == "decode-native"
    assert b("something else") is None
