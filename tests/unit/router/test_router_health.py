"""Upstream health: the circuit breaker's states, probes against fake upstreams, /ready, the gate skipping
nodes that are down, and the health metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from expresslane.router.fleet.gate import NodeGate, NoHealthyNode
from expresslane.router.fleet.health import BreakerState, CircuitBreaker
from expresslane.router.resilience import HealthConfig

from ._kit import EXPRESS, NATIVE, PREFILL, make_config


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_after_threshold_then_half_open_then_closed():
    clock = Clock()
    b = CircuitBreaker(HealthConfig(unhealthy_threshold=2, open_s=3, healthy_threshold=2), clock)
    assert b.state is BreakerState.CLOSED and b.allows_traffic()
    assert not b.failure("probe_timeout")  # 1 of 2 probe failures
    assert b.state is BreakerState.CLOSED
    b.success()  # resets the count
    assert not b.failure("probe_timeout")
    assert b.failure("probe_timeout")  # 2 in a row: ejected
    assert b.state is BreakerState.OPEN and not b.allows_traffic() and b.reason == "probe_timeout"
    clock.t += 2.9
    assert b.state is BreakerState.OPEN
    clock.t += 0.2
    assert b.state is BreakerState.HALF_OPEN and not b.allows_traffic()  # probes decide, not traffic
    assert not b.success()
    assert b.success()  # healthy_threshold=2: re-admitted
    assert b.state is BreakerState.CLOSED and b.reason is None


def test_breaker_half_open_failure_reopens():
    clock = Clock()
    b = CircuitBreaker(HealthConfig(open_s=1, unhealthy_threshold=1), clock)
    assert b.failure("probe_connect")
    clock.t += 1
    assert b.state is BreakerState.HALF_OPEN
    assert b.failure("probe_connect")  # one failure in half-open: back to OPEN
    assert b.state is BreakerState.OPEN and b.opened_at == clock.t
    assert not b.failure("probe_connect")  # already open: no second ejection


def test_breaker_without_probes_lets_a_trial_request_through_in_half_open():
    clock = Clock()
    b = CircuitBreaker(HealthConfig(open_s=1, unhealthy_threshold=1), clock, trial_traffic=True)
    b.failure("probe_connect")
    assert not b.allows_traffic()
    clock.t += 1
    assert b.allows_traffic() and b.state is BreakerState.HALF_OPEN


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
                               "open_s": 0.05, **over})


async def test_probes_eject_and_readmit_and_ready_says_which_upstreams_are_up(make_client, upstreams):
    state = {"express": 200}
    ok = lambda request, body: httpx.Response(200, json={"status": "ok"})  # noqa: E731
    upstreams.on(PREFILL, "/health", ok)
    upstreams.on(NATIVE, "/health", ok)
    upstreams.on(EXPRESS, "/health", lambda r, b: httpx.Response(state["express"], json={"status": "x"}))
    async with make_client(_health_cfg()) as (client, app):
        health = app.state.health
        await wait_until(lambda: len([c for c in upstreams.calls if c[1] == "/health"]) >= 3)
        r = await client.get("/ready")
        assert r.status_code == 200 and all(u["healthy"] for u in r.json()["upstreams"].values())
        state["express"] = 503
        await wait_until(lambda: not health.healthy(EXPRESS))
        r = await client.get("/ready")
        assert r.status_code == 200  # prefill and the native node still serve
        ups = r.json()["upstreams"]
        assert ups[EXPRESS]["healthy"] is False and ups[EXPRESS]["reason"] == "probe_http_503"
        assert ups[EXPRESS]["state"] in ("open", "half_open")
        metrics = (await client.get("/metrics")).text
        assert 'expresslane_router_upstream_healthy{lane="express",node="express:5557",pool="express"} 0.0' in metrics
        assert ('expresslane_router_upstream_ejections_total{lane="express",node="express:5557",pool="express",'
                'reason="probe_http_503"}') in metrics
        assert not app.state.lanes.ctx.healthy(EXPRESS)
        state["express"] = 200
        await wait_until(lambda: health.healthy(EXPRESS))  # half-open, one good probe: re-admitted
        assert (await client.get("/health")).status_code == 200  # liveness never depends on upstreams


async def test_ready_is_503_while_the_prefill_is_down(make_client, upstreams):
    upstreams.on(NATIVE, "/health", lambda r, b: httpx.Response(200))
    upstreams.on(EXPRESS, "/health", lambda r, b: httpx.Response(200))
    upstreams.on(PREFILL, "/health", lambda r, b: (_ for _ in ()).throw(httpx.ConnectError("refused")))
    async with make_client(_health_cfg(open_s=10)) as (client, app):
        await wait_until(lambda: not app.state.health.healthy(PREFILL))
        r = await client.get("/ready")
        assert r.status_code == 503 and r.json()["status"] == "not_ready"
        assert r.json()["upstreams"][PREFILL]["reason"] == "probe_connect"
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "2"  # fast, typed, no prefill attempted
        assert not upstreams.bodies(PREFILL, "/v1/completions")


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
