#!/usr/bin/env python3
"""Run the whole expresslane stack without Docker, for development and tests.

    python scripts/dev_stack.py up [--model NAME | --model-dir DIR] [--served-model-name NAME] [--port-base N]
                                  [--only prefill,router,...] [--prefills N] [--natives N]
    python scripts/dev_stack.py status
    python scripts/dev_stack.py down
    python scripts/dev_stack.py kill|pause|resume|restart SERVICE   (fault injection, real signals)

Every service is started with the SAME launcher the compose files use (scripts/launch/*.sh) and the
router reads the same compose/config/router.yaml; only the environment differs (everything on
127.0.0.1, ports from the defaults or shifted by --port-base). State (pids, logs, env) lives in
var/dev-stack/. The pytest fixture `live_stack` (tests/conftest.py) drives the same `DevStack` class.

The model: `--model NAME` (default smollm2-135m-instruct, the real model; tiny-llama: the tiny random test model)
is written into var/models/NAME by scripts/model_init.py first (as compose's model-init does; idempotent). Your
own checkpoint: `--model-dir DIR` serves that directory as it is (no model-init; a Hugging Face Llama / Qwen2 /
Qwen3 directory with safetensors, tokenizer.json and a chat template). Either way the served name is the
directory's name unless --served-model-name is given, and the router's aliases derive from it: NAME (native
lane) and NAME-express (express lane).

Closed by default (`up`, as the compose stack's secrets-init): the stack's internal secrets (the express node's
token, the control-plane peer secret, vLLM's API key) are generated on the first start into <state>/secrets/
(mode 0600, reused by later starts) and handed to the services as NAME_FILE; `--open` starts without them. A NAME
or NAME_FILE already set in the environment wins. The router itself stays open on 127.0.0.1 (no client API keys).
The DevStack class is open unless `secure=True` (the test fixtures call the upstreams directly).

Pools: `--prefills N` / `--natives N` start N prefill / native decode servers (members 2..N are the services
`prefill-2`... / `decode-native-2`..., each on the first member's ports + 10 x (i - 1)); the router gets them as
PREFILL_EXTRA_NODES / DECODE_NATIVE_EXTRA_NODES (compose/config/router.yaml's pool lists).

Fault injection acts on one service's whole process group (the launcher execs the server; vLLM's engine
core is its child), as `docker compose kill|pause|unpause|restart` acts on a container:
  kill SERVICE     SIGKILL (`--signal TERM` etc. for another signal); the service stays down
  pause SERVICE    SIGSTOP: the process keeps its sockets but answers nothing (a partition, as seen by peers)
  resume SERVICE   SIGCONT
  restart SERVICE  SIGKILL if still running, start it again with its launcher, wait until healthy
These commands, `status` and `down` act on the stack as `up` started it (its model, ports, pools and secrets, kept
in <state>/stack.json), so they need no flags but --state-dir; a flag that names another setting is an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "scripts" / "launch"
DEFAULT_STATE = REPO / "var" / "dev-stack"
MODELS_DIR = REPO / "var" / "models"
DEFAULT_MODEL = "smollm2-135m-instruct"  # what `up` serves (scripts/model_init.py writes it)
DEFAULT_MODEL_DIR = MODELS_DIR / "tiny-llama"  # the DevStack class's default: the fast tiny model of the tests
MODEL_INIT = REPO / "scripts" / "model_init.py"
KNOWN_MODELS = ("smollm2-135m-instruct", "tiny-llama")  # model_init.py's MODELS

# Default ports: the same numbers as .env / docs/architecture.md.
DEFAULT_PORTS = {
    "ROUTER_PORT": 8080,
    "PREFILL_PORT": 8000,
    "PREFILL_NIXL_PORT": 5600,
    "CONNECTOR_METRICS_PORT": 9400,
    "DECODE_NATIVE_PORT": 8100,
    "DECODE_NATIVE_NIXL_PORT": 5601,
    "EXPRESS_HTTP_PORT": 5557,
    "EXPRESS_CTRL_PORT": 5556,
}

# The stack's internal secrets: variable -> file name under <state>/secrets/ (docs/security.md).
INTERNAL_SECRETS = {"EXPRESS_NODE_TOKEN": "express_node_token", "EXPRESSLANE_PEER_SECRET": "expresslane_peer_secret",
                    "VLLM_API_KEY": "vllm_api_key"}

# Service name -> (launcher, health path, port variable). Start order matters only for readiness.
SERVICES = {
    "prefill": ("prefill.sh", "/health", "PREFILL_PORT"),
    "decode-native": ("decode-native.sh", "/health", "DECODE_NATIVE_PORT"),
    "decode-express": ("decode-express.sh", "/health", "EXPRESS_HTTP_PORT"),
    "router": ("router.sh", "/health", "ROUTER_PORT"),
}


# Pool members beyond the first: service prefix -> (the port variables shifted per member, the router's list).
MEMBER_PORTS = {
    "prefill": (("PREFILL_PORT", "PREFILL_NIXL_PORT", "CONNECTOR_METRICS_PORT"), "PREFILL_EXTRA_NODES"),
    "decode-native": (("DECODE_NATIVE_PORT", "DECODE_NATIVE_NIXL_PORT"), "DECODE_NATIVE_EXTRA_NODES"),
}
MEMBER_PORT_STEP = 10


class StackError(RuntimeError):
    """A service failed to start or become healthy."""


@dataclasses.dataclass
class DevStack:
    """The processes of one local stack. Usable as a context manager."""

    model_dir: Path = DEFAULT_MODEL_DIR
    # What scripts/model_init.py writes into model_dir before the start (smollm2-135m-instruct, tiny-llama), or
    # None: model_dir is the user's own checkpoint, served as it is. "auto": model_init's model of the directory's
    # name when it knows one (var/models/tiny-llama -> tiny-llama), else None.
    model: str | None = "auto"
    served_model_name: str | None = None  # default: model_dir's name
    state_dir: Path = DEFAULT_STATE
    port_base: int = 0
    services: tuple[str, ...] = tuple(SERVICES)
    python: str = sys.executable
    extra_env: dict[str, str] = dataclasses.field(default_factory=dict)
    start_timeout_s: float = 900.0
    secure: bool = False  # generate the internal secrets (INTERNAL_SECRETS) into state_dir/secrets
    prefills: int = 1  # prefill pool size (members 2..N: services prefill-2 ...)
    natives: int = 1  # native decode pool size (decode-native-2 ...)

    def __post_init__(self) -> None:
        self.model_dir = Path(self.model_dir)
        self.state_dir = Path(self.state_dir)
        if self.model == "auto":
            self.model = self.model_dir.name if self.model_dir.name in KNOWN_MODELS else None
        unknown = set(self.services) - set(SERVICES)
        if unknown:
            raise ValueError(f"unknown services {sorted(unknown)}; choose from {list(SERVICES)}")
        self.ports = {k: v + self.port_base for k, v in DEFAULT_PORTS.items()}
        self.procs: dict[str, subprocess.Popen] = {}
        self.specs = dict(SERVICES)
        self.member_env: dict[str, dict[str, str]] = {}  # a pool member's own ports
        self._add_members("prefill", self.prefills)
        self._add_members("decode-native", self.natives)

    def _add_members(self, first: str, count: int) -> None:
        """Services first-2 .. first-count beside `first`, each with its ports shifted by MEMBER_PORT_STEP."""
        if count < 1:
            raise ValueError(f"a {first} pool needs at least one member, got {count}")
        if first not in self.services or count == 1:
            return
        port_vars, _ = MEMBER_PORTS[first]
        names = []
        for i in range(2, count + 1):
            name = f"{first}-{i}"
            env = {}
            for var in port_vars:
                member_var = f"{var}_{i}"
                self.ports[member_var] = self.ports[var] + MEMBER_PORT_STEP * (i - 1)
                env[var] = str(self.ports[member_var])
            launcher, health, main_var = SERVICES[first]
            self.specs[name] = (launcher, health, f"{main_var}_{i}")
            self.member_env[name] = env
            names.append(name)
        at = self.services.index(first) + 1
        self.services = self.services[:at] + tuple(names) + self.services[at:]

    def member_urls(self, first: str) -> list[str]:
        """Every member's base URL of the pool whose first service is `first` (prefill, decode-native)."""
        return [self.url(self.specs[n][2]) for n in self.services if n == first or n.startswith(first + "-")]

    # ---- addresses -------------------------------------------------------------------------
    def url(self, port_var: str) -> str:
        return f"http://127.0.0.1:{self.ports[port_var]}"

    @property
    def router_url(self) -> str:
        return self.url("ROUTER_PORT")

    @property
    def prefill_url(self) -> str:
        return self.url("PREFILL_PORT")

    @property
    def native_url(self) -> str:
        return self.url("DECODE_NATIVE_PORT")

    @property
    def express_url(self) -> str:
        return self.url("EXPRESS_HTTP_PORT")

    @property
    def connector_metrics_url(self) -> str:
        return self.url("CONNECTOR_METRICS_PORT")

    # ---- environment -----------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({k: str(v) for k, v in self.ports.items()})
        env.update(
            {
                "PYTHON": self.python,
                "MODEL_DIR": str(self.model_dir),
                "SERVED_MODEL_NAME": self.served_name,
                "BIND_HOST": "127.0.0.1",
                "PREFILL_HOST": "127.0.0.1",
                "PREFILL_NIXL_HOST": "127.0.0.1",
                "DECODE_NATIVE_HOST": "127.0.0.1",
                "DECODE_NATIVE_NIXL_HOST": "127.0.0.1",
                "EXPRESS_HOST": "127.0.0.1",
                "EXPRESS_ADVERTISE_HOST": "127.0.0.1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update({k: v for k, v in cpu_split().items() if k not in os.environ})
        env.setdefault("EXPRESS_CPU_SHARES", str(DEFAULT_EXPRESS_CPU_SHARES))
        if self.secure:
            env.update(self.secret_files())
        # The launchers run `$PYTHON -m ...`; make the venv's console scripts visible too.
        env["PATH"] = f"{Path(self.python).parent}{os.pathsep}{env.get('PATH', '')}"
        for first, (_, router_var) in MEMBER_PORTS.items():
            extra = self.member_urls(first)[1:]
            if extra:  # the router's pool lists (compose/config/router.yaml)
                env[router_var] = ",".join(extra)
        env.update(self.extra_env)
        return env

    def secret_files(self) -> dict[str, str]:
        """NAME_FILE -> path of each internal secret not set in the environment, generated once (mode 0600)."""
        out = {}
        folder = self.state_dir / "secrets"
        for name, file_name in INTERNAL_SECRETS.items():
            if any(src.get(k) for src in (os.environ, self.extra_env) for k in (name, f"{name}_FILE")):
                continue
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            path = folder / file_name
            if not path.exists():
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_urlsafe(32))
            out[f"{name}_FILE"] = str(path)
        return out

    def secret(self, name: str) -> str | None:
        """An internal secret's value as the services got it (generated, or from the environment); None if unset."""
        value = self.extra_env.get(name) or os.environ.get(name)
        path = self.extra_env.get(f"{name}_FILE") or os.environ.get(f"{name}_FILE")
        generated = self.state_dir / "secrets" / INTERNAL_SECRETS.get(name, name)
        if not value and not path and generated.exists():
            path = str(generated)
        return value or (Path(path).read_text().strip() if path else None)

    def auth_headers(self, name: str = "EXPRESS_NODE_TOKEN") -> dict[str, str]:
        """Authorization for a direct call to a service (express node: EXPRESS_NODE_TOKEN; vLLM: VLLM_API_KEY)."""
        token = self.secret(name)
        return {"Authorization": f"Bearer {token}"} if token else {}

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def served_name(self) -> str:
        """The name vLLM serves and the router's aliases derive from (NAME, NAME-express): served_model_name, else
        SERVED_MODEL_NAME from extra_env or the environment, else the model directory's name."""
        return (self.served_model_name or self.extra_env.get("SERVED_MODEL_NAME")
                or os.environ.get("SERVED_MODEL_NAME") or self.model_dir.name)

    @property
    def aliases(self) -> tuple[str, str]:
        """The router's (native, express) aliases (compose/config/router.yaml derives them from the served name)."""
        return self.served_name, f"{self.served_name}-express"

    def ensure_model(self) -> None:
        """model set: scripts/model_init.py writes it into model_dir (idempotent). None: model_dir is served as it
        is; StackError now, before any service starts, when it is not a checkpoint directory."""
        if self.model is None:
            missing = [f for f in ("config.json", "tokenizer.json") if not (self.model_dir / f).is_file()]
            if missing or not any(self.model_dir.glob("*.safetensors")):
                raise StackError(f"{self.model_dir}: not a checkpoint directory to serve (missing "
                                 f"{missing or ['*.safetensors']}); a Hugging Face directory with config.json, "
                                 f"*.safetensors and tokenizer.json, or --model {'|'.join(KNOWN_MODELS)}")
            return
        dtype = self.extra_env.get("DTYPE", os.environ.get("DTYPE", "float32"))
        cmd = [self.python, str(MODEL_INIT), str(self.model_dir), "--model", self.model, "--dtype", dtype]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise StackError(f"model_init.py --model {self.model} {self.model_dir} failed ({proc.returncode}):\n"
                             f"{proc.stderr.strip()[-2000:]}")
        print(proc.stdout.strip(), file=sys.stderr)

    def start(self) -> "DevStack":
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.ensure_model()
        env = self.env()
        (self.state_dir / "env.json").write_text(
            json.dumps({k: env[k] for k in sorted(set(self.ports) | {"MODEL_DIR", "PYTHON"})}, indent=2)
        )
        try:
            for name in self.services:
                self._launch(name, env, log_mode="wb")
            self.wait_healthy()
            if "router" in self.services:
                self.wait_router_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, name: str, env: dict[str, str], *, log_mode: str = "ab") -> subprocess.Popen:
        launcher = self.specs[name][0]
        env = {**env, **self.member_env.get(name, {})}
        with open(self.state_dir / f"{name}.log", log_mode) as log:
            proc = subprocess.Popen(
                ["bash", str(LAUNCH / launcher)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: `down` / `kill` reach the server's children
            )
        self.procs[name] = proc
        (self.state_dir / f"{name}.pid").write_text(str(proc.pid))
        shares_var = CPU_SHARES_VARS.get(name)
        if shares_var and env.get(shares_var):
            problem = apply_cpu_shares(proc.pid, int(env[shares_var]))
            if problem:
                print(f"dev_stack: {name}: {shares_var}={env[shares_var]} not applied ({problem}); it then shares "
                      f"each core equally with vLLM's busy-polling NIXL progress threads", file=sys.stderr)
        return proc

    def wait_healthy(self, names: tuple[str, ...] | None = None, timeout_s: float | None = None) -> float:
        """Wait until every service (or `names`) answers its health path; seconds waited. A service whose
        process exits meanwhile raises StackError with its log tail at once."""
        t0 = time.monotonic()
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        deadline = t0 + timeout_s
        pending = list(self.services if names is None else names)
        while pending:
            for name in list(pending):
                proc = self.procs.get(name)
                if proc is not None and proc.poll() is not None:
                    raise StackError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
                _, path, port_var = self.specs[name]
                if _http_ok(self.url(port_var) + path):
                    pending.remove(name)
            if pending and time.monotonic() > deadline:
                tails = "\n".join(f"--- {n} ---\n{self.log_tail(n)}" for n in pending)
                raise StackError(f"not healthy after {timeout_s:.0f}s: {pending}\n{tails}")
            if pending:
                time.sleep(0.25)
        return time.monotonic() - t0

    def wait_router_ready(self, timeout_s: float = 120.0) -> float:
        """Wait until the router's /ready says every upstream this stack started takes traffic; seconds waited.
        A service's /health can answer before the router's first probe of it did: an upstream that refused that
        probe stays ejected until a half-open probe re-admits it, and a request in between gets a 503. Upstreams
        of services this stack did not start are not waited for. StackError with the last body after
        timeout_s."""
        t0 = time.monotonic()
        port_vars = {name: self.specs[name][2] for name in self.services if name != "router"}
        want = {self.ports[v] for v in port_vars.values()}
        body: object = None
        while True:
            try:
                with urllib.request.urlopen(self.router_url + "/ready", timeout=2) as resp:
                    body = json.loads(resp.read())
            except urllib.error.HTTPError as e:  # 503 while not ready: the body still lists the upstreams
                body = json.loads(e.read() or b"{}")
            except (urllib.error.URLError, OSError, ValueError) as e:
                body = repr(e)
            if isinstance(body, dict):
                healthy = {urllib.parse.urlsplit(url).port for url, up in body.get("upstreams", {}).items()
                           if up.get("healthy")}
                if want <= healthy:
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise StackError(f"the router's /ready did not report {sorted(port_vars)} healthy within "
                                 f"{timeout_s:.0f}s: {body}")
            time.sleep(0.25)

    # ---- fault injection (one service's process group, real signals) --------------------------
    def pid(self, name: str) -> int | None:
        """Process-group id of a running service (its launcher's pid), or None."""
        proc = self.procs.get(name)
        if proc is not None:
            return proc.pid if proc.poll() is None else None
        pid_file = self.state_dir / f"{name}.pid"
        if pid_file.exists():
            pid = int(pid_file.read_text())
            return pid if _pid_alive(pid) else None
        return None

    def send_signal(self, name: str, sig: int) -> int:
        """Send `sig` to every process of `name`; its pid. StackError if it is not running."""
        self._check(name)
        pid = self.pid(name)
        if pid is None:
            raise StackError(f"{name} is not running")
        os.killpg(pid, sig)
        return pid

    def kill(self, name: str, sig: int = signal.SIGKILL, wait_s: float = 30.0) -> None:
        """Kill `name` (SIGKILL by default, as `docker compose kill`) and wait until its processes are gone.
        A stopped (SIGSTOPped) service is killed too: SIGKILL needs no SIGCONT."""
        pid = self.send_signal(name, sig)
        if sig != signal.SIGKILL:
            _kill_group(pid, signal.SIGCONT)  # a paused process must run to handle TERM/INT
        proc = self.procs.pop(name, None)
        deadline = time.monotonic() + wait_s
        if proc is not None:
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                _kill_group(pid, signal.SIGKILL)
                proc.wait(timeout=10)
        while _group_alive(pid) and time.monotonic() < deadline:  # children (vLLM's engine core) too
            time.sleep(0.05)
        if _group_alive(pid):
            _kill_group(pid, signal.SIGKILL)
        (self.state_dir / f"{name}.pid").unlink(missing_ok=True)

    def pause(self, name: str) -> None:
        """SIGSTOP the service: its sockets stay open, nothing answers (a partitioned node)."""
        self.send_signal(name, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.send_signal(name, signal.SIGCONT)

    def restart(self, name: str, env: dict[str, str] | None = None, wait: bool = True,
                timeout_s: float | None = None) -> float:
        """Start `name` again with its launcher (SIGKILL first if it still runs); `env` overrides variables
        for this start only (e.g. a smaller MAX_MODEL_LEN). Returns the seconds until healthy (0 if not
        waited for)."""
        self._check(name)
        if self.pid(name) is not None:
            self.kill(name)
        launch_env = self.env()
        launch_env.update(env or {})
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._launch(name, launch_env)
        return self.wait_healthy((name,), timeout_s) if wait else 0.0

    def _check(self, name: str) -> None:
        if name not in self.specs:
            raise ValueError(f"unknown service {name!r}; choose from {list(self.specs)}")

    def log_tail(self, name: str, lines: int = 60) -> str:
        path = self.state_dir / f"{name}.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, names: tuple[str, ...] | None = None) -> None:
        """Stop every service, or only `names`."""
        for name in reversed([n for n in self.services if names is None or n in names]):
            pid_file = self.state_dir / f"{name}.pid"
            proc = self.procs.pop(name, None)
            pid = proc.pid if proc else (int(pid_file.read_text()) if pid_file.exists() else None)
            if pid is not None:
                _kill_group(pid)
                _kill_group(pid, signal.SIGCONT)  # a paused service handles TERM only once it runs
            if proc is not None:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    _kill_group(pid, signal.SIGKILL)
            pid_file.unlink(missing_ok=True)

    def status(self) -> dict[str, str]:
        out = {}
        for name, (_, path, port_var) in self.specs.items():
            pid_file = self.state_dir / f"{name}.pid"
            running = pid_file.exists() and _pid_alive(int(pid_file.read_text()))
            healthy = _http_ok(self.url(port_var) + path)
            out[name] = "healthy" if healthy else ("starting" if running else "down")
        return out

    def __enter__(self) -> "DevStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def cpu_split(ncpu: int | None = None) -> dict[str, str]:
    """CPU placement for the stack on one host: prefill the first half of the CPUs, native decode the second;
    the express engine gets one torch thread per core of the second half but is not pinned, so the kernel can
    keep it off a core that a vLLM server's busy NIXL progress thread occupies (pinned beside one on 2 CPUs it
    decoded at 7.5 tok/s). Any of these set in the environment wins. docs/deployment.md ("CPU placement") has
    what stock vLLM's NixlConnector does to placement on CPU and what other layouts measured on 2 CPUs."""
    ncpu = ncpu or len(os.sched_getaffinity(0))
    if ncpu < 2:
        return {}
    half = ncpu // 2
    first = "0" if half == 1 else f"0-{half - 1}"
    second = str(half) if ncpu - half == 1 else f"{half}-{ncpu - 1}"
    return {"PREFILL_CPU_BIND": first, "DECODE_NATIVE_CPU_BIND": second, "EXPRESS_THREADS": str(ncpu - half)}


# The express node's CPU weight against the other services, as compose/compose.yaml's `cpu_shares` (1024 = a
# default service). Each vLLM server keeps NIXL's progress thread polling a core without pause; at equal weights
# the express engine's one decode thread got half a core beside one and decoded at half speed
# (docs/bench/2026-12-04-cpu-long-context/).
DEFAULT_EXPRESS_CPU_SHARES = 8192
CPU_SHARES_VARS = {"decode-express": "EXPRESS_CPU_SHARES"}


def nice_for_shares(shares: int) -> int:
    """The nice level whose CFS weight is nearest `shares` (Docker's cpu_shares scale: 1024 = nice 0, and each nice
    level is a factor of 1.25 in the kernel's weight table), clamped to [-20, 19]."""
    if shares < 2:
        raise ValueError(f"cpu shares must be >= 2 (Docker's minimum), got {shares}")
    return max(-20, min(19, -round(math.log(shares / 1024) / math.log(1.25))))


def apply_cpu_shares(pid: int, shares: int) -> str | None:
    """Give a service started in its own session the CPU weight a container with `cpu_shares` gets: the nice of
    its session's autogroup (with kernel.sched_autogroup_enabled each session is one scheduling group, and only the
    group's nice weighs against other sessions) and of its process (without autogroups; the launcher's `exec` and
    every thread the server starts inherit it). Returns why it could not, or None. A higher weight (negative nice)
    needs root or CAP_SYS_NICE."""
    nice = nice_for_shares(shares)
    problems = []
    autogroup = Path(f"/proc/{pid}/autogroup")
    if autogroup.exists():
        try:
            autogroup.write_text(str(nice))
        except OSError as e:
            problems.append(f"autogroup nice {nice}: {e.strerror}")
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except OSError as e:
        problems.append(f"nice {nice}: {e.strerror}")
    return "; ".join(problems) or None


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still runs (zombies, which only wait for their parent to reap
    them, do not count; without /proc, any member counts)."""
    try:
        os.killpg(pgid, 0)
    except OSError:
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _kill_group(pid: int, sig: int = signal.SIGTERM) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


_SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "INT": signal.SIGINT}


# The settings `up` started a stack with, in its state directory: kill / pause / resume / restart / status / down
# act on that stack (a restarted service gets the stack's model, ports, pools and secrets, whatever flags they are
# given, as `docker compose restart` uses the project's own file). Without the file (a stack of the DevStack class,
# a test's): the flags and defaults.
SETTINGS_FILE = "stack.json"


def default_settings() -> dict:
    return {"model": DEFAULT_MODEL, "model_dir": str(MODELS_DIR / DEFAULT_MODEL), "served_model_name": None,
            "port_base": 0, "services": list(SERVICES), "secure": True, "prefills": 1, "natives": 1}


def given_settings(args: argparse.Namespace) -> dict:
    """The settings the command line names explicitly."""
    out: dict = {}
    if args.model is not None:
        out.update(model=args.model, model_dir=str(MODELS_DIR / args.model))
    if args.model_dir is not None:
        out.update(model=None, model_dir=str(args.model_dir.resolve()))
    if args.served_model_name is not None:
        out["served_model_name"] = args.served_model_name
    if args.port_base is not None:
        out["port_base"] = args.port_base
    if args.only is not None:
        out["services"] = [x for x in args.only.split(",") if x]
    if args.open:
        out["secure"] = False
    if args.prefills is not None:
        out["prefills"] = args.prefills
    if args.natives is not None:
        out["natives"] = args.natives
    return out


def save_settings(state_dir: Path, settings: dict) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n")


def load_settings(state_dir: Path) -> dict | None:
    """The settings of the stack `up` started in state_dir; None when none was (or the file is unreadable:
    the command then says what it could not find through DevStack)."""
    try:
        saved = json.loads((state_dir / SETTINGS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return {**default_settings(), **saved} if isinstance(saved, dict) else None


def stack_of(state_dir: Path, settings: dict) -> DevStack:
    """The DevStack these settings describe (scripts/soak.py --dev-stack builds the running stack's this way)."""
    return DevStack(model_dir=Path(settings["model_dir"]), model=settings["model"],
                    served_model_name=settings["served_model_name"], state_dir=state_dir,
                    port_base=settings["port_base"], services=tuple(settings["services"]), secure=settings["secure"],
                    prefills=settings["prefills"], natives=settings["natives"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["up", "down", "status", "kill", "pause", "resume", "restart"])
    ap.add_argument("service", nargs="?", help="for kill / pause / resume / restart (also prefill-2 ... with --prefills)")
    ap.add_argument("--signal", choices=list(_SIGNALS), default="KILL", help="kill: which signal (default KILL)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--model", choices=KNOWN_MODELS, default=None,
                       help=f"written into var/models/NAME by scripts/model_init.py (default {DEFAULT_MODEL})")
    which.add_argument("--model-dir", type=Path, default=None,
                       help="serve your own checkpoint directory as it is (no model-init)")
    ap.add_argument("--served-model-name", default=None,
                    help="the name clients use (default: the model directory's name); aliases NAME, NAME-express")
    ap.add_argument("--state-dir", type=Path, default=DEFAULT_STATE)
    ap.add_argument("--port-base", type=int, default=None, help="added to every default port (default 0)")
    ap.add_argument("--only", default=None, help="comma-separated services to start (default: all)")
    ap.add_argument("--open", action="store_const", const=True, default=None,
                    help="no generated internal secrets (node token, control-plane peer secret, vLLM API key): "
                         "every service open")
    ap.add_argument("--prefills", type=int, default=None, help="prefill pool size (default 1)")
    ap.add_argument("--natives", type=int, default=None, help="native decode pool size (default 1)")
    args = ap.parse_args(argv)
    given = given_settings(args)
    saved = None if args.command == "up" else load_settings(args.state_dir)
    if saved is not None:  # a service command acts on the stack as `up` started it
        differ = {k: (saved.get(k), v) for k, v in given.items() if saved.get(k) != v}
        if differ:
            what = "; ".join(f"{k}: started with {old!r}, asked {new!r}" for k, (old, new) in differ.items())
            print(f"{args.command}: the stack in {args.state_dir} was started otherwise ({what}); leave those flags "
                  f"out, or `down` and `up` it again to change them", file=sys.stderr)
            return 2
        settings = saved
    else:
        settings = {**default_settings(), **given}
    stack = stack_of(args.state_dir, settings)
    if args.command in ("kill", "pause", "resume", "restart"):
        if args.service is None:
            ap.error(f"{args.command} needs a SERVICE ({', '.join(SERVICES)})")
        try:
            if args.command == "kill":
                stack.kill(args.service, _SIGNALS[args.signal])
            elif args.command == "pause":
                stack.pause(args.service)
            elif args.command == "resume":
                stack.resume(args.service)
            else:
                print(f"{args.service} healthy after {stack.restart(args.service):.1f}s")
        except (StackError, ValueError) as e:
            print(f"{args.command} {args.service}: {e}", file=sys.stderr)
            return 1
        print(f"{args.command} {args.service}: done")
        return 0
    if args.command == "up":
        save_settings(args.state_dir, settings)
        stack.start()
        print(f"up: router {stack.router_url}  (logs in {stack.state_dir}; stop with `dev_stack.py down`)")
        print(f"  model {stack.model_dir}: aliases {stack.aliases[0]} (native lane), {stack.aliases[1]} (express)")
        print(f"  the router is open on 127.0.0.1; " + (
            f"internal secrets (node token, peer secret, vLLM API key) in {stack.state_dir / 'secrets'}"
            if stack.secure else "--open: the nodes, the control plane and vLLM are open too"))
        for name, state in stack.status().items():
            print(f"  {name:15s} {state}")
        return 0
    if args.command == "down":
        stack.stop()
        print("down")
        return 0
    for name, state in stack.status().items():
        print(f"{name:15s} {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
