"""Pool membership from DNS (discovery.py): the real getaddrinfo path, answers that change, a resolver failure that
keeps the last answer, and the app probing and routing to members that appear and leave without a restart."""

from __future__ import annotations

import asyncio
import socket

import pytest
from prometheus_client import CollectorRegistry

from expresslane.router.config import DnsMembers
from expresslane.router.metrics import RouterMetrics
from expresslane.router.fleet.discovery import (PREFILL_POOL, DnsState, Membership, PoolMembers, member_url,
                                          resolve_addresses)

from ._kit import NATIVE, PREFILL, make_config
from .test_router_native_lane import decode_reply, prefill_reply


class FakeDns:
    """A resolver whose answer the test sets: a list of addresses, or an exception to raise."""

    def __init__(self, answer):
        self.answer = answer
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return list(self.answer)


def members(dns: FakeDns, static=(), changes=None) -> PoolMembers:
    changes = [] if changes is None else changes
    return PoolMembers("p", static, DnsMembers(name="pool.svc", port=8100, refresh_s=0.05), resolver=dns,
                       on_change=lambda added, removed: changes.append((added, removed)))


async def test_the_real_resolver_answers_localhost_and_nothing_for_an_unknown_name():
    assert "127.0.0.1" in await resolve_addresses("localhost", 80)
    assert await resolve_addresses("no-such-host.invalid", 80) == []


def test_member_urls_bracket_ipv6():
    assert member_url("http", "10.1.2.3", 8000) == "http://10.1.2.3:8000"
    assert member_url("https", "fd00::1", 8000) == "https://[fd00::1]:8000"


async def test_every_a_record_is_a_member_and_changes_are_reported():
    dns, changes = FakeDns(["10.0.0.2", "10.0.0.1", "10.0.0.2"]), []
    m = members(dns, static=["http://static:8100"], changes=changes)
    assert m.urls() == ["http://static:8100"] and m.state is DnsState.UNRESOLVED
    assert await m.refresh() is DnsState.RESOLVED
    assert m.urls() == ["http://static:8100", "http://10.0.0.1:8100", "http://10.0.0.2:8100"]
    dns.answer = ["10.0.0.2", "10.0.0.3"]
    await m.refresh()
    assert m.urls() == ["http://static:8100", "http://10.0.0.2:8100", "http://10.0.0.3:8100"]
    assert changes[-1] == (["http://10.0.0.3:8100"], ["http://10.0.0.1:8100"])
    dns.answer = []  # no ready pod behind a headless Service: the pool is that empty
    assert await m.refresh() is DnsState.EMPTY and m.urls() == ["http://static:8100"]
    assert dns.asked[0] == ("pool.svc", 8100)


async def test_a_resolver_failure_keeps_the_last_answer_and_counts():
    from prometheus_client import Counter

    failures = Counter("f", "f", ["pool"], registry=CollectorRegistry())
    dns = FakeDns(["10.0.0.1"])
    m = PoolMembers("p", (), DnsMembers(name="pool.svc", port=8100), resolver=dns, on_change=lambda a, r: None,
                    failures=failures)
    await m.refresh()
    dns.answer = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    assert await m.refresh() is DnsState.FAILED
    assert m.urls() == ["http://10.0.0.1:8100"]
    assert failures.labels("p")._value.get() == 1


async def test_membership_re_resolves_in_the_background():
    dns = FakeDns(["10.0.0.1"])
    cfg = make_config(prefill={"model": "served",
                               "dns": {"name": "prefill.svc", "port": 8000, "refresh_s": 0.05}})
    ms = Membership(cfg, RouterMetrics(cfg, CollectorRegistry()), resolver=dns)
    seen = []
    ms.on_change(lambda pool, added, removed: seen.append((pool, added, removed)))
    async with ms.running():
        assert ms.urls(PREFILL_POOL) == ["http://10.0.0.1:8000"]  # resolved before serving
        dns.answer = ["10.0.0.1", "10.0.0.7"]
        for _ in range(100):
            if len(ms.urls(PREFILL_POOL)) == 2:
                break
            await asyncio.sleep(0.02)
    assert ms.urls(PREFILL_POOL) == ["http://10.0.0.1:8000", "http://10.0.0.7:8000"]
    assert seen[-1] == (PREFILL_POOL, ["http://10.0.0.7:8000"], [])
    assert ms.urls("native") == [NATIVE]  # a static pool stays as configured


@pytest.fixture
def vllm_local(upstreams):
    for base in ("http://127.0.0.1:8000", PREFILL):
        upstreams.on(base, "/v1/completions", prefill_reply)
    upstreams.on("http://127.0.0.1:8100", "/v1/completions", decode_reply)
    return upstreams


async def test_the_app_serves_dns_pools_and_probes_their_members(make_client, vllm_local):
    """Both pools from DNS only (localhost's A record): the router routes to the resolved addresses and its health
    monitor lists them."""
    cfg = make_config(prefill={"model": "served", "dns": {"name": "localhost", "port": 8000}},
                      pools={"native": {"kind": "native", "dns": {"name": "localhost", "port": 8100}}},
                      aliases={"tiny": {"pool": "native"}})
    async with make_client(cfg) as (client, app):
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200, r.text
        ready = (await client.get("/ready")).json()
        assert ready["upstreams"]["http://127.0.0.1:8000"]["lane"] == "prefill"
        assert ready["upstreams"]["http://127.0.0.1:8100"]["lane"] == "native"
        assert PREFILL not in ready["upstreams"]  # `url` only takes side calls when a pool is configured
        metrics = (await client.get("/metrics")).text
        assert 'expresslane_router_pool_members{pool="prefill"} 1.0' in metrics
    assert [b for (b, p, _) in vllm_local.calls if p == "/v1/completions"] == ["http://127.0.0.1:8000",
                                                                                "http://127.0.0.1:8100"]


async def test_an_empty_dns_pool_is_not_ready_and_answers_503(make_client, vllm_local):
    cfg = make_config(prefill={"model": "served",
                               "dns": {"name": "no-such-host.invalid", "port": 8000}})
    async with make_client(cfg) as (client, app):
        assert (await client.get("/ready")).status_code == 503
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


async def test_members_leaving_are_forgotten_by_the_health_monitor(make_client, vllm_local):
    cfg = make_config(prefill={"model": "served", "nodes": [PREFILL],
                               "dns": {"name": "localhost", "port": 8000}})
    async with make_client(cfg) as (client, app):
        monitor = app.state.health
        assert "http://127.0.0.1:8000" in monitor.upstreams
        members = app.state.lanes.ctx.membership.pools[PREFILL_POOL]
        members._resolver = FakeDns([])
        await members.refresh()
        assert "http://127.0.0.1:8000" not in monitor.upstreams and PREFILL in monitor.upstreams
        assert members.urls() == [PREFILL]


async def test_a_member_that_leaves_mid_request_finishes_it_and_leaves_no_series(make_client, upstreams):
    """A prefill member and a native member each leave the pool while a request is on them: the request completes,
    and neither member's per-member series is left on /metrics (a late in-flight update must not bring it back)."""
    release = {"prefill": asyncio.Event(), "native": asyncio.Event()}
    started = {"prefill": asyncio.Event(), "native": asyncio.Event()}

    def held(kind, reply):
        async def handler(request, body):
            started[kind].set()
            await release[kind].wait()
            return reply(request, body)
        return handler

    upstreams.on("http://10.0.0.1:8000", "/v1/completions", held("prefill", prefill_reply))
    upstreams.on("http://10.0.0.2:8000", "/v1/completions", prefill_reply)
    upstreams.on("http://10.0.0.3:8100", "/v1/completions", held("native", decode_reply))
    upstreams.on("http://10.0.0.4:8100", "/v1/completions", decode_reply)
    prefill_dns, native_dns = FakeDns(["10.0.0.1"]), FakeDns(["10.0.0.3"])

    async def resolver(host, port):
        return await (prefill_dns if host == "prefill.svc" else native_dns)(host, port)

    cfg = make_config(prefill={"model": "served", "dns": {"name": "prefill.svc", "port": 8000}},
                      pools={"native": {"kind": "native", "dns": {"name": "native.svc", "port": 8100}}},
                      aliases={"tiny": {"pool": "native"}})
    async with make_client(cfg, resolver=resolver) as (client, app):
        ms = app.state.lanes.ctx.membership
        req = asyncio.ensure_future(client.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                                          "max_tokens": 3}))
        await asyncio.wait_for(started["prefill"].wait(), 5)
        prefill_dns.answer = ["10.0.0.2"]
        await ms.pools[PREFILL_POOL].refresh()
        release["prefill"].set()
        await asyncio.wait_for(started["native"].wait(), 5)
        native_dns.answer = ["10.0.0.4"]
        await ms.pools["native"].refresh()
        release["native"].set()
        r = await req
        metrics = (await client.get("/metrics")).text
    assert r.status_code == 200, r.text
    assert "10.0.0.1:8000" not in metrics and "10.0.0.3:8100" not in metrics
    assert 'member="10.0.0.2:8000"' in metrics and 'node="10.0.0.4:8100"' in metrics
