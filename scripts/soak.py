#!/usr/bin/env python3
"""Bounded chaos soak: mixed traffic on both lanes while a loop kills and restarts decode nodes.

    python scripts/soak.py --dev-stack [--state-dir var/dev-stack] [--port-base 0] --duration 120 --seed 1
    python scripts/soak.py --compose [--project NAME] [--compose-file FILE ...] --duration 120

Traffic: `--concurrency` clients send completions and chat requests (greedy, ignore_eos, 8-48 tokens), on the
express alias (which spills to native as the shipped router config says) and the native alias, streamed or
not; a share of them disconnect on purpose at a random point. Chaos: every few seconds one decode service
(`--targets`) is SIGKILLed (then started again after a random downtime) or SIGSTOPped (then SIGCONTed):
`--dev-stack` signals the dev stack's process groups (scripts/dev_stack.py), `--compose` runs
`docker kill -s KILL` + `docker start` on a container of the running compose project, or SIGSTOPs and
SIGCONTs every process in it (ComposeTarget says why not `docker pause`); the default compose stack publishes only
the router (and Prometheus), so the soak reaches the internal services at their containers' addresses. It stops by
itself after `--duration` seconds, restores every service, lets the router settle, and prints:

    sent / served / failed with a typed error / disconnected (on purpose) / lost (no answer within --bound-s)
    / broken (an answer that is neither: a stream cut without an error event, a transport error)
    / stuck leases (the router's inflight + queue gauges after settling) / exactness of every completed output
    against the single vLLM server (the prefill, asked directly after the soak).

Also counted: typed refusals blamed on a member that was never faulted (`unfaulted_refusals`: a 503 naming the
prefill while only decode services were faulted; issue 42's acceptance is 0).

Exit status 1 when lost, broken or stuck is non-zero, a never-faulted member refused, or exactness is below 100 %;
2 on a usage error. Only loopback and this host's container addresses are used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests" / "integration"))  # the fault tests' client (fault_support.py)

import httpx  # noqa: E402
from fault_support import Outcome, greedy_references, metric, request, scrape, wait_until  # noqa: E402

LOOPBACK = "127.0.0.1"
WORDS = (REPO / "scripts" / "bench_lib" / "tiny_model_corpus.txt").read_text().split()


# ---- what is run against ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Endpoints:
    router: str
    prefill: str
    health: dict[str, str]  # service -> health URL
    express_status: str | None = None  # the express node's /decode_status
    node_headers: dict[str, str] = field(default_factory=dict)  # the node token (a closed stack: /decode_status)
    prefill_headers: dict[str, str] = field(default_factory=dict)  # vLLM's API key (the reference calls)
    connector_metrics: str | None = None  # the prefill connector's /metrics (dev stack)
    prometheus: str | None = None  # a Prometheus that scrapes the prefill connector (compose: it is not published)


class DevStackTarget:
    """Real signals to the process groups of a running dev stack (scripts/dev_stack.py up)."""

    def __init__(self, state_dir: Path, port_base: int | None, restart_env: dict[str, str] | None = None):
        from dev_stack import DevStack, load_settings, stack_of

        settings = load_settings(state_dir)
        if settings is not None:  # `dev_stack.py up`: a restarted service gets the stack's model, ports, secrets
            if port_base is not None and port_base != settings["port_base"]:
                raise SystemExit(f"the stack in {state_dir} runs at --port-base {settings['port_base']}, "
                                 f"not {port_base}")
            self.stack = stack_of(state_dir, settings)
        else:  # a stack of the DevStack class (a test's): a closed one restarts with its generated secrets
            self.stack = DevStack(state_dir=state_dir, port_base=port_base or 0,
                                  secure=(state_dir / "secrets").is_dir())
        self.restart_env = restart_env or {}
        s = self.stack
        self.endpoints = Endpoints(
            router=s.router_url, prefill=s.prefill_url,
            health={"decode-express": s.express_url + "/health", "decode-native": s.native_url + "/health",
                    "prefill": s.prefill_url + "/health"},
            express_status=s.express_url + "/decode_status", connector_metrics=s.connector_metrics_url + "/metrics",
            node_headers=s.auth_headers("EXPRESS_NODE_TOKEN"), prefill_headers=s.auth_headers("VLLM_API_KEY"))

    def kill(self, service: str) -> None:
        self.stack.kill(service)

    def start(self, service: str) -> None:
        self.stack.restart(service, env=self.restart_env, wait=False)

    def pause(self, service: str) -> None:
        self.stack.pause(service)

    def resume(self, service: str) -> None:
        self.stack.resume(service)

    def running(self, service: str) -> bool:
        return self.stack.pid(service) is not None


class ComposeTarget:
    """Real signals to the containers of a running compose project; health through the ports it publishes, or, for a
    service it does not publish (the default stack publishes only the router and Prometheus), through the container's
    address on the project's network (this host reaches its containers' addresses; looked up again after a restart).

    kill: `docker kill -s KILL <container>` (the container's init dies, and with it every process in it), then
    `docker start` brings the same container back. pause: SIGSTOP to every process of the container,
    sent from the host to the host pids `docker top` lists (a partition as the fault tests make one: sockets stay
    open, nothing answers), SIGCONT to resume. Not `docker pause`: the cgroup freezer is not a signal, and a
    SIGSTOP sent to the container's init alone would stop tini, not the server. Signalling the container's
    processes from the host needs root (or the container's uid), as compose-e2e.sh runs.
    """

    INTERNAL_PORTS = {"prefill": 8000, "decode-native": 8100, "decode-express": 5557}

    def __init__(self, project: str | None, files: list[str], ports: dict[str, int]):
        # Run from the repo root, so its .env (COMPOSE_PROJECT_NAME, COMPOSE_FILE) applies unless overridden;
        # compose-e2e.sh exports COMPOSE_FILE (the offline overlay), which this inherits.
        self.base = ["docker", "compose"] + (["-p", project] if project else []) + [
            a for f in files for a in ("-f", f)]
        self.ports = ports
        self._headers = (self._bearer("express_node_token"), self._bearer("vllm_api_key"))

    def url(self, service: str) -> str:
        """Where this host reaches `service`: its published loopback port (--ports), else its container's address."""
        if service in self.ports:
            return f"http://{LOOPBACK}:{self.ports[service]}"
        out = self._run(["docker", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}",
                         self.container(service)]).split()
        if not out:
            raise RuntimeError(f"soak: {service} has no network address (is it running?)")
        return f"http://{out[0]}:{self.INTERNAL_PORTS[service]}"

    @property
    def endpoints(self) -> Endpoints:
        """The addresses now (a restarted container may come back at another address)."""
        url = {s: self.url(s) for s in ("router", *self.INTERNAL_PORTS)}
        node_headers, prefill_headers = self._headers
        return Endpoints(
            router=url["router"], prefill=url["prefill"],
            health={"decode-express": url["decode-express"] + "/health",
                    "decode-native": url["decode-native"] + "/health", "prefill": url["prefill"] + "/health"},
            express_status=url["decode-express"] + "/decode_status",
            prometheus=f"http://{LOOPBACK}:{self.ports['prometheus']}" if "prometheus" in self.ports else None,
            node_headers=node_headers, prefill_headers=prefill_headers)

    def _bearer(self, name: str) -> dict[str, str]:
        """Authorization with a secret the default stack generated (secrets-init), read where the router reads it;
        none when the stack has no such file (an open stack, or secrets from elsewhere: production overlay)."""
        p = subprocess.run(self.base + ["exec", "-T", "router", "cat", f"/run/expresslane/secrets/{name}/{name}"],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
        return {"Authorization": f"Bearer {p.stdout.strip()}"} if p.returncode == 0 and p.stdout.strip() else {}

    @staticmethod
    def _run(cmd: list[str]) -> str:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
        if p.returncode != 0:
            raise RuntimeError(f"soak: {' '.join(cmd)} failed (rc={p.returncode}): {p.stderr.strip()[-400:]}")
        return p.stdout

    def container(self, service: str) -> str:
        ids = self._run(self.base + ["ps", "-a", "-q", service]).split()
        if len(ids) != 1:
            raise RuntimeError(f"soak: compose service {service!r} has {len(ids)} containers, expected one")
        return ids[0]

    def pids(self, service: str) -> list[int]:
        """Host pids of every process in the service's container."""
        out = self._run(["docker", "top", self.container(service), "-eo", "pid"]).split()
        return [int(x) for x in out[1:]]  # out[0] is the PID header

    def _signal_all(self, service: str, sig: signal.Signals) -> None:
        pids = self.pids(service)
        if not pids:
            raise RuntimeError(f"soak: {service} has no processes to send {sig.name} to")
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass  # exited between the listing and the signal
            except PermissionError as e:
                raise RuntimeError(f"soak: cannot send {sig.name} to {service}'s pid {pid} ({e}): the pause "
                                   "signals the container's processes from the host and needs root") from e

    def kill(self, service: str) -> None:
        self._run(["docker", "kill", "-s", "KILL", self.container(service)])

    def start(self, service: str) -> None:
        # The same container again. Not `docker compose start`: it first reruns the one-shot model-init
        # (a container with torch imported: 10-20 s more downtime on 2 CPUs for nothing).
        self._run(["docker", "start", self.container(service)])

    def pause(self, service: str) -> None:
        self._signal_all(service, signal.SIGSTOP)

    def resume(self, service: str) -> None:
        self._signal_all(service, signal.SIGCONT)

    def running(self, service: str) -> bool:
        state = self._run(["docker", "inspect", "-f", "{{.State.Running}}", self.container(service)]).strip()
        return state == "true"


# ---- one soak ------------------------------------------------------------------------------------------------
@dataclass
class Sent:
    kind: str  # completion | chat
    alias: str
    stream: bool
    body: dict
    disconnect_after_s: float | None
    outcome: Outcome | None = None


@dataclass
class Fault:
    at_s: float
    service: str
    action: str  # kill | pause
    down_s: float = 0.0
    back_after_s: float | None = None  # healthy again (kill) or resumed (pause), seconds after the fault


@dataclass
class Options:
    duration_s: float = 120.0
    seed: int = 1
    concurrency: int = 4
    bound_s: float = 90.0
    disconnect_share: float = 0.1
    stream_share: float = 0.5
    express_share: float = 0.6
    chat_share: float = 0.3
    fault_every_s: tuple[float, float] = (8.0, 20.0)
    down_s: tuple[float, float] = (2.0, 8.0)
    pause_share: float = 0.25
    targets: tuple[str, ...] = ("decode-express", "decode-native")
    pause_only: tuple[str, ...] = ()  # targets the loop SIGSTOPs but never kills (a vLLM restart is minutes)
    express_alias: str = "tiny-llama-express"
    native_alias: str = "tiny-llama"
    model: str = "tiny-llama"  # what the prefill serves (the reference)
    restart_timeout_s: float = 600.0
    settle_s: float = 30.0


def _prompt(rng: random.Random) -> str:
    n = rng.choice((4, 16, 60, 200, 400))
    start = rng.randrange(0, max(1, len(WORDS) - n))
    return " ".join(WORDS[start:start + n])


def _make_request(rng: random.Random, o: Options) -> Sent:
    alias = o.express_alias if rng.random() < o.express_share else o.native_alias
    chat = rng.random() < o.chat_share
    stream = rng.random() < o.stream_share
    text = _prompt(rng)
    body: dict = {"model": alias, "max_tokens": rng.choice((8, 24, 48)), "temperature": 0, "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    disconnect = rng.uniform(0.05, 1.5) if rng.random() < o.disconnect_share else None
    return Sent("chat" if chat else "completion", alias, stream, body, disconnect)


async def _client(i: int, ep: Endpoints, o: Options, until: float, log: list[Sent]) -> None:
    rng = random.Random(o.seed * 1000 + i)
    while time.monotonic() < until:
        s = _make_request(rng, o)
        path = "/v1/chat/completions" if s.kind == "chat" else "/v1/completions"
        s.outcome = await request(ep.router, path, s.body, bound_s=o.bound_s, stream=s.stream,
                                  disconnect_after_s=s.disconnect_after_s)
        log.append(s)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


async def _chaos(target, o: Options, t0: float, until: float, faults: list[Fault]) -> None:
    rng = random.Random(o.seed)
    while True:
        await asyncio.sleep(rng.uniform(*o.fault_every_s))
        if time.monotonic() >= until:
            return
        service = rng.choice(o.targets)
        action = "pause" if rng.random() < o.pause_share or service in o.pause_only else "kill"
        f = Fault(round(time.monotonic() - t0, 2), service, action, round(rng.uniform(*o.down_s), 2))
        faults.append(f)
        print(f"  [{f.at_s:7.1f}s] {action} {service} for {f.down_s:.1f}s", flush=True)
        await asyncio.to_thread(target.kill if action == "kill" else target.pause, service)
        t_fault = time.monotonic()
        await asyncio.sleep(f.down_s)
        await asyncio.to_thread(target.start if action == "kill" else target.resume, service)
        ok, _ = await asyncio.to_thread(wait_until, lambda: _healthy(target.endpoints.health[service]),
                                        o.restart_timeout_s, 0.5)
        f.back_after_s = round(time.monotonic() - t_fault, 1) if ok else None
        print(f"  [{time.monotonic() - t0:7.1f}s] {service} healthy again "
              f"({f.back_after_s if ok else 'NOT within ' + str(o.restart_timeout_s)}s after the fault)", flush=True)


def blamed(o: Outcome) -> str | None:
    """The service a typed refusal blames, read from its message (the router names the stage: prefill, decode,
    express), or None when it names none."""
    msg = (o.error or "").lower()
    if msg.startswith("prefill") or "prefill server" in msg or "prefill member" in msg:
        return "prefill"
    if "express" in msg:
        return "decode-express"
    if msg.startswith("decode") or "decode node" in msg or "native" in msg:
        return "decode-native"
    return None


def _ref_key(s: Sent) -> str:
    return json.dumps([s.kind, s.body.get("prompt"), s.body.get("messages"), s.body["max_tokens"]])


async def _references(ep: Endpoints, o: Options, served: list[Sent], parallel: int = 8) -> dict[str, str | None]:
    """The single server's greedy answer to every distinct served request: the prefill (a plain vLLM) asked
    directly, `parallel` at a time (vLLM batches them; one at a time took a minute or two for a CI soak).
    None for a request the reference could not answer (then that output counts as inexact)."""
    return await greedy_references(ep.prefill, o.model, {_ref_key(s): (s.kind, s.body) for s in served},
                                   parallel=parallel, timeout_s=120, headers=ep.prefill_headers)


def _prometheus_value(base: str, expr: str) -> float | None:
    """The value of an instant query (summed over series); None when Prometheus has none or does not answer."""
    try:
        result = httpx.get(base + "/api/v1/query", params={"query": expr}, timeout=5,
                           trust_env=False).json()["data"]["result"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return sum(float(r["value"][1]) for r in result) if result else None


def _stuck(ep: Endpoints) -> dict[str, float]:
    m = scrape(ep.router + "/metrics")
    out = {"router_inflight": metric(m, "expresslane_router_inflight_requests") or 0.0,
           "router_queue_depth": metric(m, "expresslane_router_queue_depth") or 0.0}
    if ep.connector_metrics:
        c = scrape(ep.connector_metrics)
        in_use = metric(c, "expresslane_connector_staging_slots_in_use")
        if in_use is not None:
            out["staging_slots_in_use"] = in_use
    elif ep.prometheus:
        in_use = _prometheus_value(ep.prometheus, "sum(expresslane_connector_staging_slots_in_use)")
        if in_use is not None:
            out["staging_slots_in_use"] = in_use
    if ep.express_status:
        try:
            status = httpx.get(ep.express_status, timeout=2, trust_env=False, headers=ep.node_headers).json()
            # a node of several seats says how many are held (its "state" is "busy" only when all are)
            busy = status.get("seats_busy")
            out["express_node_busy"] = float(busy) if isinstance(busy, int) else (
                0.0 if status.get("state") == "idle" else 1.0)
        except (httpx.HTTPError, ValueError, AttributeError):
            out["express_node_busy"] = 1.0
    return out


async def soak(target, o: Options) -> dict:
    ep = target.endpoints
    missing = [s for s, url in ep.health.items() if not _healthy(url)] + ([] if _healthy(ep.router + "/health")
                                                                           else ["router"])
    if missing:
        raise SystemExit(f"soak: not healthy before the start: {missing} (start the stack first)")
    t0 = time.monotonic()
    until = t0 + o.duration_s
    log: list[Sent] = []
    faults: list[Fault] = []
    print(f"soak: {o.duration_s:g}s, seed {o.seed}, {o.concurrency} clients, faults on {','.join(o.targets)}"
          + (f" ({','.join(o.pause_only)}: SIGSTOP only)" if o.pause_only else ""), flush=True)
    chaos = asyncio.create_task(_chaos(target, o, t0, until, faults))
    await asyncio.gather(*(_client(i, ep, o, until, log) for i in range(o.concurrency)))
    await chaos  # ends after its current fault has been undone
    for service in o.targets:  # belt and braces: everything runs and answers
        if not target.running(service):
            target.start(service)
        ok, _ = wait_until(lambda: _healthy(target.endpoints.health[service]), o.restart_timeout_s, 0.5)
        if not ok:
            print(f"soak: {service} did not come back within {o.restart_timeout_s}s", flush=True)
    ep = target.endpoints  # (a restarted container may be at another address now)
    settled, waited = wait_until(lambda: not any(_stuck(ep).values()), o.settle_s, 0.5)
    stuck = _stuck(ep)
    served = [s for s in log if s.outcome.ok]
    refs = await _references(ep, o, served)
    exact = sum(1 for s in served if s.outcome.text == refs[_ref_key(s)])
    typed = [s for s in log if not s.outcome.ok and not s.outcome.disconnected and s.outcome.typed_error
             and s.outcome.error_type not in ("truncated", "transport", "bad_sse")]
    disconnected = [s for s in log if s.outcome.disconnected]
    lost = [s for s in log if s.outcome.lost]
    broken = [s for s in log if s not in typed and s not in disconnected and s not in lost and not s.outcome.ok]
    faulted = {f.service for f in faults}
    unfaulted = [s for s in typed if blamed(s.outcome) is not None and blamed(s.outcome) not in faulted]
    result = {
        "duration_s": o.duration_s, "seed": o.seed, "sent": len(log), "served": len(served),
        "served_by_alias": dict(Counter(s.alias for s in served)),
        "served_streamed": sum(1 for s in served if s.stream),
        "typed_errors": len(typed),
        "typed_errors_by_kind": dict(Counter(f"{s.outcome.status}:{s.outcome.error_type}" for s in typed)),
        "typed_errors_by_blamed": dict(Counter(str(blamed(s.outcome)) for s in typed)),
        "unfaulted_refusals": len(unfaulted),
        "disconnected": len(disconnected), "lost": len(lost), "broken": len(broken),
        "stuck": stuck, "settled_after_s": round(waited, 1) if settled else None,
        "exact": exact, "exactness": (exact / len(served)) if served else 1.0,
        "faults": [asdict(f) for f in faults],
        "examples": {k: [s.outcome.describe() for s in v[:5]] for k, v in
                     (("lost", lost), ("broken", broken), ("unfaulted", unfaulted), ("typed", typed)) if v},
        "inexact": [{"body": s.body, "got": s.outcome.text, "want": refs[_ref_key(s)]}
                    for s in served if s.outcome.text != refs[_ref_key(s)]][:3],
    }
    return result


# ---- the handoff's share of an express request (issue 11 item 4: what a second receive slot would buy) ------
async def measure_handoff(ep: Endpoints, o: Options, n: int) -> dict:
    """n express requests one after another (non-stream, greedy, 48 tokens, a 200-word prompt), no faults.
    The node's per-phase times come from its own /metrics (expresslane_decode_phase_seconds, deltas over the
    run); the client's time end to end from here. `outside_node_ms` = client time - the node's phases: gate,
    /pd/reserve, the prefill leg and the router's own work. With a second receive slot, request N+1's reserve,
    prefill and KV transfer (outside_node + wire_wait + convert) could run while N decodes; inject stays serial
    (it writes the engine's cache), so back-to-back requests on one node would save min(that, decode) each."""
    if not ep.express_status:
        raise SystemExit("soak: --handoff needs the express node's address")
    node_metrics = ep.express_status.rsplit("/", 1)[0] + "/metrics"
    phases = ("wire_wait", "convert", "inject", "decode")

    def totals() -> dict[str, tuple[float, float]]:
        m = scrape(node_metrics)
        return {ph: (metric(m, "expresslane_decode_phase_seconds_sum", phase=ph) or 0.0,
                     metric(m, "expresslane_decode_phase_seconds_count", phase=ph) or 0.0) for ph in phases}

    rng = random.Random(o.seed)
    words = 200
    before = totals()
    elapsed: list[float] = []
    failures: list[str] = []
    for _ in range(n):
        start = rng.randrange(0, max(1, len(WORDS) - words))
        body = {"model": o.express_alias, "prompt": " ".join(WORDS[start:start + words]), "max_tokens": 48,
                "temperature": 0, "ignore_eos": True}
        out = await request(ep.router, "/v1/completions", body, bound_s=o.bound_s, stream=False)
        if out.ok:
            elapsed.append(out.elapsed_s)
        else:
            failures.append(out.describe())
    after = totals()
    per: dict[str, float] = {}
    for ph in phases:
        d_sum, d_n = after[ph][0] - before[ph][0], after[ph][1] - before[ph][1]
        per[ph] = round(1000 * d_sum / d_n, 2) if d_n else 0.0
    client_ms = round(1000 * sum(elapsed) / len(elapsed), 2) if elapsed else 0.0
    node_ms = sum(per.values())
    outside = round(max(0.0, client_ms - node_ms), 2)
    overlappable = outside + per["wire_wait"] + per["convert"]
    saved = min(overlappable, per["decode"])
    return {"requests": n, "served": len(elapsed), "failures": failures[:5], "client_ms": client_ms,
            "node_phase_ms": per, "outside_node_ms": outside,
            "handoff_share": round((per["wire_wait"] + per["convert"] + per["inject"]) / client_ms, 4)
            if client_ms else 0.0,
            "overlappable_ms": round(overlappable, 2), "saved_per_back_to_back_request_ms": round(saved, 2),
            "back_to_back_speedup": round(client_ms / (client_ms - saved), 3) if client_ms > saved else None}


def print_handoff(h: dict) -> None:
    p = h["node_phase_ms"]
    print(f"\nhandoff share ({h['served']}/{h['requests']} express requests, one at a time, 48 tokens, 200-word prompt)")
    print(f"  client end to end   {h['client_ms']:8.1f} ms")
    print(f"  outside the node    {h['outside_node_ms']:8.1f} ms  (gate, /pd/reserve, prefill leg, router)")
    for ph in ("wire_wait", "convert", "inject", "decode"):
        print(f"  node {ph:<14} {p[ph]:8.1f} ms")
    print(f"  handoff share       {100 * h['handoff_share']:8.2f} %  (wire_wait + convert + inject of the client time)")
    print(f"  a second receive slot could overlap {h['overlappable_ms']:.1f} ms (outside + wire_wait + convert) with"
          f" the previous request's decode: {h['saved_per_back_to_back_request_ms']:.1f} ms saved per back-to-back"
          f" request, {h['back_to_back_speedup']}x requests/s on a saturated node")
    for f in h["failures"]:
        print(f"    failed: {f}")


def print_report(r: dict) -> None:
    stuck_total = sum(r["stuck"].values())
    print(f"\nsoak result ({r['duration_s']:g}s, seed {r['seed']}, {len(r['faults'])} faults)")
    print(f"  sent            {r['sent']}")
    print(f"  served          {r['served']}  by alias {r['served_by_alias']}, streamed {r['served_streamed']}")
    print(f"  typed errors    {r['typed_errors']}  {r['typed_errors_by_kind']}  blamed {r['typed_errors_by_blamed']}")
    print(f"  unfaulted       {r['unfaulted_refusals']}  (typed refusals blamed on a member never faulted)")
    print(f"  disconnected    {r['disconnected']}  (on purpose)")
    print(f"  lost            {r['lost']}  (no answer within the bound)")
    print(f"  broken          {r['broken']}  (neither an answer nor a typed error)")
    print(f"  stuck leases    {stuck_total:g}  {r['stuck']}")
    print(f"  exact           {r['exact']}/{r['served']} ({100 * r['exactness']:.2f} %)")
    for k, v in r["examples"].items():
        for line in v:
            print(f"    {k}: {line}")
    for x in r["inexact"]:
        print(f"    inexact: {json.dumps(x)[:400]}")


def failed(r: dict) -> bool:
    return (r["lost"] > 0 or r["broken"] > 0 or sum(r["stuck"].values()) > 0 or r["exactness"] < 1.0
            or r["unfaulted_refusals"] > 0)


def _span(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(",")
    return float(lo), float(hi or lo)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--dev-stack", action="store_true", help="a running scripts/dev_stack.py stack")
    where.add_argument("--compose", action="store_true", help="a running docker compose project")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of traffic and faults")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--bound-s", type=float, default=90.0, help="a request without an answer by then is lost")
    ap.add_argument("--targets", default="decode-express,decode-native", help="services the chaos loop hits")
    ap.add_argument("--fault-every", default="8,20", help="seconds between faults, min,max")
    ap.add_argument("--down", default="2,8", help="seconds a killed/paused service stays down, min,max")
    ap.add_argument("--pause-share", type=float, default=0.25, help="share of faults that are SIGSTOP, not SIGKILL")
    ap.add_argument("--pause-only", default="", help="targets that are only ever SIGSTOPped, never killed (the CI "
                    "soak: decode-native, whose vLLM restart takes 2-3 min on 2 CPUs)")
    ap.add_argument("--disconnect-share", type=float, default=0.1)
    ap.add_argument("--express-alias", default="tiny-llama-express")
    ap.add_argument("--native-alias", default="tiny-llama")
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("--handoff", type=int, default=0, metavar="N",
                    help="instead of the soak: N express requests one at a time, no faults, and the handoff's share "
                         "of each (the node's phase times from its /metrics)")
    ap.add_argument("--state-dir", type=Path, default=REPO / "var" / "dev-stack", help="--dev-stack: its state")
    ap.add_argument("--port-base", type=int, default=None,
                    help="--dev-stack: its port shift (default: the one `dev_stack.py up` started it with, else 0)")
    ap.add_argument("--restart-env", default="EXPRESS_COMPILE=0",
                    help="--dev-stack: K=V,... for restarted services (default: the express node skips torch.compile, "
                         "~10 s to healthy instead of ~55 s on 2 CPUs; empty = as first started)")
    ap.add_argument("--project", default=None, help="--compose: the project name (default: COMPOSE_PROJECT_NAME "
                    "from the environment or the repo's .env)")
    ap.add_argument("--compose-file", action="append", default=[], help="--compose: -f files (default: "
                    "COMPOSE_FILE from the environment or the repo's .env)")
    ap.add_argument("--ports", default="router=8080",
                    help="--compose: the loopback ports it publishes (prometheus=, default 9090: the prefill "
                         "connector's staging slots are read there); a service not named here is reached at its "
                         "container's address (the default stack publishes only the router and Prometheus)")
    a = ap.parse_args(argv)
    targets = tuple(t for t in a.targets.split(",") if t)
    bad = set(targets) - {"decode-express", "decode-native"}
    if bad or not targets:
        ap.error(f"--targets: decode services only (decode-express, decode-native), got {sorted(bad) or 'none'}")
    try:
        opts = Options(duration_s=a.duration, seed=a.seed, concurrency=a.concurrency, bound_s=a.bound_s,
                       targets=targets, fault_every_s=_span(a.fault_every), down_s=_span(a.down),
                       pause_share=a.pause_share, disconnect_share=a.disconnect_share,
                       pause_only=tuple(t for t in a.pause_only.split(",") if t),
                       express_alias=a.express_alias, native_alias=a.native_alias,
                       model=a.native_alias)  # the native alias is the served model's name (router.yaml)
        ports = {"prometheus": 9090} | {k: int(v) for k, v in (kv.split("=", 1) for kv in a.ports.split(","))}
    except ValueError as e:
        ap.error(str(e))
    if a.dev_stack:
        try:
            restart_env = dict(kv.split("=", 1) for kv in a.restart_env.split(",") if kv)
        except ValueError:
            ap.error(f"--restart-env: K=V,... expected, got {a.restart_env!r}")
        target = DevStackTarget(a.state_dir, a.port_base, restart_env)
    else:
        target = ComposeTarget(a.project, a.compose_file, ports)
    if a.handoff:
        h = asyncio.run(measure_handoff(target.endpoints, opts, a.handoff))
        print_handoff(h)
        if a.json:
            a.json.write_text(json.dumps(h, indent=2))
        return 0 if h["served"] == h["requests"] else 1
    result = asyncio.run(soak(target, opts))
    print_report(result)
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    bad_run = failed(result)
    print("soak: FAILED" if bad_run else "soak: passed (0 lost, 0 broken, 0 stuck, 0 refusals blamed on a member never "
                                          "faulted, 100 % exact)")
    return 1 if bad_run else 0


if __name__ == "__main__":
    sys.exit(main())
