#!/usr/bin/env python3
"""The express engine's GPU check on one CUDA machine: every test that can use the GPU, the decode bench of the
node as it is deployed, and both lanes through the router. One summary table, then each target of
docs/performance.md ("The GPU check") against the run (scripts/gpu_check_targets.py).

    python3 scripts/gpu_check.py prepare            # here, where pip reaches a registry (seconds)
    python3 scripts/gpu_check.py tests OUT          # there, on the GPU machine: about 3 min on an H100
    python3 scripts/gpu_check.py bench OUT          #   about 4-5 min; more with --parts (bench --help)
    python3 scripts/gpu_check.py stack OUT          #   about 10 min; vLLM must be there (docs/gpu-stack.md)
    python3 scripts/gpu_check.py all OUT            #   tests, bench and stack in turn
    python3 scripts/gpu_check.py summary OUT        # anywhere: the table and the targets again from OUT's files
    python3 scripts/gpu_check.py bench OUT --dry-run   # print the commands, run nothing

`tests`: tests/unit/engine and tests/unit/transfer with pytest-xdist (the lean step and its row-invariant verify,
the greedy chain, the first request of a fresh engine, the KV handoff and injection): 1,153 tests in 163 s on an
H100 (2026-12-06), stopped at --test-budget-s.

`bench`: the decode bench (`python -m expresslane.engine.decode.bench`) on random bf16 checkpoints of the
Llama-3.1-8B and Llama-3.2-1B shapes (decode/shapes.py), one user, greedy, 256 tokens, at contexts 1k / 8k / 32k,
and the several-users bench (`python -m expresslane.engine.decode.bench_users`: 1 / 2 / 4 / 8 users on one engine).
By default it measures the node as deployed (parts `node` and `plain`: about 4-5 min on an H100; the 2026-12-06
check's bench took 235-265 s); `bench --help` lists every part (the registry PARTS).

`stack`: scripts/gpu_stack.py: stock vLLM prefill and native decode, our express node (speculation on, as
deployed) and the router, started by scripts/launch/*.sh; the cross-lane greedy check, then scripts/bench.py
through the router, both lanes, concurrency 1 / 2 / 4, prompts 1k / 8k (2026-12-04, H200: 8B 116 s to start +
210 s of bench, 1B 96 + 75 s: about 10 min with the carried vLLM's unpacking; one command run of 10 min takes
the 8B, a second the 1B, as scripts/gpu_carry.py calls prints them). Its files go to OUT/stack/ (at most 8, as
gpu_stack.py writes them); a run of `stack` alone prints its table and writes nothing else.

Deadlines: every phase ends by --deadline-s from the start (a phase that would run past it is interrupted, what it
wrote stays, the table is still printed): 570 s, one command run of 600 s with time for the summary, for `tests`,
`bench` and `stack`; 1,800 s for `all`. OUT gets pytest.txt, bench.log, bench.jsonl, users.jsonl, phases.txt (each
phase's wall time), summary.txt (the table and the targets).

The GPU machine this was built for has python3 3.12 with torch, triton, transformers, pytest, httpx and aiohttp,
and no network: `prepare` downloads what it lacks (images/gpu/check-wheels.lock, hash-checked) into
.carry/gpu-check/ (nixl-cu13 repacked as tar.xz: 59 -> 32 MB), which travels with the tree; on the machine each
phase installs it into --site once. Where .carry/gpu-check/ is absent the machine's own packages are used, and a
missing one fails the import check before anything runs. `stack` unpacks the carried vLLM (scripts/gpu_carry.py
assemble) where its parts are there.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_targets import (bench_table, stack_lines, start_lines, targets, users_rows,  # noqa: E402
                               users_table)

REPO = Path(__file__).resolve().parent.parent
CARRY = REPO / ".carry" / "gpu-check"
LOCK = REPO / "images" / "gpu" / "check-wheels.lock"
TEXTS = "docs/bench/2026-12-04-cost-aware-drafter/texts.json"  # the copy model's recorded requests
PYTHON = sys.executable or "python3"

# The node's GEMV family by shape (server/config.py resolve_lean_gemv: per-request on a speculating CUDA node of
# hidden size >= PER_REQUEST_MIN_HIDDEN, else the engine's auto, cuda-core). The decode bench's own `auto` is the
# engine's (cuda-core), so the node's family is named where it differs. tests/unit/test_gpu_check.py holds these
# against the engine's SHAPES and resolve_lean_gemv.
SHAPE_HIDDEN = {"llama-8b": 4096, "llama-1b": 2048}
PER_REQUEST_MIN_HIDDEN = 4096
GEMV_FAMILIES = ("per-request", "cuda-core", "tensor-core")

DEADLINE_S = {"tests": 570, "bench": 570, "stack": 570, "all": 1800}


def node_gemv(shape: str) -> str:
    return "per-request" if SHAPE_HIDDEN[shape] >= PER_REQUEST_MIN_HIDDEN else "cuda-core"


# ------------------------------------------------------------------------------------------------ the plan


@dataclasses.dataclass(frozen=True)
class Step:
    """One command of a phase: the header printed before it and its argv (run from the repository root)."""

    label: str
    argv: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Part:
    """A part of `bench`: what it measures (--help) and its commands for one shape."""

    name: str
    default: bool
    measures: str  # what it measures and how long it takes, for `bench --help`
    steps: Callable[[argparse.Namespace, str], list[Step]]


PARTS: dict[str, Part] = {}  # in the order a shape's steps run


def bench_part(name: str, *, default: bool, measures: str):
    """Register a part of `bench`: `steps(args, shape)` returns its commands for one shape (each appends its
    results to OUT/bench.jsonl, the rows of the summary's table and of the targets)."""
    def register(steps: Callable[[argparse.Namespace, str], list[Step]]):
        PARTS[name] = Part(name, default, measures, steps)
        return steps
    return register


def decode_bench(args: argparse.Namespace, shape: str, contexts: str, *flags: str) -> tuple[str, ...]:
    return (PYTHON, "-m", "expresslane.engine.decode.bench", "--random-shape", shape, "--device", "cuda",
            "--dtype", "bfloat16", "--contexts", contexts, "--max-seq-len", str(args.max_seq_len),
            "--tokens", str(args.tokens), *flags, "--repeats", str(args.repeats),
            "--json", str(args.out / "bench.jsonl"))


def _drafts(args: argparse.Namespace, oracle_k: str) -> tuple[str, ...]:
    return ("--oracle-k", oracle_k, "--lookup", *(("--replay-text", args.texts) if args.texts else ()))


@bench_part("node", default=True, measures=(
    "the engine as the node builds it: the per-request GEMV family at 8B, CUDA-core at 1B (server/config.py "
    "resolve_lean_gemv); its plain steps, its own drafter on random prompts, oracle drafts k = --oracle-k (the "
    "most any drafter can earn) and its drafter on the copy model's recorded requests (--texts); about 1.5 min "
    "at 8B, 1 min at 1B on an H100"))
def _node(args: argparse.Namespace, shape: str) -> list[Step]:
    gemv = node_gemv(shape)
    family = ("--lean-gemv", gemv) if gemv != "cuda-core" else ()  # cuda-core: the bench's own auto
    return [Step(f"{shape} node ({gemv})",
                 decode_bench(args, shape, args.contexts, *family, *_drafts(args, args.oracle_k)))]


@bench_part("plain", default=True, measures=(
    "an engine without speculation at the same contexts: what every row's 'x node' is against, and the "
    "bandwidth-bound targets; under 1 min a shape"))
def _plain(args: argparse.Namespace, shape: str) -> list[Step]:
    return [Step(f"{shape} plain engine (no speculation)",
                 decode_bench(args, shape, args.contexts, "--speculation-k", "0"))]


@bench_part("families", default=False, measures=(
    "an engine of each GEMV family the node does not build at that shape (8B: cuda-core, tensor-core; 1B: "
    "per-request, tensor-core) at --family-contexts: what the node's choice gains or loses against each, request "
    "by request, and the tensor-core family's verify and oracle targets; about 4 min for both shapes"))
def _families(args: argparse.Namespace, shape: str) -> list[Step]:
    return [Step(f"{shape} {gemv} engine",
                 decode_bench(args, shape, args.family_contexts, "--lean-gemv", gemv,
                              *_drafts(args, args.family_oracle_k)))
            for gemv in GEMV_FAMILIES if gemv != node_gemv(shape)]


@bench_part("users", default=True, measures=(
    "several users on one engine as the node builds it on a GPU (seats: the tensor-core GEMVs, one forward a step "
    "for every user: decode/batch.py): --users at --users-contexts, speculation on (the node's default) and off; "
    "--users-repeats rounds of every user count in turn (x solo: the median of each round's ratio); per-user tok/s, "
    "aggregate, x solo, % of the step's bound, host time a step, every user's tokens against its run alone; one "
    "round of 1k / 8k / 32k took 106 s for both shapes on an H100 (2026-12-07), three about 5 min"))
def _users(args: argparse.Namespace, shape: str) -> list[Step]:
    return [Step(f"{shape} users ({args.users} at once)",
                 (PYTHON, "-m", "expresslane.engine.decode.bench_users", "--random-shape", shape, "--device", "cuda",
                  "--dtype", "bfloat16", "--contexts", args.users_contexts, "--users", args.users,
                  "--tokens", str(args.users_tokens), "--speculation", "on,off", "--repeats", str(args.users_repeats),
                  "--max-seq-len", str(args.max_seq_len), "--json", str(args.out / "users.jsonl")))]


def bench_steps(args: argparse.Namespace) -> list[Step]:
    """Shape by shape, each part in PARTS' order: a run cut at its deadline keeps whole shapes."""
    return [step for shape in args.shapes for name, part in PARTS.items() if name in args.parts
            for step in part.steps(args, shape)]


def test_step(args: argparse.Namespace) -> Step:
    # -p no:cacheprovider: the tree is a copy; --timeout: a hung test fails and the rest still run; -n: xdist
    # workers (the machine's 16 cores compile the Triton kernels; a worker that crashes is named with its test and
    # replaced), --dist worksteal: an idle worker takes queued tests from a busy one (a few take a minute each);
    # -v: every test's outcome by name in pytest.txt.
    return Step("tests", (PYTHON, "-m", "pytest", "-v", "-o", "addopts=", "-p", "no:cacheprovider", "--timeout", "180",
                          "-rfE", "-n", str(args.test_workers), "--dist", "worksteal", "--durations", "15",
                          *args.tests))


def stack_step(args: argparse.Namespace, deadline_epoch: float) -> Step:
    return Step("stack", (PYTHON, str(Path("scripts") / "gpu_stack.py"), "--shapes", ",".join(args.stack_shapes),
                          "--models", str(args.models), "--out", str(args.out / "stack"),
                          "--deadline-epoch", str(int(deadline_epoch)), "--express-speculation", "on",
                          *shlex.split(args.stack_args)))


# ------------------------------------------------------------------------------------------------ running


class Run:
    """One run's phases against one deadline, each phase's wall time in OUT/phases.txt."""

    def __init__(self, args: argparse.Namespace, write_files: bool = True):
        self.args, self.t0 = args, time.monotonic()
        self.deadline = self.t0 + args.deadline_s
        self.out: Path = args.out
        self.write_files = write_files
        self.phases: list[str] = []
        if write_files:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "phases.txt").write_text(f"commit {args.commit}\n")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def note(self, line: str) -> None:
        self.phases.append(line)
        if self.write_files:
            with (self.out / "phases.txt").open("a") as f:
                f.write(line + "\n")

    def command(self, argv: tuple[str, ...], budget_s: float, log: Path | None, env: dict[str, str],
                keep_tail: int = 0, drop: tuple[str, ...] = ()) -> tuple[int, list[str]]:
        """argv under coreutils' timeout (SIGINT at `budget_s`, SIGKILL 15 s later), its output appended to `log`
        and printed (or, with keep_tail, only its last lines without `drop`, printed at the end); (rc, tail)."""
        cmd = ["timeout", "--signal=INT", "--kill-after=15", str(max(1, int(budget_s))), *argv]
        tail: collections.deque[str] = collections.deque(maxlen=keep_tail or 1)
        with (log.open("a") if log else open(os.devnull, "w")) as sink:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace")
            assert proc.stdout is not None
            for line in proc.stdout:
                sink.write(line)
                if not keep_tail:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                elif not any(d in line for d in drop):
                    tail.append(line.rstrip("\n"))
            rc = proc.wait()
        return rc, list(tail) if keep_tail else []


def device_env(args: argparse.Namespace, site_first: bool = False) -> dict[str, str]:
    """The environment of every command: the repo's packages (and the carried ones in --site) importable."""
    paths = [str(REPO / "engine" / "src"), str(REPO / "router" / "src")]
    site = [str(args.site)] if args.site.exists() else []
    path = site + paths if site_first else paths + site
    return {**os.environ, "PYTHONPATH": ":".join(path + [p for p in [os.environ.get("PYTHONPATH")] if p]),
            "PYTHONUNBUFFERED": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


def install_carried(args: argparse.Namespace) -> None:
    """The wheels `prepare` carried into --site, once per machine; then the imports the check needs."""
    marker = args.site / ".gpu-check"
    if CARRY.is_dir() and not marker.exists():
        args.site.mkdir(parents=True, exist_ok=True)
        wheels = sorted(str(p) for p in CARRY.glob("*.whl"))
        subprocess.run([PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(args.site), *wheels], check=True)
        subprocess.run(["tar", "-xJf", str(CARRY / "nixl_cu13.tar.xz"), "-C", str(args.site)], check=True)
        marker.touch()
    probe = ("import torch, triton, fastapi, xgrammar, nixl; from nixl._api import nixl_agent; "
             "print('torch', torch.__version__, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name())")
    proc = subprocess.run([PYTHON, "-c", probe], env=device_env(args), cwd=REPO)
    if proc.returncode:
        raise SystemExit("gpu_check: the packages the check needs do not import (above); run `prepare` where pip "
                         "reaches a registry and carry .carry/gpu-check/, or install them")


def run_tests(run: Run) -> None:
    args = run.args
    budget = min(args.test_budget_s, run.left() - 10)
    if budget < 10:
        run.note("tests not run: the run's budget (--deadline-s) is spent")
        return
    t0 = time.monotonic()
    print(f"== tests (at most {budget:.0f} s)", flush=True)
    (args.out / "pytest.txt").write_text("")
    env = {**device_env(args), "EXPRESSLANE_COMPILE_THREADS": "4"}  # 4 x 8 workers on 16 cores, not 16 each
    rc, tail = run.command(test_step(args).argv, budget, args.out / "pytest.txt", env, keep_tail=80,
                           drop=(" PASSED ", " SKIPPED "))
    print("\n".join(tail), flush=True)
    if rc in (124, 137):  # interrupted, pytest still prints a closing "N passed" line: the targets read this
        run.note(f"tests interrupted at their budget ({budget:.0f} s)")
    elif rc not in (0, 1):  # pytest's own exit codes: 2 interrupted, 3 internal error, 4 usage, 5 nothing collected
        run.note(f"tests did not run to the end (pytest rc {rc}: pytest.txt says why)")
    run.note(f"tests {time.monotonic() - t0:.0f} s")


def run_bench(run: Run) -> None:
    args, t0 = run.args, time.monotonic()
    (args.out / "bench.jsonl").write_text("")
    env = device_env(args)
    for step in bench_steps(args):
        if run.left() < 10:
            run.note(f"bench not run from {step.label} on: the run's budget (--deadline-s) is spent")
            break
        print(f"== bench {step.label}", flush=True)
        with (args.out / "bench.log").open("a") as log:
            log.write(f"== bench {step.label}\n")
        rc, _ = run.command(step.argv, run.left(), args.out / "bench.log", env)
        if rc in (124, 137):
            run.note(f"bench interrupted at the run's budget (--deadline-s) in {step.label}")
            break
        if rc:
            run.note(f"bench step failed (rc {rc}): {step.label}")
    run.note(f"bench {time.monotonic() - t0:.0f} s")


def carried_vllm(args: argparse.Namespace) -> bool:
    """Whether the carried vLLM is (or can be) in --site: scripts/gpu_carry.py's parts or build marker."""
    return bool(list(REPO.glob(".carry/p*/manifest.json")) or (args.parts_dir / "manifest.json").exists()
                or (args.site / "EXPRESSLANE_GPU_CARRY.json").exists())


def run_stack(run: Run) -> None:
    args, t0 = run.args, time.monotonic()
    if run.left() < 60:
        run.note("stack not run: the run's budget (--deadline-s) is spent")
        return
    if carried_vllm(args):  # standard library only: run without the site it replaces
        rc, _ = run.command((PYTHON, "scripts/gpu_carry.py", "assemble", "--parts", str(args.parts_dir),
                             "--site", str(args.site)), run.left(), None, {**os.environ, "PYTHONUNBUFFERED": "1"})
        if rc:
            run.note(f"stack not run: the carried vLLM did not assemble (rc {rc})")
            return
    env = device_env(args, site_first=True)
    step = stack_step(args, time.time() + run.left() - 10)
    print(f"== stack {' '.join(step.argv[1:])}", flush=True)
    rc, _ = run.command(step.argv, run.left(), None, env)
    if rc:
        run.note(f"stack failed (rc {rc}): {args.out / 'stack' / 'summary.md'} says where")
    run.note(f"stack {time.monotonic() - t0:.0f} s")


# ------------------------------------------------------------------------------------------------ summary


def summary(out: Path, commit: str | None = None) -> list[str]:
    """The table: the tests' closing line, each phase's wall time, one row per bench result, the engines' starts,
    the targets, both lanes."""
    phases = (out / "phases.txt").read_text().splitlines() if (out / "phases.txt").exists() else []
    commit = commit or next((p.split(" ", 1)[1] for p in phases if p.startswith("commit ")), "unknown")
    closing = [line for line in (out / "pytest.txt").read_text().splitlines()
               if any(w in line for w in ("passed", "failed", "error"))] if (out / "pytest.txt").exists() else []
    lines = [f"== GPU check {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} commit {commit}",
             f"tests: {closing[-1] if closing else ''}"]
    wall = [p for p in phases if not p.startswith("commit ")]
    if wall:
        lines.append("wall: " + ", ".join(wall))
    bench = out / "bench.jsonl"
    rows = [json.loads(line) for line in bench.read_text().splitlines() if line.strip()] if bench.exists() else []
    if rows:
        lines += bench_table(rows) + start_lines(rows)
    users = users_rows(out)
    if users:
        lines += ["several users on one engine (users.jsonl)"] + users_table(users)
    found = targets(out)
    if found:
        lines.append("targets (docs/performance.md)")
        lines += [f"  {'yes' if holds else 'NO ':3}  {what}: {measured}" for holds, what, measured in found]
    return lines + stack_lines(out / "stack")


def print_summary(out: Path, commit: str | None, write: bool) -> None:
    text = "\n".join(summary(out, commit)) + "\n"
    sys.stdout.write(text)
    if write:
        (out / "summary.txt").write_text(text)


# ------------------------------------------------------------------------------------------------ prepare


def prepare() -> int:
    """The wheels the GPU machine lacks, exactly as images/gpu/check-wheels.lock pins them, into .carry/gpu-check/;
    nixl-cu13's libraries (229 MB unpacked) as tar.xz: its wheel (59 MB) and the repo would not fit one device
    call (64 MiB). Unpacking a wheel is what pip --target does for it (no scripts, no data files)."""
    with tempfile.TemporaryDirectory(dir=REPO / ".carry" if (REPO / ".carry").is_dir() else None) as tmp:
        platforms = [a for p in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_24", "manylinux_2_17",
                                 "manylinux2014", "manylinux1") for a in ("--platform", f"{p}_x86_64")]
        subprocess.run([PYTHON, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
                        "3.12", "--implementation", "cp", *platforms, "--require-hashes", "-r", str(LOCK), "-d", tmp],
                       check=True)
        nixl = next(Path(tmp).glob("nixl_cu13-*.whl"))
        unpacked = Path(tmp) / "nx"
        unpacked.mkdir()
        subprocess.run(["unzip", "-q", str(nixl)], cwd=unpacked, check=True)
        with (Path(tmp) / "nixl_cu13.tar.xz").open("wb") as f:
            tar = subprocess.Popen(["tar", "-c", "."], cwd=unpacked, stdout=subprocess.PIPE)
            xz = subprocess.run(["xz", "-T0", "-6"], stdin=tar.stdout, stdout=f)
            if tar.wait() or xz.returncode:
                raise SystemExit("gpu_check prepare: tar | xz failed")
        shutil.rmtree(unpacked)
        nixl.unlink()
        shutil.rmtree(CARRY, ignore_errors=True)
        CARRY.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(tmp, CARRY)
    for p in sorted(CARRY.iterdir()):
        print(f"{p.stat().st_size / 1e6:8.1f} MB  {p.relative_to(REPO)}")
    return 0


# ------------------------------------------------------------------------------------------------ command line


def _csv(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{prepare,tests,bench,stack,all,summary}")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("out", type=Path, help="the run's folder (created)")
    common.add_argument("--deadline-s", type=float, default=None,
                        help="every phase ends by then from the start (default: 570 s, all 1800 s)")
    common.add_argument("--commit", default="unknown (pass --commit)",
                        help="the commit the tree is, for the table's title (the machine's copy may lack .git)")
    common.add_argument("--site", type=Path, default=Path("/tmp/site"), help="where carried packages are unpacked")
    common.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")

    tests = argparse.ArgumentParser(add_help=False)
    g = tests.add_argument_group("tests")
    g.add_argument("--tests", type=_csv, default=["tests/unit/engine", "tests/unit/transfer"],
                   help="comma-separated test paths (a subset re-runs what a change touched)")
    g.add_argument("--test-budget-s", type=float, default=400.0, help="the tests' share of the run")
    g.add_argument("--test-workers", type=int, default=8, help="pytest-xdist workers")

    bench = argparse.ArgumentParser(add_help=False)
    g = bench.add_argument_group("bench")
    g.add_argument("--parts", type=_csv, default=[n for n, p in PARTS.items() if p.default],
                   help=f"of {', '.join(PARTS)} (default: {', '.join(n for n, p in PARTS.items() if p.default)})")
    g.add_argument("--shapes", type=_csv, default=list(SHAPE_HIDDEN), help="random checkpoints (decode/shapes.py)")
    g.add_argument("--contexts", default="1024,8192,32768", help="prompt lengths of node and plain")
    g.add_argument("--family-contexts", default="1024,32768", help="prompt lengths of families")
    g.add_argument("--oracle-k", default="1,2,3,4", help="oracle drafts of node: most any drafter earns at k")
    g.add_argument("--family-oracle-k", default="3,4", help="oracle drafts of families")
    g.add_argument("--texts", default=TEXTS, help="recorded requests the node's drafter replays ('' for none)")
    g.add_argument("--tokens", type=int, default=256, help="greedy tokens a request")
    g.add_argument("--repeats", type=int, default=2, help="best of")
    g.add_argument("--max-seq-len", type=int, default=33100, help="as a deployment sets it (32k + 256 + margin)")
    g.add_argument("--users", default="1,2,4,8", help="users at once of the users part")
    g.add_argument("--users-contexts", default="1024,8192,32768", help="prompt lengths of the users part")
    g.add_argument("--users-tokens", type=int, default=128, help="greedy tokens each user decodes (users part)")
    g.add_argument("--users-repeats", type=int, default=3,
                   help="rounds of every user count in turn (users part): medians, x solo paired by round")

    stack = argparse.ArgumentParser(add_help=False)
    g = stack.add_argument_group("stack")
    g.add_argument("--stack-shapes", type=_csv, default=list(SHAPE_HIDDEN), help="in order (gpu_stack.py --shapes)")
    g.add_argument("--models", type=Path, default=Path("/tmp/models"), help="checkpoints, written where missing")
    g.add_argument("--parts-dir", type=Path, default=Path("/tmp/parts"), help="the carried vLLM's parts")
    g.add_argument("--stack-args", default="", help="more gpu_stack.py flags, e.g. '--ucx-tls cuda_ipc,rc'")

    sub.add_parser("prepare", help="here: download the wheels the GPU machine lacks (seconds)",
                   description=prepare.__doc__)
    paragraph = {p.split(":", 1)[0].strip("`"): p for p in __doc__.split("\n\n") if p.startswith(("`", "Dead"))}
    parts = "parts of bench (--parts), in the order each shape runs them:\n" + "\n".join(
        textwrap.fill(f"{p.name:9} {'[default] ' if p.default else ''}{p.measures}", 116, initial_indent="  ",
                      subsequent_indent=" " * 12) for p in PARTS.values())
    for name, parents, what, text in (
            ("tests", [common, tests], "every test that can use CUDA (about 3 min on an H100)", paragraph["tests"]),
            ("bench", [common, bench], "the decode bench of the node as deployed (about 4-5 min on an H100)",
             paragraph["bench"] + "\n\n" + parts),
            ("stack", [common, stack], "both lanes through the router: scripts/gpu_stack.py (about 10 min)",
             paragraph["stack"]),
            ("all", [common, tests, bench, stack], "tests, bench and stack in turn (about 18 min)",
             "\n\n".join(paragraph[n] for n in ("tests", "bench", "stack")) + "\n\n" + parts)):
        sub.add_parser(name, parents=parents, help=what, description=text + "\n\n" + paragraph["Deadlines"],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s = sub.add_parser("summary", help="anywhere: the table and the targets again from a run's folder")
    s.add_argument("out", type=Path)
    s.add_argument("--commit", default=None, help="default: the one the run recorded")

    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        return args
    args.out = args.out.resolve()  # every command runs from the repository root
    if args.cmd in DEADLINE_S:
        args.deadline_s = DEADLINE_S[args.cmd] if args.deadline_s is None else args.deadline_s
    if args.cmd in ("bench", "all"):
        unknown = [p for p in args.parts if p not in PARTS] + [s for s in args.shapes if s not in SHAPE_HIDDEN]
        if unknown:
            ap.error(f"unknown parts or shapes {unknown}: parts {list(PARTS)}, shapes {list(SHAPE_HIDDEN)}")
        if args.texts and not (REPO / args.texts).exists():
            ap.error(f"--texts {args.texts}: no such file")
    if args.cmd in ("stack", "all") and [s for s in args.stack_shapes if s not in SHAPE_HIDDEN]:
        ap.error(f"--stack-shapes takes {list(SHAPE_HIDDEN)}")
    return args


def plan(args: argparse.Namespace) -> list[Step]:
    """The commands a run makes, in order (the stack's deadline counted from now)."""
    steps = [test_step(args)] if args.cmd in ("tests", "all") else []
    steps += bench_steps(args) if args.cmd in ("bench", "all") else []
    steps += [stack_step(args, time.time() + args.deadline_s - 10)] if args.cmd in ("stack", "all") else []
    return steps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cmd == "prepare":
        return prepare()
    if args.cmd == "summary":
        print_summary(args.out, args.commit, write=False)
        return 0
    if args.dry_run:
        for step in plan(args):
            print(f"== {step.label}\n{shlex.join(step.argv)}")
        return 0
    if shutil.which("nvidia-smi") is None:
        raise SystemExit("gpu_check: no nvidia-smi here: the check runs on a CUDA machine (--dry-run prints it)")
    run = Run(args, write_files=args.cmd != "stack")
    subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    if args.cmd in ("tests", "bench", "all"):
        install_carried(args)
    if args.cmd in ("tests", "all"):
        run_tests(run)
    if args.cmd in ("bench", "all"):
        run_bench(run)
    if args.cmd in ("stack", "all"):
        run_stack(run)
    if args.cmd == "stack":
        print("\n".join(stack_lines(args.out / "stack") + run.phases))
    else:
        print_summary(args.out, args.commit, write=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
