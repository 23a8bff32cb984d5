"""scripts/gpu_check.py: its command line, the commands it plans for the GPU machine (checked here on a CPU, where
it cannot run), its deadline with real processes, and its summary of recorded runs (docs/bench/)."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

import gpu_carry
import gpu_check
import pytest

REPO = Path(__file__).resolve().parents[2]
TEXTS = "docs/bench/2026-12-04-cost-aware-drafter/texts.json"


def _argv(step: gpu_check.Step) -> list[str]:
    return list(step.argv[1:])  # without the interpreter (this venv's here, python3 on the GPU machine)


def _plan(*argv: str) -> list[gpu_check.Step]:
    return gpu_check.plan(gpu_check.parse_args(list(argv)))


def test_help_says_what_each_subcommand_measures_and_how_long() -> None:
    for cmd, says in (("tests", "1,153 tests in 163 s"), ("bench", "about 4-5 min"), ("stack", "about 10 min"),
                      ("all", "Deadlines:")):
        out = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), cmd, "--help"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert says in out.stdout, (cmd, out.stdout)
    bench = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "bench", "--help"],
                           capture_output=True, text=True, timeout=60).stdout
    for name, part in gpu_check.PARTS.items():
        assert f"  {name} " in bench and ("[default]" in bench.split(f"  {name} ")[1][:20]) == part.default


def test_bench_measures_the_node_as_deployed_by_default(tmp_path) -> None:
    steps = _plan("bench", str(tmp_path))
    json_out = str(tmp_path / "bench.jsonl")
    common = ["-m", "expresslane.engine.decode.bench", "--device", "cuda", "--dtype", "bfloat16",
              "--contexts", "1024,8192,32768", "--max-seq-len", "33100", "--tokens", "256"]

    def argv(shape: str, *flags: str) -> list[str]:
        return [*common[:2], "--random-shape", shape, *common[2:], *flags, "--repeats", "2", "--json", json_out]

    drafts = ("--oracle-k", "1,2,3,4", "--lookup", "--replay-text", TEXTS)

    def users(shape: str) -> list[str]:  # the node's seats: several users on one engine
        return ["-m", "expresslane.engine.decode.bench_users", "--random-shape", shape, "--device", "cuda",
                "--dtype", "bfloat16", "--contexts", "1024,8192,32768", "--users", "1,2,4,8", "--tokens", "128",
                "--speculation", "on,off", "--repeats", "3", "--max-seq-len", "33100",
                "--json", str(tmp_path / "users.jsonl")]

    # shape by shape: the one-user engine, the engine without speculation it is judged against, then several
    # users on the engine the node builds on a GPU. The 1B node's and both plain engines' commands are the ones
    # the shell check ran before (scripts/gpu_check.sh, 6410eda).
    assert [_argv(s) for s in steps] == [
        argv("llama-8b", "--lean-gemv", "per-request", *drafts),
        argv("llama-8b", "--speculation-k", "0"),
        users("llama-8b"),
        argv("llama-1b", *drafts),
        argv("llama-1b", "--speculation-k", "0"),
        users("llama-1b"),
    ]
    assert [s.label for s in steps][0] == "llama-8b node (per-request)"


def test_the_node_family_is_the_one_the_express_node_resolves() -> None:
    """gpu_check.py names the node's GEMV family per shape without importing the engine (it plans on machines
    without torch): the same as the node's own rule (server/config.py) on the engine's shapes."""
    from expresslane.engine.decode.engine import PER_REQUEST
    from expresslane.engine.decode.shapes import SHAPES
    from expresslane.engine.server.config import PER_REQUEST_MIN_HIDDEN, resolve_lean_gemv

    assert gpu_check.PER_REQUEST_MIN_HIDDEN == PER_REQUEST_MIN_HIDDEN
    for shape, hidden in gpu_check.SHAPE_HIDDEN.items():
        assert SHAPES[shape]["hidden_size"] == hidden
        node = resolve_lean_gemv("auto", device_type="cuda", speculation=True, lean=None, cuda_graph=None,
                                 attention=None, hidden_size=hidden)
        assert gpu_check.node_gemv(shape) == (PER_REQUEST if node == PER_REQUEST else "cuda-core"), (shape, node)


def test_families_bench_every_other_family_at_the_family_contexts(tmp_path) -> None:
    steps = _plan("bench", str(tmp_path), "--parts", "families", "--texts", "")
    got = [(a[a.index("--random-shape") + 1], a[a.index("--lean-gemv") + 1], a[a.index("--contexts") + 1],
            a[a.index("--oracle-k") + 1], "--replay-text" in a) for a in map(_argv, steps)]
    assert got == [("llama-8b", "cuda-core", "1024,32768", "3,4", False),
                   ("llama-8b", "tensor-core", "1024,32768", "3,4", False),
                   ("llama-1b", "per-request", "1024,32768", "3,4", False),
                   ("llama-1b", "tensor-core", "1024,32768", "3,4", False)]


def test_a_new_part_joins_the_plan_and_the_help(tmp_path, monkeypatch) -> None:
    """The registry is where a part is added (the multi-user seats, say): registered, it runs for each shape
    after the parts before it, and `--parts` and `bench --help` know it."""
    monkeypatch.setattr(gpu_check, "PARTS", dict(gpu_check.PARTS))

    @gpu_check.bench_part("seats", default=True, measures="several users on one node; about 1 min")
    def _seats(args: argparse.Namespace, shape: str) -> list[gpu_check.Step]:
        return [gpu_check.Step(f"{shape} seats", gpu_check.decode_bench(args, shape, "1024", "--users", "4"))]

    labels = [s.label for s in _plan("bench", str(tmp_path), "--shapes", "llama-1b")]
    assert labels == ["llama-1b node (cuda-core)", "llama-1b plain engine (no speculation)",
                      "llama-1b users (1,2,4,8 at once)", "llama-1b seats"]
    assert [s.label for s in _plan("bench", str(tmp_path), "--parts", "seats", "--shapes", "llama-8b")] == \
        ["llama-8b seats"]


def test_the_tests_phase_runs_the_same_pytest_command(tmp_path) -> None:
    (step,) = _plan("tests", str(tmp_path))
    assert _argv(step) == shlex.split("-m pytest -v -o addopts= -p no:cacheprovider --timeout 180 -rfE -n 8 "
                                      "--dist worksteal --durations 15 tests/unit/engine tests/unit/transfer")
    (step,) = _plan("tests", str(tmp_path), "--tests", "tests/unit/engine/test_family.py", "--test-workers", "2")
    assert _argv(step)[-1] == "tests/unit/engine/test_family.py" and _argv(step)[_argv(step).index("-n") + 1] == "2"


def test_the_stack_is_gpu_stack_with_the_node_as_deployed(tmp_path) -> None:
    t0 = time.time()
    (step,) = _plan("stack", str(tmp_path), "--stack-shapes", "llama-1b", "--stack-args", "--ucx-tls cuda_ipc,rc")
    argv = _argv(step)
    assert argv[:7] == ["scripts/gpu_stack.py", "--shapes", "llama-1b", "--models", "/tmp/models", "--out",
                        str(tmp_path / "stack")]
    assert t0 + 550 <= int(argv[argv.index("--deadline-epoch") + 1]) <= time.time() + 570
    assert argv[-4:] == ["--express-speculation", "on", "--ucx-tls", "cuda_ipc,rc"]  # speculation on, as deployed
    import gpu_stack

    gpu_stack.parse_args(argv[1:])  # a command line gpu_stack.py takes
    assert [s.label for s in _plan("all", str(tmp_path))] == \
        ["tests", *[s.label for s in _plan("bench", str(tmp_path))], "stack"]


def test_the_carried_stacks_last_call_is_a_command_line_of_the_check(tmp_path, capsys) -> None:
    """scripts/gpu_carry.py prints the device calls; its last one runs this check's stack."""
    carry = tmp_path / "carry" / "p1"
    carry.mkdir(parents=True)
    (carry / "manifest.json").write_text('{"parts": [{"name": "site.tar.xz.01", "bytes": 1, "sha256": "x"}]}')
    assert gpu_carry.main(["--carry-dir", str(tmp_path / "carry"), "calls", "--shapes", "llama-8b,llama-1b"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    for command in (out["calls"][-1]["command"], out["followup"]["command"]):
        words = shlex.split(command.replace("$OUT", str(tmp_path / "out")).split("; ")[-1])
        argv = words[words.index("scripts/gpu_check.py") + 1:-1]  # the last word: 2>&1
        args = gpu_check.parse_args(argv)
        assert (args.cmd, args.deadline_s, args.out) == ("stack", 570, tmp_path / "out")
    assert gpu_check.parse_args(argv).stack_shapes == ["llama-1b"]  # the follow-up: the last shape again


def test_bad_arguments_are_refused_with_what_is_known(tmp_path, capsys) -> None:
    for argv, says in ((["bench", str(tmp_path), "--parts", "node,norm"], "unknown parts or shapes ['norm']"),
                       (["bench", str(tmp_path), "--shapes", "llama-70b"], "unknown parts or shapes ['llama-70b']"),
                       (["bench", str(tmp_path), "--texts", "nothing.json"], "--texts nothing.json: no such file"),
                       (["stack", str(tmp_path), "--stack-shapes", "tiny"], "--stack-shapes takes"),
                       (["run", str(tmp_path)], "invalid choice: 'run'")):
        with pytest.raises(SystemExit) as e:
            gpu_check.parse_args(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err, argv


def test_without_a_gpu_it_says_so_before_running_anything(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="no nvidia-smi here: the check runs on a CUDA machine"):
        gpu_check.main(["bench", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_the_deadline_interrupts_a_step_and_the_rest_is_not_started(tmp_path, monkeypatch) -> None:
    """Real processes under coreutils' timeout: a bench step still running at the deadline gets SIGINT, the run
    says so in phases.txt (what the targets read), and the next step is not started."""
    monkeypatch.setattr(gpu_check, "PARTS", {})
    sleeps = [("sleep", "30"), ("touch", str(tmp_path / "second-step-ran"))]

    @gpu_check.bench_part("sleeps", default=True, measures="two commands")
    def _sleeps(args: argparse.Namespace, shape: str) -> list[gpu_check.Step]:
        return [gpu_check.Step(f"{shape} {argv[0]}", argv) for argv in sleeps]

    args = gpu_check.parse_args(["bench", str(tmp_path / "out"), "--shapes", "llama-1b", "--deadline-s", "12"])
    run = gpu_check.Run(args)
    t0 = time.monotonic()
    gpu_check.run_bench(run)
    assert time.monotonic() - t0 < 25
    phases = (tmp_path / "out" / "phases.txt").read_text().splitlines()
    assert phases[0] == "commit unknown (pass --commit)"
    assert phases[1] == "bench interrupted at the run's budget (--deadline-s) in llama-1b sleep"
    assert phases[2].startswith("bench ") and phases[2].endswith(" s")
    assert not (tmp_path / "second-step-ran").exists()
    assert "== bench llama-1b sleep" in (tmp_path / "out" / "bench.log").read_text()


def test_a_failed_step_is_named_and_the_next_one_runs(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gpu_check, "PARTS", {})

    @gpu_check.bench_part("two", default=True, measures="a failing command, then another")
    def _two(args: argparse.Namespace, shape: str) -> list[gpu_check.Step]:
        return [gpu_check.Step("false", ("false",)), gpu_check.Step("echo", ("echo", "second"))]

    run = gpu_check.Run(gpu_check.parse_args(["bench", str(tmp_path), "--shapes", "llama-1b"]))
    gpu_check.run_bench(run)
    assert "bench step failed (rc 1): false" in run.phases
    assert "second\n" in (tmp_path / "bench.log").read_text()


def test_summary_of_a_recorded_check(tmp_path) -> None:
    """The 2026-12-06 check at the node's per-request auto (its summary.txt is what the shell check printed)."""
    run = REPO / "docs" / "bench" / "2026-12-06-default-node-check" / "check"
    lines = gpu_check.summary(run, commit="87436b9")
    assert lines[0].startswith("== GPU check ") and lines[0].endswith(" commit 87436b9")
    recorded = (run / "summary.txt").read_text().splitlines()
    assert lines[1] == recorded[1]  # the tests' closing line
    table = lines[lines.index(recorded[3]):lines.index("targets (docs/performance.md)")]
    assert table == recorded[3:recorded.index("targets (docs/performance.md)")]  # the table and the starts
    assert "  yes  GPU tests all green: 1153 passed, 35 skipped, 4 warnings" in lines


def test_summary_of_both_lanes(tmp_path) -> None:
    """The stack's table from gpu_stack.py's files (the 2026-12-04 H200 run kept in docs/bench/)."""
    lines = gpu_check.stack_lines(REPO / "docs" / "bench" / "2026-12-04-gpu-both-lanes")
    assert lines[1].startswith("  llama-8b  stack up in 115.6 s, bench 209.8 s (rc 0)")
    assert lines[2] == ("    prompt   1024  express    248.6 tok/s     43.0 ms  native    213.7 tok/s    368.9 ms  "
                        "express / native 1.16x")
    assert any(line.startswith("    greedy   1024: express_vs_prefill diverges at 4") for line in lines)
    assert gpu_check.stack_lines(tmp_path) == []


def test_the_stack_unpacks_the_carried_vllm_then_runs(tmp_path, monkeypatch) -> None:
    """Parts in --parts-dir (as the carry's last call leaves them): `stack` assembles --site from them with
    scripts/gpu_carry.py, then starts the stack with that site first on the path."""
    import io
    import json
    import shutil
    import tarfile

    digest = gpu_carry.sha256_file(gpu_carry.LOCK)
    archive = tmp_path / "site.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        files = {"vllm/__init__.py": b"", gpu_carry.MARKER: json.dumps({"lock_sha256": digest}).encode()}
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "carry").mkdir()
    gpu_carry.split_archive(archive, tmp_path / "carry", 10_000_000, digest)
    parts = tmp_path / "parts"
    shutil.copytree(tmp_path / "carry" / "p1", parts)
    seen = {}

    def stack_step(args: argparse.Namespace, deadline_epoch: float) -> gpu_check.Step:
        seen["deadline"] = deadline_epoch
        return gpu_check.Step("stack", ("sh", "-c", 'echo "$PYTHONPATH" > "$0"', str(tmp_path / "path.txt")))

    monkeypatch.setattr(gpu_check, "stack_step", stack_step)
    args = gpu_check.parse_args(["stack", str(tmp_path / "out"), "--parts-dir", str(parts), "--site",
                                 str(tmp_path / "site")])
    run = gpu_check.Run(args, write_files=False)
    gpu_check.run_stack(run)
    assert (tmp_path / "site" / "vllm" / "__init__.py").exists()
    assert (tmp_path / "path.txt").read_text().split(":")[0] == str(tmp_path / "site")
    assert run.phases[-1].startswith("stack ") and len(run.phases) == 1, run.phases
    assert time.time() + 500 < seen["deadline"] < time.time() + 570


def test_prepare_parses_without_an_output_folder() -> None:
    """`prepare` runs here, before any run folder exists: it takes no OUT."""
    args = gpu_check.parse_args(["prepare"])
    assert args.cmd == "prepare" and not hasattr(args, "out")
