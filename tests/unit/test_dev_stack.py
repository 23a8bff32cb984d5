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


def _http_launcher(tmp_path: Path, monkeypatch, echo: str) -> tuple[Path, int]:
    """A decode-express launcher stand-in that prints `echo` (shell-expanded) and serves HTTP on its port: the
    launch folder and a free port for the service."""
    import socket

    launch = tmp_path / "launch"
    launch.mkdir()
    (launch / "decode-express.sh").write_text(
        f'echo "{echo}"\nexec "$PYTHON" -m http.server "$EXPRESS_HTTP_PORT" --bind 127.0.0.1\n')
    monkeypatch.setattr(dev_stack, "LAUNCH", launch)
    monkeypatch.setitem(dev_stack.SERVICES, "decode-express", ("decode-express.sh", "/", "EXPRESS_HTTP_PORT"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return launch, s.getsockname()[1]


def test_restart_relaunches_with_env_overrides_and_waits_healthy(tmp_path, monkeypatch):
    """restart() kills the running process, starts the service's launcher again (fresh pid, log appended) with
    the per-start environment, and returns once its health URL answers; a launcher that dies says so."""
    launch, port = _http_launcher(tmp_path, monkeypatch, "start MAX_MODEL_LEN=$MAX_MODEL_LEN")
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


def test_the_express_node_starts_with_the_weight_of_its_cpu_shares(tmp_path, monkeypatch):
    """The express launcher's process (and, with autogroups, its whole session) runs at the nice level of
    EXPRESS_CPU_SHARES, as compose's cpu_shares weighs its container; a weight it cannot set is reported."""
    launch = tmp_path / "launch"
    launch.mkdir()
    (launch / "decode-express.sh").write_text("exec sleep 120\n")
    monkeypatch.setattr(dev_stack, "LAUNCH", launch)
    monkeypatch.delenv("EXPRESS_CPU_SHARES", raising=False)
    stack = DevStack(state_dir=tmp_path / "state", services=("decode-express",))
    stack.state_dir.mkdir()
    env = stack.env()
    assert env["EXPRESS_CPU_SHARES"] == "8192"
    proc = stack._launch("decode-express", env)
    try:
        if os.geteuid() != 0:
            pytest.skip("a higher weight (negative nice) needs root or CAP_SYS_NICE")
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == -9
        autogroup = Path(f"/proc/{proc.pid}/autogroup")
        if autogroup.exists():
            assert autogroup.read_text().split()[-1] == "-9"
    finally:
        stack.stop()
    monkeypatch.setenv("EXPRESS_CPU_SHARES", "1024")
    assert DevStack(state_dir=tmp_path / "other").env()["EXPRESS_CPU_SHARES"] == "1024"  # the environment wins


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


class _ReadyRouter:
    """A real HTTP server on the stack's router port answering /ready the way the router does: 503 with the
    upstreams while any is ejected, 200 once the prefill and a decode node take traffic."""

    def __init__(self, port: int, upstream_ports: dict[int, list[bool]]) -> None:
        import http.server
        import json
        import threading

        answers = {p: list(seq) for p, seq in upstream_ports.items()}  # each GET pops one state per upstream

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                ups = {f"http://127.0.0.1:{p}": {"healthy": seq.pop(0) if len(seq) > 1 else seq[0]}
                       for p, seq in answers.items()}
                ok = all(u["healthy"] for u in ups.values())
                data = json.dumps({"status": "ready" if ok else "not_ready", "upstreams": ups}).encode()
                self.send_response(200 if ok else 503)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _stack_ports(tmp_path, services):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    stack = DevStack(state_dir=tmp_path, services=services, port_base=free - dev_stack.DEFAULT_PORTS["ROUTER_PORT"])
    return stack, {n: stack.ports[dev_stack.SERVICES[n][2]] for n in services if n != "router"}


def test_router_ready_waits_until_every_started_upstream_is_admitted(tmp_path):
    stack, ports = _stack_ports(tmp_path, ("prefill", "decode-native", "decode-express", "router"))
    # decode-express is ejected for the first 6 answers (it refused the router's first probe), then admitted.
    router = _ReadyRouter(stack.ports["ROUTER_PORT"], {ports["prefill"]: [True], ports["decode-native"]: [True],
                                                      ports["decode-express"]: [False] * 6 + [True]})
    try:
        waited = stack.wait_router_ready(timeout_s=30)
        assert waited >= 1.0  # 6 not-ready answers at 0.25 s apart
    finally:
        router.close()


def test_router_ready_ignores_upstreams_of_services_not_started(tmp_path):
    stack, ports = _stack_ports(tmp_path, ("prefill", "decode-express", "router"))
    native = stack.ports["DECODE_NATIVE_PORT"]  # configured in the router, never started: ejected forever
    router = _ReadyRouter(stack.ports["ROUTER_PORT"], {ports["prefill"]: [True], ports["decode-express"]: [True],
                                                      native: [False]})
    try:
        assert stack.wait_router_ready(timeout_s=30) < 5
    finally:
        router.close()


def test_router_never_ready_is_a_stack_error_with_the_body(tmp_path):
    stack, ports = _stack_ports(tmp_path, ("prefill", "decode-express", "router"))
    router = _ReadyRouter(stack.ports["ROUTER_PORT"], {ports["prefill"]: [True], ports["decode-express"]: [False]})
    try:
        with pytest.raises(StackError, match="not_ready"):
            stack.wait_router_ready(timeout_s=1.0)
    finally:
        router.close()


def test_a_closed_stack_generates_its_internal_secrets_once_and_the_environment_wins(tmp_path, monkeypatch):
    for name in dev_stack.INTERNAL_SECRETS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(f"{name}_FILE", raising=False)
    stack = DevStack(state_dir=tmp_path, secure=True, extra_env={"VLLM_API_KEY": "mine"})
    env = stack.env()
    files = {k: Path(v) for k, v in env.items() if k.endswith("_FILE") and k[:-5] in dev_stack.INTERNAL_SECRETS}
    assert set(files) == {"EXPRESS_NODE_TOKEN_FILE", "EXPRESSLANE_PEER_SECRET_FILE"}  # VLLM_API_KEY: the caller's
    values = {k: p.read_text() for k, p in files.items()}
    assert all(len(v) >= 40 for v in values.values()) and len(set(values.values())) == 2
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in files.values())
    assert {k: Path(v).read_text() for k, v in stack.env().items() if k in files} == values  # kept on restart
    assert stack.auth_headers() == {"Authorization": f"Bearer {values['EXPRESS_NODE_TOKEN_FILE']}"}
    assert stack.auth_headers("VLLM_API_KEY") == {"Authorization": "Bearer mine"}
    assert not any(k.endswith("_FILE") for k in DevStack(state_dir=tmp_path / "open").env() if k[:-5] in
                   dev_stack.INTERNAL_SECRETS)  # the class is open unless secure=True


def test_pool_members_get_their_own_ports_and_the_router_their_urls(tmp_path):
    """--prefills 2 --natives 3: members 2.. are services of their own (own ports, same launcher), listed for the
    router in PREFILL_EXTRA_NODES / DECODE_NATIVE_EXTRA_NODES (compose/config/router.yaml's pool lists)."""
    stack = DevStack(state_dir=tmp_path, port_base=100, prefills=2, natives=3)
    assert stack.services == ("prefill", "prefill-2", "decode-native", "decode-native-2", "decode-native-3",
                              "decode-express", "router")
    assert stack.member_env["prefill-2"] == {"PREFILL_PORT": "8110", "PREFILL_NIXL_PORT": "5710",
                                             "CONNECTOR_METRICS_PORT": "9510"}
    assert stack.member_env["decode-native-3"] == {"DECODE_NATIVE_PORT": "8220", "DECODE_NATIVE_NIXL_PORT": "5721"}
    env = stack.env()
    assert env["PREFILL_EXTRA_NODES"] == "http://127.0.0.1:8110"
    assert env["DECODE_NATIVE_EXTRA_NODES"] == "http://127.0.0.1:8210,http://127.0.0.1:8220"
    assert "PREFILL_EXTRA_NODES" not in DevStack(state_dir=tmp_path).env()
    from expresslane.router.config import load_config

    cfg = load_config(REPO / "compose" / "config" / "router.yaml", env)
    assert cfg.prefill.static_nodes == stack.member_urls("prefill")
    assert cfg.pools["native"].nodes == stack.member_urls("decode-native")
    with pytest.raises(ValueError, match="at least one member"):
        DevStack(state_dir=tmp_path, prefills=0)


def test_cli_service_commands_act_on_the_stack_that_up_started(tmp_path, monkeypatch, capsys):
    """`restart SERVICE` with no flags restarts it with the settings `up` saved (model, served name, ports), not
    the CLI's defaults; a flag that names another setting is refused before anything is touched."""
    _, port = _http_launcher(tmp_path, monkeypatch, "start SERVED_MODEL_NAME=$SERVED_MODEL_NAME MODEL_DIR=$MODEL_DIR")
    state = tmp_path / "state"
    base = port - dev_stack.DEFAULT_PORTS["EXPRESS_HTTP_PORT"]
    dev_stack.save_settings(state, {**dev_stack.default_settings(), "model": "tiny-llama",
                                    "model_dir": str(dev_stack.MODELS_DIR / "tiny-llama"),
                                    "served_model_name": "my-model", "port_base": base, "secure": False,
                                    "services": ["decode-express"]})
    try:
        assert dev_stack.main(["--state-dir", str(state), "restart", "decode-express"]) == 0
        log = (state / "decode-express.log").read_text()
        assert f"start SERVED_MODEL_NAME=my-model MODEL_DIR={dev_stack.MODELS_DIR / 'tiny-llama'}" in log, log
        assert dev_stack.main(["--state-dir", str(state), "--port-base", str(base), "status"]) == 0  # the same
        assert "decode-express  healthy" in capsys.readouterr().out
        pid = int((state / "decode-express.pid").read_text())
        assert dev_stack.main(["--state-dir", str(state), "--model", "smollm2-135m-instruct", "restart",
                               "decode-express"]) == 2
        err = capsys.readouterr().err
        assert "started with 'tiny-llama'" in err and "down" in err
        assert int((state / "decode-express.pid").read_text()) == pid and _alive(pid)  # untouched
    finally:
        assert dev_stack.main(["--state-dir", str(state), "down"]) == 0


def test_the_soak_acts_on_the_stack_that_up_started(tmp_path):
    """scripts/soak.py --dev-stack builds its DevStack from the saved settings (what it restarts gets the stack's
    model and ports); a --port-base other than the stack's is an error, not a stack on other ports."""
    import soak

    state = tmp_path / "state"
    dev_stack.save_settings(state, {**dev_stack.default_settings(), "served_model_name": "my-model",
                                    "port_base": 700, "secure": False})
    stack = soak.DevStackTarget(state, None).stack
    assert stack.served_name == "my-model" and stack.model_dir == dev_stack.MODELS_DIR / dev_stack.DEFAULT_MODEL
    assert stack.ports["ROUTER_PORT"] == dev_stack.DEFAULT_PORTS["ROUTER_PORT"] + 700 and not stack.secure
    assert soak.DevStackTarget(state, 700).stack.ports == stack.ports
    with pytest.raises(SystemExit, match="--port-base 700, not 0"):
        soak.DevStackTarget(state, 0)
