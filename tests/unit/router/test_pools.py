"""The prefill pool (pools.py): the affinity key, the consistent choice, the least-loaded fallback, failover across
members, and both lanes going through it in the app (fake vLLM prefills behind httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import random
import string

import httpx
import pytest
from prometheus_client import CollectorRegistry

from expresslane.router.config import Affinity, ConfigError, parse_config
from expresslane.router.errors import UpstreamError, UpstreamUnavailable
from expresslane.router.metrics import RouterMetrics
from expresslane.router.fleet.pools import PrefillPool, affinity_key

from ._kit import EXPRESS, NATIVE, config_dict, make_config
from .test_router_express_lane import FakeNode
from .test_router_native_lane import decode_reply, prefill_reply

P1, P2, P3 = "http://prefill-a:8000", "http://prefill-b:8000", "http://prefill-c:8000"


def pool(members, *, serving=lambda url: True, prefix_chars=64, max_imbalance=2) -> PrefillPool:
    return PrefillPool(Affinity(prefix_chars=prefix_chars, max_imbalance=max_imbalance), lambda: members, serving,
                       RouterMetrics(make_config(), CollectorRegistry()))


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(n))


# ---- the key ------------------------------------------------------------------------------------------------------

def test_affinity_key_is_the_prompts_first_characters():
    assert affinity_key({"prompt": "abcdef"}, 4) == "abcd"
    assert affinity_key({"prompt": ["first prompt", "second"]}, 5) == "first"
    assert affinity_key({"prompt": [11, 12, 13]}, 5) == "11,12"
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    assert affinity_key(chat, 1000) == "system\x1fbe brief\x1euser\x1fhello\x1e"
    assert affinity_key({"prompt": 3}, 10) == "" and affinity_key({}, 10) == ""


def test_a_conversations_next_turn_has_the_same_key():
    first = {"messages": [{"role": "user", "content": words(40, 1)}]}
    second = {"messages": first["messages"] + [{"role": "assistant", "content": "ok"},
                                                {"role": "user", "content": "and then?"}]}
    assert affinity_key(first, 64) == affinity_key(second, 64)
    assert affinity_key({"prompt": words(40, 1) + " more"}, 64) == affinity_key({"prompt": words(40, 1)}, 64)


# ---- the choice ---------------------------------------------------------------------------------------------------

def test_the_same_key_lands_on_the_same_member_and_keys_spread():
    p = pool([P1, P2])
    keys = [words(12, s) for s in range(400)]
    first = [p.choose(k)[0] for k in keys]
    assert first == [p.choose(k)[0] for k in keys]  # stable
    share = first.count(P1) / len(first)
    assert 0.35 < share < 0.65, share  # both members get traffic
    assert all(why == "affinity" for why in (p.choose(k)[1] for k in keys))


def test_adding_a_member_moves_only_the_keys_it_wins():
    keys = [words(12, s) for s in range(600)]
    two, three = pool([P1, P2]), pool([P1, P2, P3])
    moved = [k for k in keys if two.choose(k)[0] != three.choose(k)[0]]
    assert all(three.choose(k)[0] == P3 for k in moved)  # nothing moves between the old members
    assert 0.2 < len(moved) / len(keys) < 0.45  # about a third goes to the new member


def test_a_member_not_serving_is_passed_over_and_none_is_a_typed_503():
    down = {P1}
    p = pool([P1, P2], serving=lambda url: url not in down)
    assert {p.choose(words(12, s))[0] for s in range(50)} == {P2}
    down.add(P2)
    with pytest.raises(UpstreamUnavailable) as e:
        p.choose("x")
    assert e.value.status == 503 and e.value.headers["retry-after"] == "2"


def test_a_busy_preferred_member_gives_way_to_the_least_loaded():
    p = pool([P1, P2], max_imbalance=2)
    key = next(k for k in (words(12, s) for s in range(50)) if p.choose(k)[0] == P1)
    p.inflight[P1] = 1
    assert p.choose(key) == (P1, "affinity")  # 1 more in flight: within the imbalance allowed
    p.inflight[P1] = 2
    assert p.choose(key) == (P2, "least_loaded")
    assert p.choose("") == (P2, "least_loaded")  # no key: least loaded


async def test_run_fails_over_on_a_retryable_error_each_member_once():
    p = pool([P1, P2, P3])
    seen: list[str] = []

    async def attempt(url: str) -> str:
        seen.append(url)
        assert p.inflight[url] == 1
        raise UpstreamError("refused", stage="prefill", kind="connect")

    with pytest.raises(UpstreamError):
        await p.run({"prompt": "x"}, attempt, retry=lambda e: e.kind == "connect")
    assert sorted(seen) == [P1, P2, P3] and all(v == 0 for v in p.inflight.values())
    seen.clear()
    with pytest.raises(UpstreamError):  # not retryable: one member only
        await p.run({"prompt": "x"}, attempt, retry=lambda e: False)
    assert len(seen) == 1


def test_prefill_pool_config():
    cfg = make_config(prefill={"model": "m", "nodes": [P1 + "/", P2],
                               "affinity": {"prefix_chars": 32, "max_imbalance": 0}})
    assert cfg.prefill.static_nodes == [P1, P2] and cfg.prefill.affinity.prefix_chars == 32
    assert make_config().prefill.static_nodes == [make_config().prefill.url]
    dns_only = make_config(prefill={"model": "m", "dns": {"name": "prefill", "port": 8000}})
    assert dns_only.prefill.static_nodes == [] and dns_only.prefill.dns.refresh_s == 10
    with pytest.raises(ConfigError, match="prefill.affinity.prefix_chars"):
        make_config(prefill={"url": P1, "model": "m", "affinity": {"prefix_chars": 0}})
    with pytest.raises(ConfigError, match="nodes .* or dns"):
        parse_config(config_dict(pools={"native": {"kind": "native"}}))


# ---- in the app: both lanes through the pool ---------------------------------------------------------------------

def two_prefills(**over):
    return make_config(prefill={"model": "served", "nodes": [P1, P2],
                                "affinity": {"prefix_chars": 64, "max_imbalance": 4}}, **over)


@pytest.fixture
def vllm_pair(upstreams):
    for base in (P1, P2):
        upstreams.on(base, "/v1/completions", prefill_reply)
    upstreams.on(NATIVE, "/v1/completions", decode_reply)
    return upstreams


def prefill_calls(upstreams) -> dict[str, int]:
    return {b: len(upstreams.bodies(b, "/v1/completions")) for b in (P1, P2)}


async def test_native_requests_spread_and_a_conversation_sticks(make_client, vllm_pair):
    async with make_client(two_prefills()) as (client, app):
        for s in range(24):
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": words(20, s), "max_tokens": 3})
            assert r.status_code == 200, r.text
        spread = prefill_calls(vllm_pair)
        assert spread[P1] > 0 and spread[P2] > 0 and sum(spread.values()) == 24
        for turn in range(3):  # one conversation: every turn on one member
            prompt = words(20, 99) + " next" * turn
            assert (await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                               "max_tokens": 3})).status_code == 200
        last3 = [b for (b, p, _) in vllm_pair.calls if p == "/v1/completions" and b in (P1, P2)][-3:]
        assert len(set(last3)) == 1
        metrics = (await client.get("/metrics")).text
        for base in ("prefill-a:8000", "prefill-b:8000"):
            assert f'expresslane_router_prefill_requests_total{{choice="affinity",member="{base}"}}' in metrics


async def test_a_dead_prefill_member_costs_nothing_native(make_client, vllm_pair):
    """A member that refuses connections: every request is served by the other one (same kv params), and outlier
    detection (outlier.py, through pools.member_serving) ejects it after `consecutive_gateway_failure` gateway failures, after
    which the pool's choice skips it."""
    def refused(request, body):
        raise httpx.ConnectError("connection refused")

    vllm_pair.on(P1, "/v1/completions", refused)
    async with make_client(two_prefills(outlier={"consecutive_gateway_failure": 2})) as (client, app):
        for s in range(16):
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": words(20, s), "max_tokens": 3})
            assert r.status_code == 200, r.text
        assert prefill_calls(vllm_pair) == {P1: 2, P2: 16}  # two failures, then P1 is skipped
        ready = (await client.get("/ready")).json()
        assert ready["upstreams"][P1]["ejected_from"] == ["prefill"] and ready["status"] == "ready"
        metrics = (await client.get("/metrics")).text
        assert 'expresslane_router_prefill_requests_total{choice="retry",member="prefill-b:8000"} 2.0' in metrics
        assert ('expresslane_router_outlier_decisions_total{decision="eject",node="prefill-a:8000",pool="prefill",'
                'reason="consecutive_gateway_failure"} 1.0') in metrics


async def test_an_ejected_member_is_skipped_by_the_prefill_pool_and_a_dns_native_pool(make_client, upstreams):
    """The one seam (pools.member_serving) is outlier detection's verdict, not only the probes': a member ejected
    for its request failures is passed over by the prefill pool's choice and by the native lane's node choice, a
    member that came from DNS included (discovery.py -> HealthMonitor.track -> its pool's detector)."""
    dns_native = "http://127.0.0.1:8100"  # localhost's A record
    cfg = two_prefills(pools={"native": {"kind": "native", "nodes": [NATIVE],
                                         "dns": {"name": "localhost", "port": 8100}}},
                       aliases={"tiny": {"pool": "native"}}, outlier={"consecutive_gateway_failure": 2})
    async with make_client(cfg) as (client, app):
        ctx, native = app.state.lanes.ctx, app.state.lanes.native
        keys = [words(12, s) for s in range(40)]
        assert {ctx.prefills.choose(k)[0] for k in keys} == {P1, P2}
        assert set(ctx.native_nodes("native")) == {NATIVE, dns_native}
        for url in (P1, dns_native):
            for _ in range(2):
                ctx.report_failure(url, "connect", "connection refused")
        assert app.state.health.healthy(P1) and app.state.health.healthy(dns_native)  # the probes see no fault
        assert {ctx.prefills.choose(k)[0] for k in keys} == {P2}  # ejected from the prefill pool: skipped
        native._outstanding[("native", NATIVE)] = 5  # the ejected member would be the least loaded
        assert native.pick_node("native") == NATIVE
        ready = (await client.get("/ready")).json()
        assert ready["upstreams"][P1]["ejected_from"] == ["prefill"]
        assert ready["upstreams"][dns_native]["ejected_from"] == ["native"]


async def test_a_prefill_member_dying_mid_leg_is_retried_on_the_next_native(make_client, vllm_pair):
    def dropped(request, body):
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    vllm_pair.on(P1, "/v1/completions", dropped)
    vllm_pair.on(P2, "/v1/completions", dropped)
    async with make_client(two_prefills()) as (client, app):
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3})
        assert r.status_code == 502 and sum(prefill_calls(vllm_pair).values()) == 2  # each member once, then the error


async def test_express_prefill_goes_through_either_member(make_client, upstreams, tokenizer):
    node = FakeNode(upstreams, tokenizer)
    for base in (P1, P2):
        for path in ("/v1/completions", "/v1/chat/completions"):
            upstreams.on(base, path, node.prefill)
    async with make_client(two_prefills()) as (client, app):
        for s in range(12):
            r = await client.post("/v1/completions", json={"model": "tiny-x", "prompt": words(20, s),
                                                           "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.headers["x-expresslane-lane"] == "express", r.text
    bodies = [(b, body) for (b, p, body) in upstreams.calls if p == "/v1/completions" and b in (P1, P2)]
    assert {b for b, _ in bodies} == {P1, P2}
    # every member carries the same marker shape: the node's control plane and the request's rid
    assert all(body["kv_transfer_params"]["expresslane_ctrl_port"] == 5556 for _, body in bodies)
    assert len(node.reserved) == 12 and len({body["kv_transfer_params"]["expresslane_rid"] for _, body in bodies}) == 12


async def test_express_prefill_lost_mid_leg_starts_over_on_the_other_member(make_client, upstreams, tokenizer):
    node = FakeNode(upstreams, tokenizer)
    calls = {P1: 0, P2: 0}
    lost_prompts: list[str] = []

    def member(base):
        def handler(request, body):
            calls[base] += 1
            if base == P1:
                lost_prompts.append(body["prompt"])
                raise httpx.RemoteProtocolError("peer closed connection")
            return node.prefill(request, body)
        return handler

    for base in (P1, P2):
        upstreams.on(base, "/v1/completions", member(base))
    async with make_client(two_prefills()) as (client, app):
        for s in range(4):
            r = await client.post("/v1/completions", json={"model": "tiny-x", "prompt": words(20, s),
                                                           "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.headers["x-expresslane-lane"] == "express", r.text
    # each request that met P1 lost it once, then prefilled on P2 for a new reservation (never P1 again)
    assert calls[P1] >= 1 and calls[P2] == 4 and len(set(lost_prompts)) == len(lost_prompts)
    assert len(node.cancelled) == calls[P1]  # each lost attempt's reservation was cancelled on the node
    assert len(node.reserved) == 4 + calls[P1]


async def test_no_prefill_member_serving_is_a_503_before_any_work(make_client, vllm_pair):
    """Request failures never take a pool's last member away (outlier.py); the probes do: every member's /health
    refused -> a typed 503 before any prefill or decode call, and /ready is 503 (without panic routing: with it, the
    pool would route to both members, test_router_health.py)."""
    def refused(request, body):
        raise httpx.ConnectError("connection refused")

    for base in (P1, P2):
        vllm_pair.on(base, "/health", refused)
    vllm_pair.on(NATIVE, "/health", lambda r, b: httpx.Response(200))
    vllm_pair.on(EXPRESS, "/health", lambda r, b: httpx.Response(200))
    cfg = two_prefills(health={"enabled": True, "interval_s": 0.02, "timeout_s": 0.5, "unhealthy_threshold": 1,
                               "healthy_panic_threshold": 0})
    async with make_client(cfg) as (client, app):
        for _ in range(500):
            if not any(app.state.health.healthy(b) for b in (P1, P2)):
                break
            await asyncio.sleep(0.01)
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3})
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert "prefill" in r.json()["error"]["message"]
        assert (await client.get("/ready")).status_code == 503
    assert not any(p == "/v1/completions" for (_, p, _) in vllm_pair.calls)


def test_pool_metrics_are_in_the_routers_one_registry():
    """The pools' series belong to RouterMetrics (the registry the app serves on /metrics and the dashboards'
    contract is read from), zero-valued for every configured member and pool before any traffic."""
    reg = CollectorRegistry()
    RouterMetrics(make_config(prefill={"model": "m", "nodes": [P1, P2]}), reg)
    for member in ("prefill-a:8000", "prefill-b:8000"):
        for choice in ("affinity", "least_loaded", "retry"):
            assert reg.get_sample_value("expresslane_router_prefill_requests_total",
                                        {"member": member, "choice": choice}) == 0
        assert reg.get_sample_value("expresslane_router_prefill_inflight", {"member": member}) == 0
    for pool_name in ("prefill", "native", "express"):
        assert reg.get_sample_value("expresslane_router_pool_members", {"pool": pool_name}) == 0
        assert reg.get_sample_value("expresslane_router_pool_dns_failures_total", {"pool": pool_name}) == 0
