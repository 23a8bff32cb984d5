"""DevStack.stop(names) stops only the named services (the bench frees the decode servers' CPUs for its
baseline prefill that way) and a later stop() takes the rest. Real child processes stand in for launchers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from dev_stack import DevStack  # noqa: E402


def _spawn(stack: DevStack, name: str) -> subprocess.Popen:
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    stack.procs[name] = proc
    (stack.state_dir / f"{name}.pid").write_text(str(proc.pid))
    return proc


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
