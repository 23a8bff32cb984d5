"""scripts/gpu_stack.py: the one-GPU stack's command lines come from the launch scripts with the GPU settings, and
the cross-lane greedy comparison names the first divergence and its margin."""

from __future__ import annotations

import json
import shlex

import gpu_stack


def test_dry_run_command_lines(tmp_path, capsys) -> None:
    args = gpu_stack.parse_args(["--dry-run", "--shapes", "llama-8b", "--models", str(tmp_path), "--out", "x"])
    assert gpu_stack.dry_run(["llama-8b"], args) == 0
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1] for line in capsys.readouterr().out.splitlines()
             if line.startswith("## llama-8b ")}
    prefill = shlex.split(lines["## llama-8b prefill"])
    kv = json.loads(prefill[prefill.index("--kv-transfer-config") + 1])
    nixl, express = kv["kv_connector_extra_config"]["connectors"]
    assert (kv["kv_connector"], nixl["kv_buffer_device"]) == ("MultiConnector", "cuda")
    assert express["kv_connector_extra_config"]["staging_device"] == "device"
    for service in ("prefill", "decode-native"):
        argv = shlex.split(lines[f"## llama-8b {service}"])
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == "10G"
        assert argv[argv.index("--dtype") + 1] == "bfloat16" and "--enable-auto-tool-choice" not in argv
    native = shlex.split(lines["## llama-8b decode-native"])
    assert json.loads(native[native.index("--kv-transfer-config") + 1])["kv_buffer_device"] == "cuda"
    expr = shlex.split(lines["## llama-8b decode-express"])
    assert expr[expr.index("--device") + 1] == "cuda" and expr[expr.index("--speculation") + 1] == "off"
    assert "--prompts 1024,8192" in lines["## llama-8b bench"] and "--concurrency 1,2,4" in lines["## llama-8b bench"]


def test_compare_names_the_first_divergence_and_both_margins() -> None:
    a = {"token_ids": [5, 6, 7, 8], "top2_margin": [3.0, 2.5, 0.01, 4.0]}
    b = {"token_ids": [5, 6, 9, 8], "top2_margin": [3.1, 2.4, 0.02, 4.0]}
    assert gpu_stack._compare(a, dict(a)) == {"verdict": "identical", "tokens": 4}
    out = gpu_stack._compare(a, b)
    assert out["verdict"] == "diverges" and out["first_divergence"] == 2
    assert (out["a_token"], out["b_token"]) == (7, 9)
    assert (out["a_top2_logprob_margin"], out["b_top2_logprob_margin"]) == (0.01, 0.02)
    assert gpu_stack._compare({"token_ids": None}, b)["verdict"] == "missing"
    short = gpu_stack._compare(a, {**b, "top2_margin": [3.1, 2.4]})  # a lane that drops the first token's entry
    assert short["a_top2_logprob_margin"] == 0.01 and "not aligned" in short["b_top2_logprob_margin"]
    assert gpu_stack._margin({"t1": -0.1, "t2": -2.6}) == 2.5
