"""The express lane through real faults (issue 11 acceptance): real processes, real signals, stated bounds.

One stack for the module: the session's `live_stack` (its services are killed, paused and restarted here with
their own launchers, and left healthy for the modules after this one) and a router process of our own whose
aliases make each policy visible: `x-spill` spills to the native lane before the first token (and, with the
router's default `resilience.midstream_failover`, continues a broken express stream on the native lane),
`x-reject` answers a typed error instead. Every other router setting is the router's default.

Each test records what every request got (status, error type, time to surface, text), checks it against
the single-server reference (the prefill's own greedy answer) and the bound written beside it, and then
checks the aftermath: the gate free, the node ejected and re-admitted (router metric
expresslane_router_upstream_healthy), no staging slot leaked (connector metrics), the next requests served.
All checks of a test are collected and reported together, so a failing run says everything it saw.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
import signal
import time
import uuid

import httpx
import pytest

from exactness import token_prompt
from fault_support import BlackHolePeer, Outcome, RouterProcess, metric, request, run, scrape, wait_until

SPILL, REJECT, NATIVE = "x-spill", "x-reject", "tiny-llama"
# Bounds (seconds). The router's defaults: probes every 2 s within 2 s, 3 failing probes in a row mark a node
# unhealthy (a probe that times out counts only once the node showed no other life for interval + timeout: one
# more round after a SIGSTOP); a stream silent for 10 s from a node that shows no life is dead.
DETECT_S = 16.0       # node ejected (upstream_healthy 0) after its process dies or stops
READMIT_S = 15.0      # node re-admitted (upstream_healthy 1) after it answers /health again
FAST_S = 2.0          # a typed error for a request that cannot be served
SERVE_S = 20.0        # a short request (24 tokens) served, spilled or not, on this loaded 2-CPU box
STREAM_S = 60.0       # a 400-token stream completes, failover included
NORMAL_S = 10.0       # "normal time" for a short express request after the orphan storm
# A prefill-side failure ends the request within this after the prefill itself. The abort that carries it
# reaches the waiting node in milliseconds; what this guards against (no abort: the node waits out the router's
# kv_wait_s, 15 s) is far above it. 1.0 s was too tight for a loaded 2-CPU host: 1.8-2.7 s seen at load 4-6,
# while the prefill still stepped every 1 ms for hung sends (before the connector's pacing).
PREFILL_FAIL_S = 3.0
SHORT, LONG = 24, 400
# Restarted express nodes skip torch.compile: ~10 s to healthy instead of ~55 s on this box (measured); the
# decode step's speed is not what these tests check, and the plain step's greedy output is the same.
RESTART_ENV = {"EXPRESS_COMPILE": "0"}


class Checks:
    """Collects every check of one test with what was seen; fails once at the end with all of them."""

    def __init__(self, name: str):
        self.name, self.lines, self.failed = name, [], []

    def __call__(self, cond: object, what: str) -> bool:
        self.lines.append(("ok   " if cond else "FAIL ") + what)
        if not cond:
            self.failed.append(what)
        return bool(cond)

    def note(self, what: str) -> None:
        self.lines.append("     " + what)

    def done(self) -> None:
        report = f"\n[{self.name}]\n" + "\n".join(self.lines)
        print(report)
        assert not self.failed, report


class Faults:
    """The module's stack, router and references, with the aftermath checks every test shares."""

    def __init__(self, stack, router: RouterProcess):
        self.stack, self.router = stack, router
        self.express_node = stack.express_url.split("://", 1)[1]
        self.native_node = stack.native_url.split("://", 1)[1]
        self._refs: dict[tuple, str] = {}
        self.staging_total = None
        self.last_scrape = "router /metrics not scraped yet"

    # ---- requests ------------------------------------------------------------------------------
    def body(self, alias: str, prompt: list[int], max_tokens: int = SHORT, **kw) -> dict:
        return dict({"model": alias, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True}, **kw)

    async def send(self, alias: str, prompt: list[int], max_tokens: int = SHORT, *, bound_s: float = SERVE_S,
                   stream: bool = False, **kw) -> Outcome:
        return await request(self.router.url, "/v1/completions", self.body(alias, prompt, max_tokens),
                             bound_s=bound_s, stream=stream, **kw)

    def ref(self, prompt: list[int], max_tokens: int = SHORT) -> str:
        """The single vLLM server's greedy answer (the prefill server, asked directly)."""
        key = (tuple(prompt), max_tokens)
        if key not in self._refs:
            r = httpx.post(f"{self.stack.prefill_url}/v1/completions", timeout=300, trust_env=False,
                           json=self.body("tiny-llama", prompt, max_tokens))
            assert r.status_code == 200, r.text
            self._refs[key] = r.json()["choices"][0]["text"]
        return self._refs[key]

    # ---- observations --------------------------------------------------------------------------
    def router_metrics(self):
        return scrape(f"{self.router.url}/metrics")

    def healthy(self, lane: str, node: str) -> float | None:
        return metric(self.router_metrics(), "expresslane_router_upstream_healthy", lane=lane, node=node)

    def wait_health(self, lane: str, node: str, value: float, timeout_s: float) -> float | None:
        """Seconds until the router's upstream_healthy gauge of `node` reads `value`; None if it never did."""
        got, waited = wait_until(lambda: self.healthy(lane, node) == value, timeout_s, 0.2)
        return waited if got else None

    def ready_says(self, url: str) -> bool | None:
        """What the router's /ready says of upstream `url`: healthy True/False, None if it does not say."""
        try:
            body = httpx.get(f"{self.router.url}/ready", timeout=2, trust_env=False).json()
        except (httpx.HTTPError, ValueError):
            return None
        entry = (body.get("upstreams") or {}).get(url) if isinstance(body, dict) else None
        return entry.get("healthy") if isinstance(entry, dict) else None

    def gate_state(self) -> tuple[float | None, float | None]:
        """The express pool's (in flight, queued), from the router's /metrics; (None, None) when it did not
        answer within the scrape's timeout (`last_scrape` says how long the last one took)."""
        t0 = time.monotonic()
        m = self.router_metrics()
        self.last_scrape = f"router /metrics {'answered' if m else 'did NOT answer'} in {time.monotonic() - t0:.2f}s"
        return (metric(m, "expresslane_router_inflight_requests", pool="express"),
                metric(m, "expresslane_router_queue_depth", pool="express"))

    def gate_free(self, timeout_s: float = 5.0) -> bool:
        return bool(wait_until(lambda: self.gate_state() == (0.0, 0.0), timeout_s, 0.1)[0])

    def gate_report(self) -> str:
        return f"{self.gate_state()} ({self.last_scrape}) {self.node_status()}"

    def node_status(self) -> dict | None:
        try:
            return httpx.get(f"{self.stack.express_url}/decode_status", timeout=2, trust_env=False).json()
        except (httpx.HTTPError, ValueError):
            return None

    def node_idle(self, timeout_s: float = 5.0) -> bool:
        return bool(wait_until(lambda: (self.node_status() or {}).get("state") == "idle", timeout_s, 0.1)[0])

    def node_ok_count(self) -> float:
        return metric(scrape(f"{self.stack.express_url}/metrics"), "expresslane_decode_requests_total",
                      status="ok") or 0.0

    def connector(self):
        return scrape(f"{self.stack.connector_metrics_url}/metrics")

    def staging_in_use(self) -> float | None:
        """Staging slots held on the prefill (the connector's gauge; older builds only export `free`), read from
        the prefill's own /metrics (vLLM's API server, what Prometheus scrapes), not the worker's side port, which
        shares its process (and GIL) with the worker's busy polling loop."""
        m = scrape(f"{self.stack.prefill_url}/metrics")
        in_use = metric(m, "expresslane_connector_staging_slots_in_use")
        free = metric(m, "expresslane_connector_staging_slots_free")
        if in_use is not None:
            if free is not None:
                self.staging_total = in_use + free
            return in_use
        if free is None:
            return None
        if self.staging_total is None or free > self.staging_total:
            self.staging_total = free
        return self.staging_total - free

    def send_failures(self, reason: str) -> float:
        """The connector's failed sends for `reason`, from the prefill's /metrics (a counter: 0 until the first)."""
        return metric(scrape(f"{self.stack.prefill_url}/metrics"), "expresslane_connector_send_failures_total",
                      reason=reason) or 0.0

    def claimed(self) -> float:
        return metric(self.connector(), "expresslane_connector_claimed_requests_total") or 0.0

    def staging_copies(self) -> float:
        return metric(self.connector(), "expresslane_connector_staging_copies_total") or 0.0

    # ---- service control -----------------------------------------------------------------------
    def express_max_len(self) -> int | None:
        try:
            return httpx.get(f"{self.stack.express_url}/capabilities", timeout=2, trust_env=False).json().get(
                "max_seq_len")
        except (httpx.HTTPError, ValueError):
            return None

    def ensure_express(self, max_len: int | None = None) -> None:
        """The express node runs healthy with MAX_MODEL_LEN=max_len (None: the stack's own)."""
        want = max_len or int(self.stack.env().get("MAX_MODEL_LEN", "4096"))
        if self.stack.pid("decode-express") is not None:
            self.stack.resume("decode-express")  # harmless when it runs
        if self.express_max_len() != want:
            self.restart_express(max_len)
        if self.healthy("express", self.express_node) is not None:  # routers without health gauges: no wait
            self.wait_health("express", self.express_node, 1.0, READMIT_S)

    def restart_express(self, max_len: int | None = None) -> float:
        env = dict(RESTART_ENV, **({"MAX_MODEL_LEN": str(max_len)} if max_len else {}))
        return self.stack.restart("decode-express", env=env)

    def ensure_all(self) -> None:
        down = [n for n in ("prefill", "decode-native") if self.stack.status()[n] != "healthy"]
        for n in down:
            if self.stack.pid(n) is not None:
                self.stack.kill(n)
            self.stack.restart(n, wait=False)
        if down:
            self.stack.wait_healthy(tuple(down), timeout_s=600)
        self.ensure_express()

    def aftermath(self, c: Checks, lane: str = "express") -> None:
        """Shared checks after a fault of the express node once it is back: gate free, staging free."""
        c(self.gate_free(), f"gate free (inflight, queue_depth) = {self.gate_state()}")
        in_use, waited = wait_until(lambda: self.staging_in_use() == 0, 10, 0.2)
        c(in_use, f"no staging slot held on the prefill (in use now: {self.staging_in_use()}, waited {waited:.1f}s)")

    def next_served_by_express(self, c: Checks, n: int = 2, bound_s: float = NORMAL_S) -> None:
        ok0 = self.node_ok_count()
        for i in range(n):
            p = token_prompt(30 + i, salt=900 + i)
            o = run(self.send(REJECT, p, bound_s=bound_s, stream=bool(i % 2)))
            c(o.ok and o.text == self.ref(p) and o.elapsed_s < bound_s,
              f"next express request {i} served, exact, < {bound_s:g}s: {o.describe()}")
        c(self.node_ok_count() - ok0 == n, f"... by the express node ({self.node_ok_count() - ok0:g} of {n})")


ROUTER_YAML = """
listen: {{host: 127.0.0.1, port: @PORT@}}
prefill: {{url: "{prefill}", model: tiny-llama}}
tokenizer_dir: "{model_dir}"
max_model_len: 4096
pools:
  native: {{kind: native, nodes: ["{native}"]}}
  express:
    kind: expresslane
    nodes: [{{url: "{express}", ctrl_host: 127.0.0.1, ctrl_port: {ctrl}}}]
    queue: {{max_waiting: 8, max_wait_s: 30, when_full: reject, retry_after_s: 1}}
aliases:
  tiny-llama: {{pool: native}}
  x-spill: {{pool: express, queue: {{max_waiting: 8, max_wait_s: 30, when_full: spill, spill_to: native}}}}
  x-reject: {{pool: express, queue: {{max_waiting: 8, max_wait_s: 30, when_full: reject, retry_after_s: 1}}}}
"""


@pytest.fixture(scope="module")
def faults(live_stack, tmp_path_factory):
    s = live_stack
    router = RouterProcess(ROUTER_YAML.format(prefill=s.prefill_url, model_dir=s.model_dir, native=s.native_url,
                                              express=s.express_url, ctrl=s.ports["EXPRESS_CTRL_PORT"]),
                           tmp_path_factory.mktemp("fault-router")).start()
    f = Faults(s, router)
    f.staging_in_use()  # learn the slot count while nothing is in flight
    try:
        yield f
    finally:
        try:
            f.ensure_all()  # the modules after this one get a healthy stack
        finally:
            router.stop()


@pytest.fixture(autouse=True)
def logs_on_failure(faults, request):
    """A failed fault test prints what every process logged while it ran (the router, both vLLM servers, the
    express node): under CI's load a timing bound can miss, and the logs are the only account of where the
    time went (pytest keeps just three basetemps)."""
    # the router's log first: it names every leg's failure and when; a CI summary that keeps only the head and the
    # tail of a long report then still has it
    logs = [faults.router.workdir / "router.log"] + sorted(faults.stack.state_dir.glob("*.log"))
    start = {p: p.stat().st_size if p.exists() else 0 for p in logs}
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is None or not rep.failed:
        return
    for p in logs:
        if not p.exists():
            continue
        with open(p, "rb") as fh:
            fh.seek(start[p])
            lines = fh.read().decode(errors="replace").splitlines()
        # (the router's own /metrics lines stay: its access log times each, and a check that reads its gauges
        # once saw no answer for 10 s)
        lines = [ln for ln in lines if "GET /health" not in ln
                 and ("GET /metrics" not in ln or p.name == "router.log")]
        print(f"\n===== {p.parent.name}/{p.name} while the test ran ({len(lines)} lines, last 150) =====")
        print("\n".join(lines[-150:]))


def _baseline(f: Faults, c: Checks) -> None:
    f.ensure_all()
    c(f.gate_free() and f.node_idle(), f"baseline: gate free, node idle ({f.node_status()})")


# ---- the fault matrix ----------------------------------------------------------------------------------------
def test_express_node_sigkill_idle(faults):
    """SIGKILL of an idle express node: requests spill (x-spill) or get a typed 503 + Retry-After (x-reject)
    at once, no prefill is spent for the dead node, it is ejected, and re-admitted when it is back."""
    f, c = faults, Checks("express SIGKILL idle")
    _baseline(f, c)
    prompts = [token_prompt(20 + i, salt=100 + i) for i in range(3)]
    refs = [f.ref(p) for p in prompts]
    claimed0 = f.claimed()
    try:
        f.stack.kill("decode-express")
        t_kill = time.monotonic()
        for i, p in enumerate(prompts):
            o = run(f.send(SPILL, p, stream=i == 1))
            c(o.ok and o.text == refs[i], f"x-spill request {i} after the kill spilled, exact: {o.describe()}")
        o = run(f.send(REJECT, prompts[0], bound_s=FAST_S + 3))
        c(o.status == 503 and o.typed_error and o.retry_after is not None and o.elapsed_s < FAST_S,
          f"x-reject: typed 503 + Retry-After < {FAST_S}s: {o.describe()}")
        c(f.claimed() == claimed0, f"no prefill spent for the dead node (claimed +{f.claimed() - claimed0:g})")
        waited = f.wait_health("express", f.express_node, 0.0, DETECT_S)
        c(waited is not None, f"node ejected (upstream_healthy 0) within {DETECT_S}s of the kill "
          f"(seen {time.monotonic() - t_kill:.1f}s after it)" if waited is not None else
          f"node ejected: upstream_healthy = {f.healthy('express', f.express_node)}")
        c(f.ready_says(f.stack.express_url) is False, f"/ready says the node is down ({f.ready_says(f.stack.express_url)})")
        f.aftermath(c)
        up = f.restart_express()
        c.note(f"node restarted, healthy after {up:.1f}s")
        back = f.wait_health("express", f.express_node, 1.0, READMIT_S)
        c(back is not None, f"re-admitted within {READMIT_S}s of /health ok (after {back}s)")
        c(f.ready_says(f.stack.express_url) is True, "/ready says the node is up")
        f.next_served_by_express(c)
    finally:
        f.ensure_express()
    c.done()


def test_express_node_sigkill_during_handoff(faults):
    """SIGKILL of the express node while its KV is on the way. The window between admit and the end of the
    write lasts milliseconds here, so it is held open with a second signal: the node is SIGSTOPped as soon as
    the router holds it for a 3500-token prompt (7 chunked prefill steps), before the KV is staged, so
    the prefill's sender then hangs in its control-plane exchange with a node whose kernel accepts TCP but
    whose process answers nothing, and the router's decode leg (or reservation) waits on it; the node is
    SIGKILLed 0.3 s after the prefill copied the KV into staging. Before the first token this is a spill: one
    complete answer equal to the reference, and the staging slot comes back."""
    f, c = faults, Checks("express SIGKILL during the handoff")
    _baseline(f, c)
    prompt = token_prompt(3500, salt=11)
    want = f.ref(prompt, 64)
    seen: dict[str, float] = {}
    claimed0, copies0 = f.claimed(), f.staging_copies()

    def inject() -> None:
        t0 = time.monotonic()
        # The router's lease on the node (taken, and the node reserved, before the prefill is sent) or the
        # connector's claim, whichever shows first: the claim alone became visible only after the staging copy
        # (seen 14:59), too late to stop the node before its KV was on the way.
        got, _ = wait_until(lambda: f.gate_state()[0] == 1.0 or f.claimed() > claimed0, 30, 0.002)
        f.stack.pause("decode-express")
        seen["paused_s"] = time.monotonic() - t0
        seen["paused_while_prefill_ran"] = float(bool(got) and f.staging_copies() == copies0)
        wait_until(lambda: f.staging_copies() > copies0, 30, 0.01)
        time.sleep(0.3)
        seen["killed_at"] = time.monotonic()
        f.stack.kill("decode-express")

    async def both() -> Outcome:
        o, _ = await asyncio.gather(f.send(SPILL, prompt, 64, stream=True, bound_s=STREAM_S),
                                    asyncio.to_thread(inject))
        return o

    try:
        o = run(both())
        after_kill = time.monotonic() - seen.get("killed_at", time.monotonic())
        # Whether the pause landed before the KV was staged depends on the machine's load (in a loaded CI run
        # the prefill had staged it 0.2 s after the request): reported, not asserted. Either way the node dies
        # around the handoff and every check below must hold.
        print(f"[handoff window] node paused {seen.get('paused_s', -1):.3f}s after the request, "
              f"{'before' if seen.get('paused_while_prefill_ran') else 'after'} its KV was staged; "
              "killed 0.3 s after the KV was staged")
        c(o.ok and o.text == want, f"one complete stream equal to the reference: {o.describe()}")
        c(o.ok and after_kill < SERVE_S, f"answered within {SERVE_S}s of the kill (answer came "
          f"{o.elapsed_s - (seen.get('paused_s', 0))}s after the pause)")
        c(f.wait_health("express", f.express_node, 0.0, DETECT_S) is not None, "node ejected")
        f.aftermath(c)
        f.restart_express()
        c(f.wait_health("express", f.express_node, 1.0, READMIT_S) is not None, "re-admitted")
        f.next_served_by_express(c)
    finally:
        f.ensure_express()
    c.done()


def test_express_node_sigkill_mid_stream_fails_over_exactly(faults):
    """SIGKILL mid-decode while streaming: with mid-stream failover (the router's default) the client sees one
    unbroken stream that equals the single-server reference."""
    f, c = faults, Checks("express SIGKILL mid-stream")
    _baseline(f, c)
    prompt = token_prompt(40, salt=12)
    want = f.ref(prompt, LONG)
    seen: dict[str, float] = {}

    def on_chunk(n: int) -> None:
        if n == 20:
            seen["killed_at"] = time.monotonic()
            f.stack.kill("decode-express")

    try:
        o = run(f.send(SPILL, prompt, LONG, stream=True, bound_s=STREAM_S, on_chunk=on_chunk))
        c("killed_at" in seen, "node killed after 20 streamed chunks")
        c(o.ok and o.done and o.text == want,
          f"one complete stream equal to the reference (len {len(want)}): {o.describe()}")
        c(f.wait_health("express", f.express_node, 0.0, DETECT_S) is not None, "node ejected")
        f.aftermath(c)
        f.restart_express()
        c(f.wait_health("express", f.express_node, 1.0, READMIT_S) is not None, "re-admitted")
        f.next_served_by_express(c)
    finally:
        f.ensure_express()
    c.done()


def test_express_node_sigkill_with_every_seat_decoding_fails_each_over_exactly(faults):
    """SIGKILL while the node decodes a user in every seat (its /decode_status seats, streams in one forward a
    step): every user's stream continues on the native lane and equals its single-server reference; none is
    lost or cut."""
    f, c = faults, Checks("express SIGKILL with every seat decoding")
    _baseline(f, c)
    seats = httpx.get(f"{f.stack.express_url}/decode_status", timeout=5, trust_env=False).json().get("seats", 1)
    prompts = [token_prompt(40 + 31 * i, salt=90 + i) for i in range(seats)]
    wants = [f.ref(p, LONG) for p in prompts]
    seen: dict[str, float] = {}

    def on_chunk(n: int) -> None:
        if n == 20 and "killed_at" not in seen:
            seen["killed_at"] = time.monotonic()
            f.stack.kill("decode-express")

    async def all_users() -> list[Outcome]:
        return await asyncio.gather(*(f.send(SPILL, p, LONG, stream=True, bound_s=STREAM_S,
                                             on_chunk=on_chunk if i == 0 else None)
                                      for i, p in enumerate(prompts)))

    try:
        outs = run(all_users())
        c("killed_at" in seen, f"node killed after 20 streamed chunks of the first of {seats} users")
        for i, (o, want) in enumerate(zip(outs, wants)):
            c(o.ok and o.done and o.text == want, f"user {i}: one complete stream equal to the reference "
              f"(len {len(want)}): {o.describe()}")
        c(f.wait_health("express", f.express_node, 0.0, DETECT_S) is not None, "node ejected")
        f.aftermath(c)
        f.restart_express()
        c(f.wait_health("express", f.express_node, 1.0, READMIT_S) is not None, "re-admitted")
        f.next_served_by_express(c)
    finally:
        f.ensure_express()
    c.done()


def test_express_node_partition_mid_stream_then_sigcont(faults):
    """SIGSTOP of the express node mid-stream (a partition: the socket stays open, nothing answers): the
    stream fails over after the stall timeout and completes exactly; the node is ejected; after SIGCONT the
    node frees its slot by itself, is re-admitted and serves again."""
    f, c = faults, Checks("express SIGSTOP mid-stream, then SIGCONT")
    _baseline(f, c)
    prompt = token_prompt(40, salt=13)
    want = f.ref(prompt, LONG)
    seen: dict[str, float] = {}

    def on_chunk(n: int) -> None:
        if n == 20:
            seen["paused_at"] = time.monotonic()
            f.stack.pause("decode-express")

    try:
        o = run(f.send(SPILL, prompt, LONG, stream=True, bound_s=STREAM_S, on_chunk=on_chunk))
        c(o.ok and o.done and o.text == want,
          f"one complete stream equal to the reference within {STREAM_S}s: {o.describe()}")
        c(f.wait_health("express", f.express_node, 0.0, DETECT_S) is not None,
          f"paused node ejected (upstream_healthy = {f.healthy('express', f.express_node)})")
        c(f.gate_free(), f"gate free while the node is stopped: {f.gate_state()}")
        f.stack.resume("decode-express")
        idle, waited = wait_until(lambda: (f.node_status() or {}).get("state") == "idle", 15, 0.1)
        c(idle, f"after SIGCONT the node frees its slot by itself within 15s ({f.node_status()}, {waited:.1f}s)")
        c(f.wait_health("express", f.express_node, 1.0, READMIT_S) is not None, "re-admitted after SIGCONT")
        f.aftermath(c)
        f.next_served_by_express(c)
    finally:
        f.ensure_express()
    c.done()


def test_native_decode_sigkill_then_prefill_sigkill_and_restart(faults):
    """Native decode SIGKILL: a native stream in flight ends with a typed error event (never a silent
    truncation), new native requests get a typed 503 at once, the node is ejected, the express lane keeps
    serving. Then prefill SIGKILL (one express request in its prefill leg): typed errors at once on both
    lanes. Both restarted: re-admitted, both lanes serve exact answers, no staging slot held."""
    f, c = faults, Checks("native SIGKILL, prefill SIGKILL, restart")
    _baseline(f, c)
    p_native, p_short, p_long = token_prompt(40, salt=14), token_prompt(25, salt=15), token_prompt(1500, salt=16)
    want_short = f.ref(p_short)
    want_native = f.ref(p_native, SHORT)
    seen: dict[str, float] = {}

    def on_chunk(n: int) -> None:
        if n == 10:
            seen["killed_at"] = time.monotonic()
            f.stack.kill("decode-native")

    try:
        o = run(f.send(NATIVE, p_native, LONG, stream=True, bound_s=STREAM_S, on_chunk=on_chunk))
        surfaced = time.monotonic() - seen.get("killed_at", 0.0)
        c(o.typed_error and o.done and not o.ok and o.error_type != "truncated",
          f"native stream cut by the kill: typed error event + [DONE]: {o.describe()}")
        c(surfaced < FAST_S + 1, f"... within {FAST_S + 1}s of the kill ({surfaced:.2f}s)")
        o = run(f.send(NATIVE, p_native, bound_s=FAST_S + 3))
        c(o.status == 503 and o.typed_error and o.elapsed_s < FAST_S,
          f"native request with the only native node dead: typed 503 < {FAST_S}s: {o.describe()}")
        c(f.wait_health("native", f.native_node, 0.0, DETECT_S) is not None, "native node ejected")
        o = run(f.send(REJECT, p_short))
        c(o.ok and o.text == want_short, f"express lane unaffected: {o.describe()}")

        async def prefill_kill() -> Outcome:
            # The prefill is stopped first, so the leg cannot finish before the kill lands: killed the moment
            # the router counts its leg in flight, it dies with the request unanswered (a kill timed off the
            # prefill's own running gauge could land after a 1,500-token prefill had already handed off).
            f.stack.pause("prefill")

            async def kill_when_sent() -> None:
                await asyncio.to_thread(wait_until, lambda: (metric(
                    f.router_metrics(), "expresslane_router_prefill_inflight") or 0) >= 1, 20, 0.005)
                seen["prefill_killed_at"] = time.monotonic()
                await asyncio.to_thread(f.stack.kill, "prefill")
            o, _ = await asyncio.gather(f.send(REJECT, p_long, bound_s=SERVE_S), kill_when_sent())
            return o

        o = run(prefill_kill())
        since = time.monotonic() - seen.get("prefill_killed_at", time.monotonic())
        c(o.typed_error and o.status is not None and o.status >= 500,
          f"express request whose prefill died: typed 5xx: {o.describe()} (now {since:.1f}s after the kill)")
        for alias in (REJECT, SPILL, NATIVE):
            o = run(f.send(alias, p_short, bound_s=FAST_S + 3))
            c(o.typed_error and o.status in (502, 503) and o.elapsed_s < FAST_S,
              f"{alias} with the prefill dead: typed 502/503 < {FAST_S}s: {o.describe()}")
        c(f.wait_health("prefill", f.stack.prefill_url.split("://", 1)[1], 0.0, DETECT_S) is not None,
          "prefill ejected")
        c(f.gate_free(), f"gate free: {f.gate_state()}")
        t0 = time.monotonic()
        f.stack.restart("prefill", wait=False)
        f.stack.restart("decode-native", wait=False)
        f.stack.wait_healthy(("prefill", "decode-native"), timeout_s=600)
        c.note(f"prefill and native decode restarted together, healthy after {time.monotonic() - t0:.0f}s")
        c(f.wait_health("prefill", f.stack.prefill_url.split("://", 1)[1], 1.0, READMIT_S) is not None,
          "prefill re-admitted")
        c(f.wait_health("native", f.native_node, 1.0, READMIT_S) is not None, "native node re-admitted")
        o = run(f.send(NATIVE, p_native, SHORT, stream=True))
        c(o.ok and o.text == want_native, f"native served again, exact: {o.describe()}")
        f.aftermath(c)
        f.next_served_by_express(c)
    finally:
        f.ensure_all()
    c.done()


# ---- orphans -------------------------------------------------------------------------------------------------
def test_disconnects_between_prefill_and_decode_leave_no_orphan(faults):
    """Client disconnects at several points between the prefill and the decode (the reported 0.25-0.3 s
    included), a forced node 504, and KV shipped for a rid nobody decodes; after each stage one express request
    must be served in normal time (so a failure names its cause), and at the end 5 express requests all succeed
    in normal time on the express node (x-reject: a stuck node would show, not spill away)."""
    f, c = faults, Checks("orphans")
    _baseline(f, c)
    prompt = token_prompt(900, salt=17)

    def probe(stage: str, salt: int) -> None:
        p = token_prompt(30, salt=salt)
        o = run(f.send(REJECT, p, bound_s=NORMAL_S))
        c(o.ok and o.text == f.ref(p), f"after {stage}: an express request served in < {NORMAL_S}s: {o.describe()}")

    for d in (0.05, 0.15, 0.25, 0.28, 0.3, 0.4, 0.6):
        o = run(f.send(REJECT, prompt, 64, stream=True, disconnect_after_s=d, bound_s=30))
        c.note(f"disconnect at {d:.2f}s: {o.describe()}")
    probe("the disconnects", 310)
    # A forced 504 on the node: a rid whose KV never comes, with a short KV wait (reserved first where the
    # node has /pd/reserve).
    rid = uuid.uuid4().hex
    with httpx.Client(base_url=f.stack.express_url, timeout=10, trust_env=False) as h:
        rr = h.post("/pd/reserve", json={"rid": rid, "ttl_s": 5})
        t0 = time.monotonic()
        r = h.post("/pd/decode", json={"rid": rid, "first_token_id": 1, "max_tokens": 4, "stream": False,
                                       "sampling": {"temperature": 0}, "timeout_s": 0.5})
        c(r.status_code == 504 and time.monotonic() - t0 < 3,
          f"forced node 504 (reserve answered {rr.status_code}): {r.status_code} {r.text[:120]} "
          f"in {time.monotonic() - t0:.2f}s")
    probe("the node 504", 311)
    # KV shipped to the node for a rid nobody will decode (a router that died after the prefill).
    stray = uuid.uuid4().hex
    r = httpx.post(f"{f.stack.prefill_url}/v1/completions", timeout=60, trust_env=False, json={
        "model": "tiny-llama", "prompt": token_prompt(300, salt=18), "max_tokens": 1,
        "kv_transfer_params": {"expresslane_host": "127.0.0.1",
                               "expresslane_ctrl_port": f.stack.ports["EXPRESS_CTRL_PORT"],
                               "expresslane_rid": stray}})
    c.note(f"stray KV for an unknown rid: prefill {r.status_code}, {r.json().get('kv_transfer_params')}")
    probe("KV for an unknown rid", 312)
    c(f.gate_free(), f"gate free after the disconnects: {f.gate_state()}")
    ok0 = f.node_ok_count()
    for i in range(5):
        p = token_prompt(30 + i, salt=300 + i)
        o = run(f.send(REJECT, p, bound_s=NORMAL_S, stream=bool(i % 2)))
        c(o.ok and o.text == f.ref(p), f"express request {i} after the orphans, < {NORMAL_S}s: {o.describe()}")
    c(f.node_ok_count() - ok0 == 5, f"all 5 served by the express node ({f.node_ok_count() - ok0:g})")
    f.aftermath(c)
    c.done()


def test_harness_sees_a_sigkill_as_a_failure(faults):
    """The harness itself can fail: a request whose express node is SIGKILLed under it, sent straight to
    the node, is not recorded as a success."""
    f = faults
    f.ensure_express()
    rid = uuid.uuid4().hex

    httpx.post(f"{f.stack.express_url}/pd/reserve", json={"rid": rid, "ttl_s": 30}, timeout=5, trust_env=False)

    async def direct() -> Outcome:
        return await request(f.stack.express_url, "/pd/decode", {
            "rid": rid, "first_token_id": 1, "max_tokens": 4, "sampling": {"temperature": 0}, "timeout_s": 30},
            bound_s=10, stream=False)

    async def both() -> Outcome:
        async def kill() -> None:
            await asyncio.sleep(0.5)
            await asyncio.to_thread(f.stack.send_signal, "decode-express", signal.SIGKILL)
        o, _ = await asyncio.gather(direct(), kill())
        return o

    o = run(both())
    f.stack.kill("decode-express") if f.stack.pid("decode-express") else None  # reap it; the next test restarts
    assert not o.ok and (o.error_type == "transport" or o.lost), o.describe()


# ---- prefill-side failures surface at once ---------------------------------------------------------------------
def _prefill_time(f: Faults, prompt: list[int]) -> float:
    t0 = time.monotonic()
    r = httpx.post(f"{f.stack.prefill_url}/v1/completions", timeout=120, trust_env=False,
                   json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


def test_prompt_too_long_for_the_node_fails_fast(faults):
    """The node restarted with MAX_MODEL_LEN=1024 (the prefill keeps 4096): a 1500-token express prompt is a
    prefill-side failure (`too_long`), and the client knows within PREFILL_FAIL_S of the prefill: a typed error
    on x-reject, a complete native answer on x-spill."""
    f, c = faults, Checks("too long for the node")
    _baseline(f, c)
    prompt = token_prompt(1500, salt=19)
    want = f.ref(prompt)
    try:
        f.ensure_express(max_len=1024)
        c(f.express_max_len() == 1024, f"node runs with max_seq_len {f.express_max_len()}")
        t_pre = _prefill_time(f, prompt)
        o = run(f.send(REJECT, prompt, bound_s=t_pre + PREFILL_FAIL_S + 10))
        c(o.typed_error and o.elapsed_s < t_pre + PREFILL_FAIL_S,
          f"x-reject: typed error < prefill {t_pre:.2f}s + {PREFILL_FAIL_S}s: {o.describe()}")
        o = run(f.send(SPILL, prompt, bound_s=SERVE_S))
        c(o.ok and o.text == want, f"x-spill: served by the native lane, exact: {o.describe()}")
        c(f.node_idle(), f"node idle: {f.node_status()}")
        f.aftermath(c)
    finally:
        f.ensure_express()
    c.done()


def test_staging_exhausted_fails_fast_and_frees_every_slot(faults):
    """Every staging slot of the prefill held by sends to a control port that accepts and never answers (a
    hung peer, a real socket); an express request then finds no staging slot: the client knows within PREFILL_FAIL_S
    of the prefill, and the connector counts the failure as `no_staging_slot`. When the hung peer goes away every
    slot is freed (connector gauge).

    The hung peer holds a slot only for the sender's own timeouts (3 connects, each waiting io_timeout_s = 10 s
    for the challenge: ~31 s), so the express request goes out as soon as the fill's responses are in (each slot
    is taken inside its request's forward, before vLLM answers), and what proves the slots were full is read
    after it: the failure counter does not expire. A loaded 2-CPU CI runner once took 40 s to see a gauge that a
    wait before the request polled, and sent the request after the slots had been freed."""
    f, c = faults, Checks("staging exhausted")
    _baseline(f, c)
    hole = BlackHolePeer()
    prompt = token_prompt(200, salt=20)
    try:
        def stage_to_hole(i: int) -> int:
            return httpx.post(f"{f.stack.prefill_url}/v1/completions", timeout=60, trust_env=False, json={
                "model": "tiny-llama", "prompt": token_prompt(100 + i, salt=21 + i), "max_tokens": 1,
                "kv_transfer_params": {"expresslane_host": "127.0.0.1", "expresslane_ctrl_port": hole.port,
                                       "expresslane_rid": uuid.uuid4().hex}}).status_code

        # The pool's size from its own gauges (in use + free), an empty pool (an earlier test's sends done), the
        # prefill's time for this prompt; then exactly that many sends to the hole, all at once.
        total, _ = wait_until(lambda: f.staging_in_use() is not None and f.staging_total, 15, 0.1)
        c(bool(total), f"the connector exports its staging pool's size (in use + free): {f.staging_total}")
        idle, waited = wait_until(lambda: f.staging_in_use() == 0, 40, 0.2)
        c(idle, f"no staging slot in use before the fill ({waited:.1f}s)")
        t_pre = _prefill_time(f, prompt)
        no_slot0 = f.send_failures("no_staging_slot")
        t_fill = time.monotonic()
        with ThreadPoolExecutor(max(1, int(total or 0))) as pool:
            codes = list(pool.map(stage_to_hole, range(int(total or 0))))
        fill_s = time.monotonic() - t_fill
        o = run(f.send(REJECT, prompt, bound_s=t_pre + PREFILL_FAIL_S + 10))
        sent_after = time.monotonic() - t_fill - o.elapsed_s
        c(o.typed_error and o.elapsed_s < t_pre + PREFILL_FAIL_S,
          f"express request without a staging slot: typed error < prefill {t_pre:.2f}s + {PREFILL_FAIL_S}s "
          f"(the fill answered {codes} in {fill_s:.1f}s; the request went {sent_after:.1f}s after the fill "
          f"began): {o.describe()}")
        no_slot, waited = wait_until(lambda: f.send_failures("no_staging_slot") > no_slot0 and
                                     f.send_failures("no_staging_slot"), 30, 0.2)
        c(no_slot, f"the connector counted it as no_staging_slot ({no_slot0:g} -> "
                   f"{f.send_failures('no_staging_slot'):g}; {waited:.1f}s)")
        # (15 s: the router's gauge drops with the 503; what takes time on a loaded runner is the scrape. Once
        # two scrapes in a row here got no answer within 5 s each; the report says how long the last one took.)
        c(f.gate_free(15) and f.node_idle(), f"gate free, node idle: {f.gate_report()}")
    finally:
        hole.close()
    freed, waited = wait_until(lambda: f.staging_in_use() == 0, 30, 0.1)
    c(freed, f"every staging slot freed after the peer went away ({waited:.1f}s; in use {f.staging_in_use()})")
    f.next_served_by_express(c)
    c.done()
