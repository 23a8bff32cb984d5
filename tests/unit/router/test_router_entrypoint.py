"""The real entrypoint (`python -m expresslane.router`) in a subprocess: keys from ROUTER_API_KEYS_FILE reach the
app through RouterSecrets (never through the YAML), JSON logs with request ids, no key in the log."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
KEY = "sk-entrypoint-5f1e2d3c4b5a"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_entrypoint_serves_with_keys_from_a_file_and_json_logs(tmp_path):
    port, dead = _free_port(), _free_port()
    cfg = tmp_path / "router.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\nprefill: {{url: 'http://127.0.0.1:{dead}', model: m}}\n"
                   f"pools: {{native: {{kind: native, nodes: ['http://127.0.0.1:{dead}']}}}}\n"
                   "aliases: {tiny: {pool: native}}\n")
    keys = tmp_path / "keys"
    keys.write_text(f"# clients\n{KEY} name=ci rps=100\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROUTER_API_KEY", "VLLM_API_KEY"))}
    env.update(ROUTER_API_KEYS_FILE=str(keys), PYTHONPATH=os.pathsep.join([str(REPO / "router" / "src"),
                                                                          env.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "expresslane.router", "--config", str(cfg), "--log-format", "json"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(base + "/health", timeout=1, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "router did not start"
            time.sleep(0.2)
        assert httpx.get(base + "/v1/models", timeout=5, trust_env=False).status_code == 401
        r = httpx.get(base + "/v1/models", headers={"authorization": f"Bearer {KEY}", "x-request-id": "e2e-1"},
                      timeout=10, trust_env=False)
        assert r.status_code == 200 and r.headers["x-request-id"] == "e2e-1"
        r = httpx.post(base + "/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                       json={"model": "tiny", "prompt": "x"}, timeout=10, trust_env=False)
        assert r.status_code == 503  # the prefill is not there: a typed error, quickly
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=15)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    records = [json.loads(ln) for ln in lines]
    assert any(r["logger"] == "expresslane.router.access" and r.get("client_request_id") == "e2e-1"
               and r.get("request_id", "").startswith("e2e-1-")
               and "GET /v1/models 200" in r["msg"] for r in records), out
    assert any("401" in r["msg"] for r in records)
    assert KEY not in out
