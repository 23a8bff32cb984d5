"""The express node's command line: CPU placement parsing and its application."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from expresslane.engine.server.config import parse_args, parse_cpu_list


@pytest.mark.parametrize("text,cpus", [("0", (0,)), ("1", (1,)), ("0-3", (0, 1, 2, 3)), ("4,0-1", (0, 1, 4)),
                                       (" 2 , 2-3 ", (2, 3))])
def test_cpu_list_syntax(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", ",", "a", "3-1", "1-", "-1", "0-x"])
def test_bad_cpu_lists_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpu_list(text)


def test_cli_placement_flags(capsys) -> None:
    cfg = parse_args(["--model", "m", "--cpu-bind", "0-1", "--threads", "1"])
    assert cfg.cpu_bind == (0, 1) and cfg.threads == 1
    assert parse_args(["--model", "m", "--cpu-bind", "auto"]).cpu_bind is None
    assert parse_args(["--model", "m", "--cpu-bind", ""]).cpu_bind is None
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--cpu-bind", "1-0"])
    assert "--cpu-bind" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--threads", "0"])


def test_placement_pins_the_process_and_sizes_torch() -> None:
    cpu = min(os.sched_getaffinity(0))
    code = ("import os, torch\n"
            "from expresslane.engine.server.__main__ import apply_cpu_placement\n"
            "from expresslane.engine.server.config import parse_args\n"
            f"apply_cpu_placement(parse_args(['--model', 'm', '--cpu-bind', '{cpu}']))\n"
            "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[-2] == f"[{cpu}] 1"


def test_placement_on_a_cpu_we_may_not_use_is_a_clear_exit() -> None:
    code = ("from expresslane.engine.server.__main__ import apply_cpu_placement\n"
            "from expresslane.engine.server.config import parse_args\n"
            "apply_cpu_placement(parse_args(['--model', 'm', '--cpu-bind', '4095']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--cpu-bind 4095" in out.stderr and "Traceback" not in out.stderr


def test_deadline_flags_and_safe_defaults() -> None:
    cfg = parse_args(["--model", "m"], env={})
    assert (cfg.max_timeout_s, cfg.reservation_ttl_s, cfg.request_deadline_s, cfg.stall_timeout_s) == (300, 60, 600, 30)
    assert cfg.verify_checksum is True and cfg.node_token is None and cfg.peer_secret is None
    cfg = parse_args(["--model", "m", "--max-timeout-s", "60", "--kv-timeout-s", "20", "--reservation-ttl-s", "5",
                      "--request-deadline-s", "90", "--stall-timeout-s", "3", "--health-interval-s", "0.5",
                      "--health-probe-timeout-s", "1", "--max-connections", "8", "--no-verify-checksum"], env={})
    assert (cfg.max_timeout_s, cfg.kv_timeout_s, cfg.reservation_ttl_s, cfg.request_deadline_s) == (60, 20, 5, 90)
    assert (cfg.stall_timeout_s, cfg.health_interval_s, cfg.health_probe_timeout_s) == (3, 0.5, 1)
    assert cfg.max_connections == 8 and cfg.verify_checksum is False


@pytest.mark.parametrize("argv", [["--stall-timeout-s", "0"], ["--request-deadline-s", "-1"],
                                  ["--kv-timeout-s", "400"], ["--max-connections", "0"]])
def test_bad_deadlines_are_usage_errors(argv, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", *argv], env={})
    assert argv[0] in capsys.readouterr().err


def test_secrets_come_from_env_or_file_and_stay_out_of_repr(tmp_path, capsys) -> None:
    f = tmp_path / "token"
    f.write_text("tok-from-file\n")
    cfg = parse_args(["--model", "m"], env={"EXPRESS_NODE_TOKEN_FILE": str(f), "EXPRESSLANE_PEER_SECRET": "peer"})
    assert cfg.node_token == "tok-from-file" and cfg.peer_secret == b"peer"
    assert "tok-from-file" not in repr(cfg) and "peer" not in repr(cfg).replace("peer_secret", "")
    with pytest.raises(SystemExit):
        parse_args(["--model", "m"], env={"EXPRESS_NODE_TOKEN_FILE": str(f), "EXPRESS_NODE_TOKEN": "x"})
    err = capsys.readouterr().err
    assert "both EXPRESS_NODE_TOKEN and EXPRESS_NODE_TOKEN_FILE" in err and "tok-from-file" not in err


def test_cli_speculation_and_attention_flags() -> None:
    cfg = parse_args(["--model", "m"])
    assert cfg.speculation is True and cfg.spec_k == 4 and cfg.attention is None
    cfg = parse_args(["--model", "m", "--speculation", "off", "--spec-k", "8", "--attention", "split"])
    assert cfg.speculation is False and cfg.spec_k == 8 and cfg.attention == "split"
    for attention in ("live", "masked"):
        assert parse_args(["--model", "m", "--attention", attention]).attention == attention
    for bad in (["--spec-k", "0"], ["--spec-k", "17"], ["--speculation", "maybe"], ["--attention", "flash"]):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", *bad])


def test_lean_flag(capsys) -> None:
    assert parse_args(["--model", "m"]).lean is None  # wherever it applies (docs/bench/2026-12-01-gpu-greedy-chain/)
    assert parse_args(["--model", "m", "--device", "cuda", "--lean", "off"]).lean is False
    assert parse_args(["--model", "m", "--device", "cuda", "--lean", "auto"]).lean is None
    assert parse_args(["--model", "m", "--device", "cuda:0", "--lean", "on"]).lean is True
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--lean", "on"])  # cpu
    assert "--lean on needs a cuda device" in capsys.readouterr().err


def test_lean_gemv_flag(capsys) -> None:
    """--lean-gemv picks the lean step's GEMV kernels (models/lean.py); auto by default; a typo is refused."""
    assert parse_args(["--model", "m"]).lean_gemv == "auto"  # a CPU: the engine's auto (one family)
    assert parse_args(["--model", "m", "--lean-gemv", "cuda-core"]).lean_gemv == "cuda-core"
    assert parse_args(["--model", "m", "--lean-gemv", "tensor-core"]).lean_gemv == "tensor-core"
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--lean-gemv", "tensorcore"])
    assert "invalid choice: 'tensorcore'" in capsys.readouterr().err
    # per-request (decode/family.py): both families' runners, so the lean step on a cuda device, speculating
    assert parse_args(["--model", "m", "--device", "cuda", "--lean-gemv", "per-request"]).lean_gemv == "per-request"
    for refused in (["--device", "cpu"], ["--device", "cuda", "--speculation", "off"],
                    ["--device", "cuda", "--lean", "off"]):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", "--lean-gemv", "per-request", *refused])
        assert "--lean-gemv per-request chooses a lean-step GEMV family" in capsys.readouterr().err


def test_lean_gemv_auto_is_per_request_where_the_lean_step_speculates_on_a_large_enough_model() -> None:
    """The node's auto, resolved against the checkpoint when the engine is built: a GEMV family per request
    (decode/family.py) on a cuda device whose lean step speculates, for a model of hidden size 4096 or more
    (docs/bench/2026-12-06-per-request-gate/: passes at the 8B shape, not at the 1B one); the engine's auto
    (cuda-core) wherever one of those does not hold; an explicit family stays what was asked for."""
    from expresslane.engine.server.config import PER_REQUEST_MIN_HIDDEN, resolve_lean_gemv

    def node(*args: str, hidden: int = 4096) -> str:
        c = parse_args(["--model", "m", *args])
        assert c.lean_gemv in ("auto", "cuda-core", "tensor-core", "per-request")  # parse_args leaves it as given
        return resolve_lean_gemv(c.lean_gemv, device_type=c.device.split(":")[0], speculation=c.speculation,
                                 lean=c.lean, cuda_graph=c.cuda_graph, attention=c.attention, hidden_size=hidden)

    assert PER_REQUEST_MIN_HIDDEN == 4096
    assert parse_args(["--model", "m", "--device", "cuda"]).lean_gemv == "auto"
    assert node("--device", "cuda") == "per-request"  # the 8B shape
    assert node("--device", "cuda", hidden=8192) == "per-request"
    assert node("--device", "cuda:1", "--lean", "on") == "per-request"
    assert node("--device", "cuda", "--attention", "split") == "per-request"
    assert node("--device", "cuda", hidden=2048) == "auto"  # the 1B shape
    assert node("--device", "cuda", hidden=3072) == "auto"  # unmeasured: one family
    for one_family in (["--speculation", "off"], ["--lean", "off"], ["--cuda-graph", "off"],
                       ["--attention", "masked"], ["--attention", "live"], ["--device", "cpu"]):
        assert node("--device", "cuda", *one_family) == "auto", one_family
    for family in ("cuda-core", "tensor-core"):
        assert node("--device", "cuda", "--lean-gemv", family) == family


def test_the_node_reads_the_hidden_size_from_the_checkpoint(tmp_path) -> None:
    """server/__main__.node_lean_gemv: auto is resolved against the model directory's config.json."""
    import json

    from expresslane.engine.server.__main__ import node_lean_gemv

    cfg = {"model_type": "llama", "vocab_size": 256, "hidden_size": 4096, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert node_lean_gemv(parse_args(["--model", str(tmp_path), "--device", "cuda"])) == "per-request"
    assert node_lean_gemv(parse_args(["--model", str(tmp_path)])) == "auto"  # a CPU
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2048}))
    assert node_lean_gemv(parse_args(["--model", str(tmp_path), "--device", "cuda"])) == "auto"
    assert node_lean_gemv(parse_args(["--model", str(tmp_path), "--device", "cuda",
                                      "--lean-gemv", "tensor-core"])) == "tensor-core"


def test_seats_flag(capsys) -> None:
    assert parse_args(["--model", "m"]).seats is None  # auto
    assert parse_args(["--model", "m", "--seats", "3"]).seats == 3
    for bad in ("0", "9", "many"):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", "--seats", bad])
        assert "--seats" in capsys.readouterr().err


def test_seats_auto_is_four_on_a_cpu_and_sized_by_memory_on_a_gpu() -> None:
    from expresslane.engine.server.config import MAX_SEATS, resolve_seats

    gib = 2**30
    seat_8b_32k = 33_100 * 131_072  # the 8B shape's K+V per token (32 layers, 8 KV heads of 128, bf16)
    assert resolve_seats(None, device_type="cpu", seat_bytes=10**8, free_bytes=None, multi_seat_step=None)[0] == 4
    # an H200 with the 8B weights loaded (139 GiB - 16 GB free) at max_seq_len 33,100: 12 fit, capped at 8
    seats, why = resolve_seats(None, device_type="cuda", seat_bytes=seat_8b_32k, free_bytes=124 * gib,
                               multi_seat_step=None)
    assert seats == MAX_SEATS and "12 seats of 8.08 GiB" in why
    # an H100 (79 GiB - 16 GB): 6
    assert resolve_seats(None, device_type="cuda", seat_bytes=seat_8b_32k, free_bytes=63 * gib,
                         multi_seat_step=None)[0] == 6
    # a node that cannot step several users: auto is one seat and says why; asking for more is an error
    assert resolve_seats(None, device_type="cuda", seat_bytes=1, free_bytes=gib,
                         multi_seat_step="no lean step") == (1, "no lean step")
    with pytest.raises(ValueError, match="no lean step"):
        resolve_seats(4, device_type="cuda", seat_bytes=1, free_bytes=gib, multi_seat_step="no lean step")
    assert resolve_seats(2, device_type="cpu", seat_bytes=1, free_bytes=None, multi_seat_step=None) == \
        (2, "as configured")


def test_the_node_builds_seats_on_a_cpu_and_one_seat_per_request_family_when_asked(tmp_path) -> None:
    from expresslane.engine.decode.shapes import random_checkpoint  # noqa: F401  (the engine imports cleanly)
    from expresslane.engine.server.__main__ import node_engine_options

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(
        '{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 4096, '
        '"intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8, '
        '"max_position_embeddings": 64, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}')
    assert node_engine_options(parse_args(["--model", str(model)])) == ("auto", 4)
    assert node_engine_options(parse_args(["--model", str(model), "--seats", "1"])) == ("auto", 1)
    assert node_engine_options(parse_args(["--model", str(model), "--compile"])) == ("auto", 4)  # compiled too
