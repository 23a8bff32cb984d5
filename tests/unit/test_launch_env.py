"""scripts/launch/*.sh turn the contract's environment into vLLM's command line and environment (docs/deployment.md,
"Variables and secrets"). The scripts run for real with PYTHON pointing at a recorder that prints its argv
and the variables vLLM reads, instead of starting vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[2] / "scripts" / "launch"
RECORDER = "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'key': os.environ.get('VLLM_API_KEY'), 'key_file': os.environ.get('VLLM_API_KEY_FILE')}))"


def launch(script: str, tmp_path: Path, **env: str) -> dict:
    recorder = tmp_path / "python"
    recorder.write_text(f"#!{sys.executable}\n" + RECORDER.replace("; ", "\n") + "\n")
    recorder.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "EXPRESS"))}
    proc = subprocess.run(["bash", str(LAUNCH / script)], env={**base, "PYTHON": str(recorder), **env},
                          text=True, capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.mark.parametrize("script", ["prefill.sh", "decode-native.sh"])
def test_tool_parser_defaults_to_hermes(script, tmp_path):
    argv = launch(script, tmp_path)["argv"]
    assert "--enable-auto-tool-choice" in argv and flag(argv, "--tool-call-parser") == "hermes"


@pytest.mark.parametrize("script", ["prefill.sh", "decode-native.sh"])
def test_tool_parser_named_or_off(script, tmp_path):
    argv = launch(script, tmp_path, VLLM_TOOL_CALL_PARSER="llama3_json")["argv"]
    assert flag(argv, "--tool-call-parser") == "llama3_json"
    argv = launch(script, tmp_path, VLLM_TOOL_CALL_PARSER="")["argv"]
    assert "--enable-auto-tool-choice" not in argv and "--tool-call-parser" not in argv


@pytest.mark.parametrize("script", ["prefill.sh", "decode-native.sh"])
def test_api_key_from_file_reaches_vllm_but_not_its_command_line(script, tmp_path):
    secret = tmp_path / "vllm_api_key"
    secret.write_text("k-123\n")
    out = launch(script, tmp_path, VLLM_API_KEY_FILE=str(secret))
    assert out["key"] == "k-123"  # vLLM's own VLLM_API_KEY: the --api-key it enforces on /v1/*
    assert out["key_file"] is None
    assert not any("k-123" in a for a in out["argv"])


def test_api_key_from_env_and_none(tmp_path):
    assert launch("prefill.sh", tmp_path, VLLM_API_KEY="k-9")["key"] == "k-9"
    assert launch("prefill.sh", tmp_path)["key"] is None


def test_unreadable_key_file_stops_the_start(tmp_path):
    proc = subprocess.run(["bash", str(LAUNCH / "prefill.sh")],
                          env={"PATH": os.environ["PATH"], "PYTHON": "true", "VLLM_API_KEY_FILE": str(tmp_path / "no")},
                          text=True, capture_output=True, timeout=30)
    assert proc.returncode != 0 and "not readable" in proc.stderr


def test_connector_metrics_listen_where_vllm_listens(tmp_path):
    argv = launch("prefill.sh", tmp_path, BIND_HOST="10.1.2.3")["argv"]
    assert flag(argv, "--host") == "10.1.2.3"
    cfg = json.loads(flag(argv, "--kv-transfer-config"))
    express = [c for c in cfg["kv_connector_extra_config"]["connectors"] if c["kv_connector"] == "ExpressLaneConnector"]
    assert express[0]["kv_connector_extra_config"]["metrics_host"] == "10.1.2.3"


@pytest.mark.parametrize(("script", "var"), [("prefill.sh", "PREFILL_EXTRA_ARGS"),
                                              ("decode-native.sh", "DECODE_NATIVE_EXTRA_ARGS")])
def test_extra_vllm_args_are_word_split_and_off_by_default(script, var, tmp_path):
    plain = launch(script, tmp_path)["argv"]
    assert "--gpu-memory-utilization" not in plain
    argv = launch(script, tmp_path, **{var: "--gpu-memory-utilization 0.25 --kv-cache-memory-bytes 10G"})["argv"]
    assert flag(argv, "--gpu-memory-utilization") == "0.25" and flag(argv, "--kv-cache-memory-bytes") == "10G"
    assert [a for a in argv if a not in ("--gpu-memory-utilization", "0.25", "--kv-cache-memory-bytes", "10G")] == plain


def _express_extra(argv: list[str]) -> dict:
    config = json.loads(flag(argv, "--kv-transfer-config"))
    child = next(c for c in config["kv_connector_extra_config"]["connectors"]
                 if c["kv_connector"] == "ExpressLaneConnector")
    return child["kv_connector_extra_config"]


def test_staging_device_only_when_asked(tmp_path):
    assert "staging_device" not in _express_extra(launch("prefill.sh", tmp_path)["argv"])
    extra = _express_extra(launch("prefill.sh", tmp_path, EXPRESS_STAGING_DEVICE="device")["argv"])
    assert extra["staging_device"] == "device" and extra["restore_omp_affinity"] is True


def test_express_lean_gemv_reaches_the_node_only_when_set(tmp_path):
    """EXPRESS_LEAN_GEMV picks the lean step's GEMV kernels (models/lean.py); empty leaves the node's auto."""
    argv = launch("decode-express.sh", tmp_path)["argv"]
    assert "--lean-gemv" not in argv
    argv = launch("decode-express.sh", tmp_path, EXPRESS_LEAN_GEMV="cuda-core")["argv"]
    assert flag(argv, "--lean-gemv") == "cuda-core"


def test_staging_slots_cover_the_express_seats(tmp_path):
    """Every express seat can finish its prefill in the same step: the prefill's connector gets a staging slot per
    seat (EXPRESS_SEATS) unless EXPRESS_STAGING_SLOTS says otherwise; on a GPU without either, the connector's
    own default (2); on the CPU, 4 (the CPU node's seats)."""
    gpu = {"KV_BUFFER_DEVICE": "cuda"}
    assert "staging_slots" not in _express_extra(launch("prefill.sh", tmp_path, **gpu)["argv"])
    assert _express_extra(launch("prefill.sh", tmp_path, **gpu, EXPRESS_SEATS="6")["argv"])["staging_slots"] == 6
    assert _express_extra(launch("prefill.sh", tmp_path, **gpu, EXPRESS_SEATS="6",
                                 EXPRESS_STAGING_SLOTS="3")["argv"])["staging_slots"] == 3
    assert "staging_slots" not in _express_extra(launch("prefill.sh", tmp_path, **gpu, EXPRESS_SEATS="auto")["argv"])
    assert _express_extra(launch("prefill.sh", tmp_path, KV_BUFFER_DEVICE="cpu")["argv"])["staging_slots"] == 4
