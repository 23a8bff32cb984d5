"""An express pool from DNS (config `pools.<express>.dns`, discovery.py, the gate's add / remove): every address is
one node, told to the prefill as its control plane (address:ctrl_port); a node that leaves is drained (its request
finishes, no new reservation reaches it); a node that joins takes requests only once a health probe found it
healthy. Fake prefill and nodes behind httpx.MockTransport; the DNS answer is the test's (FakeDns)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from expresslane.router.config import ConfigError

from ._kit import NATIVE, PREFILL, make_config, parse_sse
from .test_discovery import FakeDns
from .test_router_express_lane import COMP, FakeNode

A, B = "http://10.0.0.1:5557", "http://10.0.0.2:5557"


def dns_config(**over):
    pools = {"native": {"kind": "native", "nodes": [NATIVE]},
             "express": {"kind": "expresslane", "busy_retries": 1,
                         "dns": {"name": "decode-express.svc", "port": 5557, "ctrl_port": 5556, "refresh_s": 60}}}
    return make_config(pools=pools, **over)


class DnsNodes(FakeNode):
    """The FakeNode's prefill and /pd/* contract on every address in `bases`; a decode on a base in `hold` waits
    for `release` before its done line."""

    def __init__(self, upstreams, tokenizer, bases):
        super().__init__(upstreams, tokenizer)
        self.release = asyncio.Event()
        self.hold: set[str] = set()
        for base in bases:
            upstreams.on(base, "/pd/reserve", self.reserve)
            upstreams.on(base, "/pd/decode", self.held_decode)
            upstreams.on(base, "/pd/cancel", self.cancel)

    async def held_decode(self, request, body):
        base = f"http://{request.url.host}:{request.url.port}"
        if base in self.hold:
            await self.release.wait()
        return await self.decode(request, body)


@pytest.fixture
def nodes(upstreams, tokenizer):
    return DnsNodes(upstreams, tokenizer, (A, B))


def reserves(upstreams, base):
    return upstreams.bodies(base, "/pd/reserve")


def test_an_express_pool_needs_nodes_or_dns_and_dns_needs_the_control_port():
    cfg = dns_config()
    assert cfg.pools["express"].nodes == [] and cfg.pools["express"].dns.ctrl_port == 5556
    node = cfg.pools["express"].dns_node(A)
    assert (node.url, node.ctrl_host, node.ctrl_port) == (A, "10.0.0.1", 5556)
    with pytest.raises(ConfigError, match="nodes .* or dns"):
        make_config(pools={"native": {"kind": "native", "nodes": [NATIVE]}, "express": {"kind": "expresslane"}})
    with pytest.raises(ConfigError, match="ctrl_port"):
        make_config(pools={"native": {"kind": "native", "nodes": [NATIVE]},
                           "express": {"kind": "expresslane", "dns": {"name": "x", "port": 5557}}})


async def test_every_address_is_a_node_and_the_prefill_is_told_its_control_plane(make_client, nodes, upstreams):
    dns = FakeDns(["10.0.0.2", "10.0.0.1"])
    async with make_client(dns_config(), resolver=dns) as (client, app):
        gate = app.state.lanes.express.gates["express"]
        assert sorted(n.url for n in gate.nodes) == [A, B]
        first, second = await asyncio.gather(*(client.post("/v1/completions", json=COMP) for _ in range(2)))
        metrics = (await client.get("/metrics")).text
    assert first.status_code == 200 and second.status_code == 200, (first.text, second.text)
    markers = sorted((b["kv_transfer_params"]["expresslane_host"], b["kv_transfer_params"]["expresslane_ctrl_port"])
                     for b in upstreams.bodies(PREFILL, "/v1/completions"))
    assert markers == [("10.0.0.1", 5556), ("10.0.0.2", 5556)]  # one request per node: both were used
    assert len(reserves(upstreams, A)) == 1 and len(reserves(upstreams, B)) == 1
    assert ("decode-express.svc", 5557) in dns.asked
    assert 'expresslane_router_pool_members{pool="express"} 2.0' in metrics


async def test_a_node_that_leaves_finishes_its_request_and_gets_no_new_one(make_client, nodes, upstreams):
    dns = FakeDns(["10.0.0.1"])
    nodes.hold.add(A)
    async with make_client(dns_config(), resolver=dns) as (client, app):
        gate = app.state.lanes.express.gates["express"]
        members = app.state.lanes.ctx.membership.pools["express"]
        held = asyncio.ensure_future(client.post("/v1/completions", json=dict(COMP, stream=True)))
        for _ in range(200):
            if upstreams.bodies(A, "/pd/decode"):
                break
            await asyncio.sleep(0.005)
        dns.answer = ["10.0.0.2"]  # A left the Service, B joined
        await members.refresh()
        assert [n.url for n in gate.nodes] == [B] and [n.url for n in gate.draining] == [A]
        other = await client.post("/v1/completions", json=COMP)  # served by B, never reserved on A
        nodes.release.set()
        r = await held
        metrics = (await client.get("/metrics")).text
        assert gate.draining == [] and [n.url for n in gate.nodes] == [B] and gate.busy_count == 0
        assert app.state.capabilities.cached_nodes == [B]  # A's answer went with A
    assert other.status_code == 200 and r.status_code == 200, (other.text, r.text)
    assert parse_sse(r.text)[-1] == "[DONE]"
    assert len(reserves(upstreams, A)) == 1 and len(reserves(upstreams, B)) == 1
    assert 'node="10.0.0.1:5557"' not in metrics  # the gone node's series are dropped


async def test_no_node_left_is_a_typed_503_not_a_queue(make_client, nodes, upstreams):
    dns = FakeDns(["10.0.0.1"])
    async with make_client(dns_config(), resolver=dns) as (client, app):
        dns.answer = []  # the Service has no ready pod
        await app.state.lanes.ctx.membership.pools["express"].refresh()
        r = await client.post("/v1/completions", json=COMP)  # tiny-x: reject, no spill
    assert r.status_code == 503 and r.json()["error"]["code"] == "express_lane_unavailable"
    assert "no node" in r.json()["error"]["message"] and r.headers["retry-after"]
    assert reserves(upstreams, A) == []


async def test_a_node_that_joins_takes_requests_only_after_a_healthy_probe(make_client, nodes, upstreams):
    dns = FakeDns(["10.0.0.1"])
    health = {A: 200, B: 503}
    ok = lambda r, b: httpx.Response(200, json={"status": "ok"})  # noqa: E731
    for base in (PREFILL, NATIVE):
        upstreams.on(base, "/health", ok)
    for base in (A, B):
        upstreams.on(base, "/health", lambda r, b, base=base: httpx.Response(health[base], json={"status": "x"}))
    # interval_s: no scheduled round during the test; rounds come from the joining node (and the test's own calls).
    # No panic routing: B, the pool's only member, would take traffic in a panic (tested in test_router_health.py)
    cfg = dns_config(health={"enabled": True, "interval_s": 60, "timeout_s": 0.5, "unhealthy_threshold": 1,
                             "healthy_threshold": 1, "healthy_panic_threshold": 0})
    async with make_client(cfg, resolver=dns) as (client, app):
        monitor, ctx = app.state.health, app.state.lanes.ctx
        dns.answer = ["10.0.0.2"]  # A leaves, B joins (its /health says 503: still loading)
        await ctx.membership.pools["express"].refresh()
        refused = await client.post("/v1/completions", json=COMP)
        assert not monitor.healthy(B)
        health[B] = 200
        await monitor.probe_all(ctx.calls)
        assert monitor.healthy(B)
        served = await client.post("/v1/completions", json=COMP)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "express_lane_unavailable"
    assert served.status_code == 200, served.text
    assert len(reserves(upstreams, B)) == 1  # only the request after the healthy probe reached it
