#!/usr/bin/env python3
"""Bounded chaos soak: mixed traffic on both lanes while a loop kills and restarts decode nodes.

    python scripts/soak.py --dev-stack [--state-dir var/dev-stack] [--port-base 0] --duration 120 --seed 1
    python scripts/soak.py --compose [--project NAME] [--compose-file FILE ...] --duration 120

Traffic: `--concurrency` clients send completions and chat requests (greedy, ignore_eos, 8-48 tokens), on the
express alias (which spills to native as the shipped router config says) and the native alias, streamed or
not; a share of them disconnect on purpose at a random point. Chaos: every few seconds one decode service
(`--targets`) is SIGKILLed (then started again after a random downtime) or SIGSTOPped (then SIGCONTed):
`--dev-stack` signals the dev stack's process groups (scripts/dev_stack.py), `--compose` runs
`docker compose kill -s SIGKILL | start | pause | unpause` on the running compose project. It stops by
itself after `--duration` seconds, restores every service, lets the router settle, and prints:

    sent / served / failed with a typed error / disconnected (on purpose) / lost (no answer within --bound-s)
    / broken (an answer that is neither: a stream cut without an error event, a transport error)
    / stuck leases (the router's inflight + queue gauges after settling) / exactness of every completed output
    against the single vLLM server (the prefill, asked directly after the soak).

Exit status 1 when lost, broken or stuck is non-zero or exactness is below 100 %; 2 on a usage error.
Only loopback addresses are used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
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
from fault_support import Outcome, metric, request, scrape, wait_until  # noqa: E402

LOOPBACK = "127.0.0.1"
WORDS = (REPO / "scripts" / "tiny_model_corpus.txt").read_text().split()


# ---- what is run against ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Endpoints:
    router: str
    prefill: str
    health: dict[str, str]  # service -> health URL
    express_status: str | None = None  # the express node's /decode_status
    connector_metrics: str | None = None


class DevStackTarget:
    """Real signals to the process groups of a running dev stack (scripts/dev_stack.py up)."""

    def __init__(self, state_dir: Path, port_base: int, restart_env: dict[str, str] | None = None):
        from dev_stack import DevStack

        self.stack = DevStack(state_dir=state_dir, port_base=port_base)
        self.restart_env = restart_env or {}
        s = self.stack
        self.endpoints = Endpoints(
            router=s.router_url, prefill=s.prefill_url,
            health={"decode-express": s.express_url + "/health", "decode-native": s.native_url + "/health",
                    "prefill": s.prefill_url + "/health"},
            express_status=s.express_url + "/decode_status", connector_metrics=s.connector_metrics_url + "/metrics")

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
    """`docker compose` on a running project; health through the ports it publishes on loopback."""

    def __init__(self, project: str | None, files: list[str], ports: dict[str, int]):
        # Run from the repo root, so its .env (COMPOSE_PROJECT_NAME, COMPOSE_FILE) applies unless overridden.
        self.base = ["docker", "compose"] + (["-p", project] if project else []) + [
            a for f in files for a in ("-f", f)]
        url = {k: f"http://{LOOPBACK}:{v}" for k, v in ports.items()}
        self.endpoints = Endpoints(
            router=url["router"], prefill=url["prefill"],
            health={"decode-express": url["decode-express"] + "/health",
                    "decode-native": url["decode-native"] + "/health", "prefill": url["prefill"] + "/health"},
            express_status=url["decode-express"] + "/decode_status")
        self._down: set[str] = set()

    def _compose(self, *args: str) -> None:
        subprocess.run(self.base + list(args), check=True, capture_output=True, text=True, timeout=120, cwd=REPO)

    def kill(self, service: str) -> None:
        self._compose("kill", "-s", "SIGKILL", service)
        self._down.add(service)

    def start(self, service: str) -> None:
        self._compose("start", service)
        self._down.discard(service)

    def pause(self, service: str) -> None:
        self._compose("pause", service)

    def resume(self, service: str) -> None:
        self._compose("unpause", service)

    def running(self, service: str) -> bool:
        return service not in self._down


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
    ep = target.endpoints
    while True:
        await asyncio.sleep(rng.uniform(*o.fault_every_s))
        if time.monotonic() >= until:
            return
        service = rng.choice(o.targets)
        action = "pause" if rng.random() < o.pause_share else "kill"
        f = Fault(round(time.monotonic() - t0, 2), service, action, round(rng.uniform(*o.down_s), 2))
        faults.append(f)
        print(f"  [{f.at_s:7.1f}s] {action} {service} for {f.down_s:.1f}s", flush=True)
        await asyncio.to_thread(target.kill if action == "kill" else target.pause, service)
        t_fault = time.monotonic()
        await asyncio.sleep(f.down_s)
        await asyncio.to_thread(target.start if action == "kill" else target.resume, service)
        ok, _ = await asyncio.to_thread(wait_until, lambda: _healthy(ep.health[service]), o.restart_timeout_s, 0.5)
        f.back_after_s = round(time.monotonic() - t_fault, 1) if ok else None
        print(f"  [{time.monotonic() - t0:7.1f}s] {service} healthy again "
              f"({f.back_after_s if ok else 'NOT within ' + str(o.restart_timeout_s)}s after the fault)", flush=True)


def _reference(ep: Endpoints, o: Options, s: Sent, cache: dict) -> str | None:
    key = json.dumps([s.kind, s.body.get("prompt"), s.body.get("messages"), s.body["max_tokens"]])
    if key not in cache:
        body = dict(s.body, model=o.model, stream=False)
        path = "/v1/chat/completions" if s.kind == "chat" else "/v1/completions"
        r = httpx.post(ep.prefill + path, json=body, timeout=120, trust_env=False)
        if r.status_code != 200:
            cache[key] = None
        else:
            choice = r.json()["choices"][0]
            cache[key] = choice["text"] if s.kind == "completion" else choice["message"]["content"]
    return cache[key]


def _stuck(ep: Endpoints) -> dict[str, float]:
    m = scrape(ep.router + "/metrics")
    out = {"router_inflight": metric(m, "expresslane_router_inflight_requests") or 0.0,
           "router_queue_depth": metric(m, "expresslane_router_queue_depth") or 0.0}
    if ep.connector_metrics:
        c = scrape(ep.connector_metrics)
        in_use = metric(c, "expresslane_connector_staging_slots_in_use")
        if in_use is not None:
            out["staging_slots_in_use"] = in_use
    if ep.express_status:
        try:
            out["express_node_busy"] = 0.0 if httpx.get(ep.express_status, timeout=2, trust_env=False).json().get(
                "state") == "idle" else 1.0
        except (httpx.HTTPError, ValueError):
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
    print(f"soak: {o.duration_s:g}s, seed {o.seed}, {o.concurrency} clients, faults on {','.join(o.targets)}",
          flush=True)
    chaos = asyncio.create_task(_chaos(target, o, t0, until, faults))
    await asyncio.gather(*(_client(i, ep, o, until, log) for i in range(o.concurrency)))
    await chaos  # ends after its current fault has been undone
    for service in o.targets:  # belt and braces: everything runs and answers
        if not target.running(service):
            target.start(service)
        ok, _ = wait_until(lambda: _healthy(ep.health[service]), o.restart_timeout_s, 0.5)
        if not ok:
            print(f"soak: {service} did not come back within {o.restart_timeout_s}s", flush=True)
    settled, waited = wait_until(lambda: not any(_stuck(ep).values()), o.settle_s, 0.5)
    stuck = _stuck(ep)
    refs: dict = {}
    served = [s for s in log if s.outcome.ok]
    exact = sum(1 for s in served if s.outcome.text == _reference(ep, o, s, refs))
    typed = [s for s in log if not s.outcome.ok and not s.outcome.disconnected and s.outcome.typed_error
             and s.outcome.error_type not in ("truncated", "transport", "bad_sse")]
    disconnected = [s for s in log if s.outcome.disconnected]
    lost = [s for s in log if s.outcome.lost]
    broken = [s for s in log if s not in typed and s not in disconnected and s not in lost and not s.outcome.ok]
    result = {
        "duration_s": o.duration_s, "seed": o.seed, "sent": len(log), "served": len(served),
        "served_by_alias": dict(Counter(s.alias for s in served)),
        "served_streamed": sum(1 for s in served if s.stream),
        "typed_errors": len(typed),
        "typed_errors_by_kind": dict(Counter(f"{s.outcome.status}:{s.outcome.error_type}" for s in typed)),
        "disconnected": len(disconnected), "lost": len(lost), "broken": len(broken),
        "stuck": stuck, "settled_after_s": round(waited, 1) if settled else None,
        "exact": exact, "exactness": (exact / len(served)) if served else 1.0,
        "faults": [asdict(f) for f in faults],
        "examples": {k: [s.outcome.describe() for s in v[:5]] for k, v in
                     (("lost", lost), ("broken", broken), ("typed", typed)) if v},
        "inexact": [{"body": s.body, "got": s.outcome.text, "want": _reference(ep, o, s, refs)}
                    for s in served if s.outcome.text != _reference(ep, o, s, refs)][:3],
    }
    return result


def print_report(r: dict) -> None:
    stuck_total = sum(r["stuck"].values())
    print(f"\nsoak result ({r['duration_s']:g}s, seed {r['seed']}, {len(r['faults'])} faults)")
    print(f"  sent            {r['sent']}")
    print(f"  served          {r['served']}  by alias {r['served_by_alias']}, streamed {r['served_streamed']}")
    print(f"  typed errors    {r['typed_errors']}  {r['typed_errors_by_kind']}")
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
    return r["lost"] > 0 or r["broken"] > 0 or sum(r["stuck"].values()) > 0 or r["exactness"] < 1.0


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
    ap.add_argument("--disconnect-share", type=float, default=0.1)
    ap.add_argument("--express-alias", default="tiny-llama-express")
    ap.add_argument("--native-alias", default="tiny-llama")
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("--state-dir", type=Path, default=REPO / "var" / "dev-stack", help="--dev-stack: its state")
    ap.add_argument("--port-base", type=int, default=0, help="--dev-stack: its port shift")
    ap.add_argument("--restart-env", default="EXPRESS_COMPILE=0",
                    help="--dev-stack: K=V,... for restarted services (default: the express node skips torch.compile, "
                         "~10 s to healthy instead of ~55 s on 2 CPUs; empty = as first started)")
    ap.add_argument("--project", default=None, help="--compose: the project name (default: COMPOSE_PROJECT_NAME "
                    "from the environment or the repo's .env)")
    ap.add_argument("--compose-file", action="append", default=[], help="--compose: -f files (default: "
                    "COMPOSE_FILE from the environment or the repo's .env)")
    ap.add_argument("--ports", default="router=8080,prefill=8000,decode-native=8100,decode-express=5557",
                    help="--compose: the loopback ports it publishes")
    a = ap.parse_args(argv)
    targets = tuple(t for t in a.targets.split(",") if t)
    bad = set(targets) - {"decode-express", "decode-native"}
    if bad or not targets:
        ap.error(f"--targets: decode services only (decode-express, decode-native), got {sorted(bad) or 'none'}")
    try:
        opts = Options(duration_s=a.duration, seed=a.seed, concurrency=a.concurrency, bound_s=a.bound_s,
                       targets=targets, fault_every_s=_span(a.fault_every), down_s=_span(a.down),
                       pause_share=a.pause_share, disconnect_share=a.disconnect_share,
                       express_alias=a.express_alias, native_alias=a.native_alias)
        ports = {k: int(v) for k, v in (kv.split("=", 1) for kv in a.ports.split(","))}
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
    result = asyncio.run(soak(target, opts))
    print_report(result)
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    bad_run = failed(result)
    print("soak: FAILED" if bad_run else "soak: passed (0 lost, 0 broken, 0 stuck, 100 % exact)")
    return 1 if bad_run else 0


if __name__ == "__main__":
    sys.exit(main())
