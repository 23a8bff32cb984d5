"""DevStack's process control with real child processes standing in for launchers: stop(names) stops only the
named services (the bench frees the decode servers' CPUs that way); kill / pause / resume / restart act on a
service's whole process group with real signals (the fault tests and scripts/soak.py --dev-stack use them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import dev_stack  # noqa: E402
from dev_stack import DevStack, StackError  # noqa: E402

# A launcher stand-in: a shell whose child is a second process of the same group (as vLLM's engine core is).
_FAMILY = "sleep 120 & echo $! > {child}; wait"


def _spawn(stack: DevStack, name: str, cmd: list[str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(cmd or ["sleep", "120"], start_new_session=True)
    stack.procs[name] = proc
    (stack.state_dir / f"{name}.pid").write_text(str(proc.pid))
    return proc


def _state(pid: int) -> str:
    """The kernel's scheduling state letter of `pid` (R, S, T = stopped, Z, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return _state(pid) != "Z"


def test_stop_named_services_then_the_rest(tmp_path):
    stack = DevStack(state_dir=tmp_path, services=("prefill", "decode-native", "decode-express"))
    procs = {name: _spawn(stack, name) for name in stack.services}
    stack.stop(("decode-native", "decode-express"))
    assert procs["decode-native"].poll() is not None and procs["decode-express"].poll() is not None
    assert procs["prefill"].poll() is None, "stop(names) must leave the other services running"
    assert not (tmp_path / "decode-native.pid").exists() and (tmp_path / "prefill.pid").exists()
    stack.stop()
    assert procs["prefill"].poll() is not None
    assert not list(tmp_path.glob("*.pid"))


def test_kill_reaches_the_whole_process_group(tmp_path):
    stack = DevStack(state_dir=tmp_path, services=("prefill", "decode-express"))
    child_file = tmp_path / "child"
    proc = _spawn(stack, "decode-express", ["bash", "-c", _FAMILY.format(child=child_file)])
    other = _spawn(stack, "prefill")
    _wait_for(lambda: child_file.exists() and child_file.read_text().strip())
    child = int(child_file.read_text())
    t0 = time.monotonic()
    stack.kill("decode-express")
    assert time.monotonic() - t0 < 5
    assert proc.returncode == -signal.SIGKILL
    _wait_for(lambda: not _alive(child))
    assert stack.pid("decode-express") is None and not (tmp_path / "decode-express.pid").exists()
    assert other.poll() is None, "kill(name) must leave the other services running"
    with pytest.raises(StackError, match="not running"):
        stack.kill("decode-express")
    stack.stop()


def test_pause_and_resume_stop_and_continue_every_process(tmp_path):
    stack = DevStack(state_dir=tmp_path, services=("decode-express",))
    child_file = tmp_path / "child"
    proc = _spawn(stack, "decode-express", ["bash", "-c", _FAMILY.format(child=child_file)])
    _wait_for(lambda: child_file.exists() and child_file.read_text().strip())
    child = int(child_file.read_text())
    stack.pause("decode-express")
    _wait_for(lambda: _state(proc.pid) == "T" and _state(child) == "T")
    stack.resume("decode-express")
    _wait_for(lambda: _state(proc.pid) != "T" and _state(child) != "T")
    stack.pause("decode-express")
    _wait_for(lambda: _state(proc.pid) == "T")
    stack.stop()  # a paused service must still stop (TERM is delivered once it runs again)
    assert proc.poll() is not None


def test_restart_relaunches_with_env_overrides_and_waits_healthy(tmp_path, monkeypatch):
    """restart() kills the running process, starts the service's launcher again (fresh pid, log appended) with
    the per-start environment, and returns once its health URL answers; a launcher that dies says so."""
    launch = tmp_path / "launch"
    launch.mkdir()
    (launch / "decode-express.sh").write_text(
        'echo "start MAX_MODEL_LEN=$MAX_MODEL_LEN"\n'
        'exec "$PYTHON" -m http.server "$EXPRESS_HTTP_PORT" --bind 127.0.0.1\n')
    monkeypatch.setattr(dev_stack, "LAUNCH", launch)
    monkeypatch.setitem(dev_stack.SERVICES, "decode-express", ("decode-express.sh", "/", "EXPRESS_HTTP_PORT"))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stack = DevStack(state_dir=tmp_path / "state", services=("decode-express",), port_base=port - 5557)
    stack.state_dir.mkdir()
    old = _spawn(stack, "decode-express")
    try:
        waited = stack.restart("decode-express", env={"MAX_MODEL_LEN": "1024"}, timeout_s=30)
        assert old.returncode == -signal.SIGKILL
        assert 0 < waited < 30
        assert stack.pid("decode-express") not in (None, old.pid)
        assert stack.status()["decode-express"] == "healthy"
        stack.restart("decode-express", timeout_s=30)
        log = (tmp_path / "state" / "decode-express.log").read_text()
        assert "start MAX_MODEL_LEN=1024" in log and log.count("start MAX_MODEL_LEN=") == 2
        (launch / "decode-express.sh").write_text("echo broken; exit 3\n")
        with pytest.raises(StackError, match="exited with 3"):
            stack.restart("decode-express", timeout_s=30)
    finally:
        stack.stop()


def test_cli_controls_a_service_through_its_pid_file(tmp_path):
    stack = DevStack(state_dir=tmp_path, services=("decode-native",))
    proc = _spawn(stack, "decode-native")
    cli = [sys.executable, str(REPO / "scripts" / "dev_stack.py"), "--state-dir", str(tmp_path)]
    out = subprocess.run(cli + ["pause", "decode-native"], capture_output=True, text=True, check=True)
    assert "pause decode-native: done" in out.stdout
    _wait_for(lambda: _state(proc.pid) == "T")
    subprocess.run(cli + ["resume", "decode-native"], check=True, capture_output=True)
    _wait_for(lambda: _state(proc.pid) != "T")
    t0 = time.monotonic()
    subprocess.run(cli + ["kill", "decode-native"], check=True, capture_output=True)
    assert time.monotonic() - t0 < 10, "kill must not wait for a zombie that only its parent can reap"
    assert proc.wait(timeout=5) == -signal.SIGKILL
    bad = subprocess.run(cli + ["kill", "decode-native"], capture_output=True, text=True)
    assert bad.returncode == 1 and "not running" in bad.stderr
    usage = subprocess.run(cli + ["kill"], capture_output=True, text=True)
    assert usage.returncode == 2 and "needs a SERVICE" in usage.stderr
