"""Upstream health as Envoy models it (fleet/health.py): the active health checking state machine, a slow probe
judged by the request path's sign of life, probes that end ejections, panic routing, /ready, the gate skipping nodes
that do not take traffic, and the health metrics. Each behaviour of issue 42's "Health as Envoy models it" has a test
here or in test_router_outlier.py that fails without it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from expresslane.router.fleet.gate import NodeGate, NoHealthyNode
from expresslane.router.fleet.health import ActiveHealth, HealthMonitor, HealthState, ProbeResult
from expresslane.router.metrics import RouterMetrics
from expresslane.router.resilience import HealthConfig
from prometheus_client import CollectorRegistry

from ._kit import EXPRESS, NATIVE, PREFILL, make_config, sse_bytes

N2 = "http://native2:8100"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# ---- the active health checking state machine ------------------------------------------------------------

def test_unhealthy_after_the_threshold_of_failures_in_a_row_healthy_after_passes():
    h = ActiveHealth(HealthConfig(unhealthy_threshold=3, healthy_threshold=2))
    assert h.state is HealthState.HEALTHY and h.healthy
    assert not h.failed("probe_timeout") and not h.failed("probe_timeout")
    assert not h.passed()  # a pass breaks the run
    assert not h.failed("probe_timeout") and not h.failed("probe_timeout")
    assert h.failed("probe_connect")  # three in a row
    assert h.state is HealthState.UNHEALTHY and not h.healthy and h.reason == "probe_connect"
    assert not h.failed("probe_http_503") and h.reason == "probe_http_503"  # still unhealthy: the latest reason
    assert not h.passed()
    assert h.passed()  # healthy_threshold=2
    assert h.state is HealthState.HEALTHY and h.reason is None


def test_an_unhealthy_node_is_probed_back_without_any_open_period():
    """No breaker timer: the first passing probe after the failures (healthy_threshold 1) is enough, however soon."""
    h = ActiveHealth(HealthConfig(unhealthy_threshold=1))
    assert h.failed("probe_connect") and not h.healthy
    assert h.passed() and h.healthy


def test_unproven_members_wait_for_a_pass_and_probes_off_mean_healthy():
    h = ActiveHealth(HealthConfig(), proven=False)
    assert not h.healthy and h.reason == "not_probed_yet"
    assert h.passed() and h.healthy
    off = ActiveHealth(HealthConfig(enabled=False), proven=False)
    assert off.healthy and not off.failed("x") and off.healthy


def test_the_breakers_open_s_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="open_s is gone"):
        HealthConfig(open_s=3)


# ---- the monitor: probes, a second signal, ejections ended by probes, panic ---------------------------------

def monitor(clock: Clock | None = None, **over) -> tuple[HealthMonitor, Clock, CollectorRegistry]:
    clock = clock or Clock()
    cfg = make_config(**over)
    reg = CollectorRegistry()
    return HealthMonitor(cfg, RouterMetrics(cfg, reg), headers=lambda kind: {}, clock=clock), clock, reg


class ScriptedProbes:
    """OneShotCalls whose get_status answers per URL: a status, or an exception to raise."""

    def __init__(self, answers: dict[str, object]) -> None:
        self.answers = answers

    async def get_status(self, url, *, timeout, headers=None) -> int:
        a = self.answers[url.removesuffix("/health")]
        if isinstance(a, Exception):
            raise a
        return a  # type: ignore[return-value]


async def test_a_slow_probe_of_a_node_that_completes_legs_is_not_a_failure():
    """Issue 42: a busy prefill whose /health answered late was taken for a dead one. A probe that connected but got
    no answer in time counts against the node only when the request path saw no sign of life from it."""
    m, clock, reg = monitor(health={"enabled": True, "unhealthy_threshold": 1})
    probes = ScriptedProbes({PREFILL: httpx.ReadTimeout("slow"), NATIVE: 200, EXPRESS: 200})
    m.report_success(PREFILL)  # a prefill leg just completed there
    clock.t += 1.0
    await m.probe_all(probes)
    assert m.healthy(PREFILL)
    assert reg.get_sample_value("expresslane_router_health_probes_total",
                                {"lane": "prefill", "node": "prefill:8000", "result": "slow"}) == 1
    clock.t += 10.0  # no leg completed for longer than interval_s + timeout_s: the silence counts now
    await m.probe_all(probes)
    assert not m.healthy(PREFILL) and m.upstreams[PREFILL].health.reason == "probe_timeout"
    # a refused connection is never "slow"
    m2, clock2, _ = monitor(health={"enabled": True, "unhealthy_threshold": 1})
    m2.report_success(NATIVE)
    await m2.probe_all(ScriptedProbes({PREFILL: 200, NATIVE: httpx.ConnectError("refused"), EXPRESS: 200}))
    assert not m2.healthy(NATIVE) and m2.upstreams[NATIVE].health.reason == "probe_connect"


async def test_stream_lines_are_a_sign_of_life_but_passing_probes_alone_are_not_the_second_signal():
    m, clock, _ = monitor(health={"enabled": True, "unhealthy_threshold": 1})
    await m.probe_all(ScriptedProbes({PREFILL: 200, NATIVE: 200, EXPRESS: 200}))
    clock.t += 1.0
    m.report_alive(NATIVE)  # a line of a stream from it
    slow = ScriptedProbes({PREFILL: httpx.ReadTimeout("slow"), NATIVE: httpx.ReadTimeout("slow"), EXPRESS: 200})
    await m.probe_all(slow)
    assert m.healthy(NATIVE)  # its stream shows it works
    assert not m.healthy(PREFILL)  # only its own earlier probe passed: a paused process, say
    assert m.alive_within(NATIVE, 0.5) and not m.alive_within(PREFILL, 0.5)


async def test_a_passing_probe_ends_an_outlier_ejection():
    """Envoy's successful_active_health_check_uneject_host (its default): an ejected node that passes a probe serves
    again at once; with it off, the ejection runs its time."""
    two = {"native": {"kind": "native", "nodes": [NATIVE, N2]}}
    for uneject in (True, False):
        m, clock, reg = monitor(health={"enabled": True}, pools=two, aliases={"tiny": {"pool": "native"}},
                                outlier={"consecutive_gateway_failure": 1,
                                         "successful_active_health_check_uneject_host": uneject})
        m.report_failure(NATIVE, "connect", "refused")
        assert not m.routable("native", NATIVE)
        await m.probe_all(ScriptedProbes({PREFILL: 200, NATIVE: 200, N2: 200}))
        assert m.routable("native", NATIVE) is uneject
        if uneject:
            assert reg.get_sample_value("expresslane_router_outlier_decisions_total",
                                        {"pool": "native", "node": "native:8100", "decision": "readmit",
                                         "reason": "active_health_check"}) == 1


def test_panic_routes_to_every_member_when_too_few_are_healthy():
    """Issue 42 item 8: panic never sent to a node the probes called down, so a one-member pool could only refuse.
    Now a pool with fewer than healthy_panic_threshold % routable members routes to all of them."""
    m, _, reg = monitor(health={"enabled": True, "unhealthy_threshold": 1})
    m.probe_outcome(m.upstreams[PREFILL], ProbeResult.FAILED, "probe_timeout")
    assert not m.healthy(PREFILL) and not m.routable("prefill", PREFILL)
    assert m.panicking("prefill") and m.available("prefill", PREFILL)  # its only member still takes traffic
    assert reg.get_sample_value("expresslane_router_pool_panic", {"pool": "prefill"}) == 1
    assert reg.get_sample_value("expresslane_router_upstream_healthy",
                                {"lane": "prefill", "pool": "prefill", "node": "prefill:8000"}) == 0
    m.probe_outcome(m.upstreams[PREFILL], ProbeResult.PASSED)
    assert not m.panicking("prefill") and reg.get_sample_value("expresslane_router_pool_panic",
                                                               {"pool": "prefill"}) == 0
    # two members, one down: 50 % routable is not below the 50 % threshold: the down one gets nothing
    two = {"native": {"kind": "native", "nodes": [NATIVE, N2]}}
    m2, _, _ = monitor(health={"enabled": True, "unhealthy_threshold": 1}, pools=two,
                       aliases={"tiny": {"pool": "native"}})
    m2.probe_outcome(m2.upstreams[NATIVE], ProbeResult.FAILED, "probe_connect")
    assert not m2.available("native", NATIVE) and m2.available("native", N2)
    m2.probe_outcome(m2.upstreams[N2], ProbeResult.FAILED, "probe_connect")
    assert m2.available("native", NATIVE) and m2.available("native", N2)  # both down: both take traffic
    # an outlier ejection counts as not routable too, and a threshold of 0 turns panic off
    m3, _, _ = monitor(health={"enabled": True, "healthy_panic_threshold": 0, "unhealthy_threshold": 1})
    m3.probe_outcome(m3.upstreams[PREFILL], ProbeResult.FAILED, "probe_timeout")
    assert not m3.available("prefill", PREFILL)


def test_readiness_details_name_states_and_panic():
    m, _, _ = monitor(health={"enabled": True, "unhealthy_threshold": 1})
    m.probe_outcome(m.upstreams[EXPRESS], ProbeResult.FAILED, "probe_http_503")
    ready, body = m.readiness()
    assert ready and body["status"] == "ready" and body["panic"] == ["express"]
    assert body["upstreams"][EXPRESS] == {"lane": "express", "pools": ["express"], "state": "unhealthy",
                                          "healthy": False, "reason": "probe_http_503"}


# ---- the gate, probes against fake upstreams, /ready ----------------------------------------------------------

async def test_gate_skips_unavailable_nodes_and_fails_fast_when_none_is_up():
    up = {"a": True, "b": True}
    gate = NodeGate(["a", "b"], available=lambda n: up[n])
    up["a"] = False
    lease = await gate.acquire(max_waiting=4, max_wait_s=1)
    assert lease.node == "b"
    waiter = asyncio.ensure_future(gate.acquire(max_waiting=4, max_wait_s=5))
    await asyncio.sleep(0.01)
    up["a"] = True
    gate.poke()  # a came back: the waiter gets it at once
    got = await asyncio.wait_for(waiter, 1)
    assert got.node == "a"
    got.release()
    lease.release()
    up["a"] = up["b"] = False
    with pytest.raises(NoHealthyNode):
        await gate.acquire(max_waiting=4, max_wait_s=5)


async def test_waiters_fail_at_once_when_every_node_goes_down():
    up = {"a": True}
    gate = NodeGate(["a"], available=lambda n: up[n])
    lease = await gate.acquire(max_waiting=4, max_wait_s=1)
    waiter = asyncio.ensure_future(gate.acquire(max_waiting=4, max_wait_s=30))
    await asyncio.sleep(0.01)
    up["a"] = False
    gate.poke()
    with pytest.raises(NoHealthyNode):
        await asyncio.wait_for(waiter, 1)
    lease.release()
    assert gate.waiting == 0 and gate.busy_count == 0


async def wait_until(pred, timeout_s: float = 5.0) -> None:
    """Poll a condition (probes run in the background); fail with the timeout instead of hanging."""
    for _ in range(int(timeout_s / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


def _health_cfg(**over):
    return make_config(health={"enabled": True, "interval_s": 0.02, "timeout_s": 0.5, "unhealthy_threshold": 1,
                               **over})


async def test_probes_mark_unhealthy_and_healthy_and_ready_says_which_upstreams_are_up(make_client, upstreams):
    state = {"express": 200}
    ok = lambda request, body: httpx.Response(200, json={"status": "ok"})  # noqa: E731
    upstreams.on(PREFILL, "/health", ok)
    upstreams.on(NATIVE, "/health", ok)
    upstreams.on(EXPRESS, "/health", lambda r, b: httpx.Response(state["express"], json={"status": "x"}))
    async with make_client(_health_cfg()) as (client, app):
        health = app.state.health
        await wait_until(lambda: len([c for c in upstreams.calls if c[1] == "/health"]) >= 3)
        r = await client.get("/ready")  # (the test client is a loopback peer of a router without keys: details)
        assert r.status_code == 200 and r.json()["status"] == "ready"
        assert all(u["healthy"] for u in r.json()["upstreams"].values())
        state["express"] = 503
        await wait_until(lambda: not health.healthy(EXPRESS))
        assert (await client.get("/ready")).status_code == 200  # prefill and the native node still serve
        ups = health.readiness()[1]["upstreams"]
        assert ups[EXPRESS]["healthy"] is False and ups[EXPRESS]["reason"] == "probe_http_503"
        assert ups[EXPRESS]["state"] == "unhealthy"
        metrics = (await client.get("/metrics")).text
        assert 'expresslane_router_upstream_healthy{lane="express",node="express:5557",pool="express"} 0.0' in metrics
        assert ('expresslane_router_upstream_ejections_total{lane="express",node="express:5557",pool="express",'
                'reason="probe_http_503"}') in metrics
        assert not app.state.lanes.ctx.healthy(EXPRESS)
        state["express"] = 200
        await wait_until(lambda: health.healthy(EXPRESS))  # one passing probe: healthy again
        assert (await client.get("/health")).status_code == 200  # liveness never depends on upstreams


async def test_a_one_member_prefill_pool_that_fails_its_probes_still_serves(make_client, upstreams, tokenizer):
    """Issue 42: a busy prefill declared down was about 16 s of total refusal, as its pool's only member. With panic
    routing the request reaches it, and a prefill that answers serves it."""
    from .test_router_faults import _prefill_native

    _prefill_native(upstreams, [])
    upstreams.on(NATIVE, "/v1/completions", lambda r, b: httpx.Response(200, content=sse_bytes(
        {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]},
        "[DONE]")))
    upstreams.on(NATIVE, "/health", lambda r, b: httpx.Response(200))
    upstreams.on(EXPRESS, "/health", lambda r, b: httpx.Response(200))
    upstreams.on(PREFILL, "/health", lambda r, b: httpx.Response(503))  # its /health fails, its legs do not
    async with make_client(_health_cfg()) as (client, app):
        await wait_until(lambda: not app.state.health.healthy(PREFILL))
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                       "stream": True})
        assert (await client.get("/ready")).status_code == 503  # /ready tells the truth about the probes
    assert r.status_code == 200 and "ok" in r.text


async def test_ready_is_503_while_the_prefill_is_down(make_client, upstreams):
    upstreams.on(NATIVE, "/health", lambda r, b: httpx.Response(200))
    upstreams.on(EXPRESS, "/health", lambda r, b: httpx.Response(200))
    upstreams.on(PREFILL, "/health", lambda r, b: (_ for _ in ()).throw(httpx.ConnectError("refused")))
    async with make_client(_health_cfg(healthy_panic_threshold=0)) as (client, app):
        await wait_until(lambda: not app.state.health.healthy(PREFILL))
        r = await client.get("/ready")
        assert r.status_code == 503 and r.json()["status"] == "not_ready"
        assert r.json()["upstreams"][PREFILL]["reason"] == "probe_connect"
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "2"  # no panic: fast, typed, no prefill tried
        assert not upstreams.bodies(PREFILL, "/v1/completions")


async def test_ready_details_need_a_key(make_client, upstreams):
    """Least privilege: /ready without a key says ready or not; its details (every upstream's address and state)
    need a client API key, or, on a router without keys, a loopback peer."""
    from expresslane.router.server.secrets import RouterSecrets

    for base in (PREFILL, NATIVE, EXPRESS):
        upstreams.on(base, "/health", lambda r, b: httpx.Response(200))
    secrets = RouterSecrets(api_keys_text="sk-ops-0123456789 name=ops\n")
    async with make_client(_health_cfg(), secrets=secrets) as (client, app):
        await wait_until(lambda: len([c for c in upstreams.calls if c[1] == "/health"]) >= 3)
        bare = (await client.get("/ready")).json()
        wrong = (await client.get("/ready", headers={"authorization": "Bearer nope"})).json()
        keyed = (await client.get("/ready", headers={"authorization": "Bearer sk-ops-0123456789"})).json()
    assert bare == wrong == {"status": "ready"}
    assert set(keyed["upstreams"]) == {PREFILL, NATIVE, EXPRESS}
    # no keys: a loopback peer sees the details, anyone else the status
    async with make_client(_health_cfg()) as (_, app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as local:
            await wait_until(lambda: len([c for c in upstreams.calls if c[1] == "/health"]) >= 6)
            assert "upstreams" in (await local.get("/ready")).json()
        transport = httpx.ASGITransport(app=app, client=("172.18.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as remote:
            assert (await remote.get("/ready")).json() == {"status": "ready"}


async def test_probes_send_the_upstream_auth_headers(make_client, upstreams):
    from expresslane.router.server.secrets import RouterSecrets

    seen = {}

    def rec(request, body):
        seen[f"{request.url.host}"] = request.headers.get("authorization")
        return httpx.Response(200)

    for base in (PREFILL, NATIVE, EXPRESS):
        upstreams.on(base, "/health", rec)
    secrets = RouterSecrets(vllm_api_key="vk", express_node_token="et")
    async with make_client(_health_cfg(), secrets=secrets) as (client, _):
        await wait_until(lambda: len(seen) == 3)
    assert seen == {"prefill": "Bearer vk", "native": "Bearer vk", "express": "Bearer et"}
