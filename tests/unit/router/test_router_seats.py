"""The express gate counts seats, not nodes (issue 40 "Router"): the router's side of the seats contract.

Contract with the express node: `GET /capabilities` adds a top-level integer `"seats": S` (S >= 1; absent = 1, an
older node; a `kind: tilert` node is always one seat and never asked); `POST /pd/reserve` succeeds while any seat is
free, else 429 busy; `/pd/decode` and `/pd/cancel` name the request by rid as ever; `GET /decode_status` gains
`seats`, `seats_busy`. The gate holds up to S leases on a node of S seats (gate tests: never double-booked), hands
out the least-loaded node and queues only when every seat of every available node is busy; until a node's seats
are known it counts as one. Metrics: `expresslane_router_express_seats{pool}` and `..._express_seats_busy{pool}`.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client import CollectorRegistry

from expresslane.router.fleet.capabilities import CapabilityRouter, seats_of
from expresslane.router.server.secrets import RouterSecrets

from ._kit import EXPRESS, config_dict, make_config, parse_config
from .test_router_express_lane import COMP, FakeNode, gate_of

FEATURES = {"logprobs": True, "top_logprobs": True, "structured_output": True, "tools": False, "n": False,
            "echo": False, "prompt_logprobs": False, "logit_bias": True, "min_p": True, "allowed_token_ids": True,
            "bad_words": False, "stop_token_ids": True, "min_tokens": True, "penalties": True, "seed": True,
            "speculative": False}  # what our engine's node says (capabilities.EXPRESSLANE_ENGINE)


def test_seats_of_a_capabilities_answer():
    assert seats_of({"seats": 4, "features": {}}) == (4, "")
    assert seats_of({"features": {}}) == (1, "")  # absent: an older node, one seat
    for bad in (0, -2, 1.5, "3", True, [2]):
        n, problem = seats_of({"seats": bad})
        assert n == 1 and "not an integer" in problem, bad


class SeatNode(FakeNode):
    """A fake express node of `seats` seats: /capabilities says so, /pd/reserve refuses (429) when all are held,
    /pd/decode holds its seat until `release` is set; /decode_status reports seats and seats_busy."""

    def __init__(self, upstreams, tokenizer, seats: int, *, advertise: int | None = None):
        super().__init__(upstreams, tokenizer)
        self.seats = seats
        self.advertise = seats if advertise is None else advertise
        self.held: set[str] = set()
        self.most = 0
        self.release = asyncio.Event()
        self.capability_calls = 0
        upstreams.on(EXPRESS, "/capabilities", self.capabilities)
        upstreams.on(EXPRESS, "/decode_status", self.status)

    def capabilities(self, request, body):
        self.capability_calls += 1
        return httpx.Response(200, json={"kind": "expresslane", "seats": self.advertise, "features": FEATURES})

    def status(self, request, body):
        return httpx.Response(200, json={"seats": self.seats, "seats_busy": len(self.held),
                                         "state": "busy" if len(self.held) >= self.seats else "idle"})

    def reserve(self, request, body):
        if len(self.held) >= self.seats:
            return httpx.Response(429, json={"error": "busy"}, headers={"retry-after": "1"})
        self.held.add(body["rid"])
        self.most = max(self.most, len(self.held))
        return super().reserve(request, body)

    async def decode(self, request, body):
        await self.release.wait()
        out = await super().decode(request, body)

        chunks = [c async for c in out.stream]

        async def lines():
            for i, chunk in enumerate(chunks):
                if i == len(chunks) - 1:  # the request ends with its done line: its seat is free again
                    self.held.discard(body["rid"])
                yield chunk
        return httpx.Response(200, content=lines(), headers=out.headers)

    def cancel(self, request, body):
        self.held.discard(body["rid"])
        return super().cancel(request, body)


PLAIN = {"model": "tiny-x", "prompt": "hi", "max_tokens": 4}  # asks for no feature: no capability fetch waited for


def _patient(**over):
    """The kit's config, the express alias waiting up to 10 s for a seat."""
    d = config_dict(**over)
    d["aliases"]["tiny-x"]["queue"] = {"max_waiting": 4, "max_wait_s": 10, "when_full": "reject"}
    return parse_config(d)


async def _wait(pred, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


def _metric(text: str, name: str, pool: str = "express") -> float:
    for line in text.splitlines():
        if line.startswith(f'{name}{{pool="{pool}"}} '):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


async def test_a_node_of_three_seats_serves_three_requests_at_once_and_queues_the_fourth(make_client, upstreams,
                                                                                      tokenizer):
    node = SeatNode(upstreams, tokenizer, seats=3)
    async with make_client(_patient()) as (client, app):
        gate = gate_of(app)
        await _wait(lambda: gate.seats_total == 3)  # learned from /capabilities at start
        body = dict(COMP, max_tokens=3)
        first = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(3)]
        await _wait(lambda: len(node.held) == 3)
        fourth = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await _wait(lambda: gate.waiting == 1)  # every seat is busy: it queues (no reserve sent, no 429 seen)
        metrics = (await client.get("/metrics")).text
        health = (await client.get("/health")).json()["express_pools"]["express"]
        node.release.set()
        rs = await asyncio.gather(*first, fourth)
    assert [r.status_code for r in rs] == [200] * 4
    assert node.most == 3 and len(node.reserved) == 4  # never a reserve the node had to refuse
    assert _metric(metrics, "expresslane_router_express_seats") == 3
    assert _metric(metrics, "expresslane_router_express_seats_busy") == 3
    assert 'expresslane_router_inflight_requests{node="express:5557",pool="express"} 3.0' in metrics
    assert health == {"nodes": 1, "busy_nodes": 1, "seats": 3, "busy_seats": 3, "waiting": 1}
    assert gate.busy_count == 0


async def test_until_its_seats_are_known_a_node_counts_as_one(make_client, upstreams, tokenizer):
    node = SeatNode(upstreams, tokenizer, seats=2)
    gate_open = asyncio.Event()

    async def late_capabilities(request, body):  # the node answers its /capabilities only later
        await gate_open.wait()
        return node.capabilities(request, body)

    upstreams.on(EXPRESS, "/capabilities", late_capabilities)
    async with make_client(_patient()) as (client, app):
        gate = gate_of(app)
        assert gate.seats_total == 1
        a = asyncio.ensure_future(client.post("/v1/completions", json=PLAIN))
        await _wait(lambda: len(node.held) == 1)
        b = asyncio.ensure_future(client.post("/v1/completions", json=PLAIN))
        await _wait(lambda: gate.waiting == 1)  # one seat known: b waits
        gate_open.set()
        await _wait(lambda: len(node.held) == 2)  # two seats now: b got the second at once
        node.release.set()
        rs = await asyncio.gather(a, b)
    assert [r.status_code for r in rs] == [200, 200]


async def test_a_node_that_refuses_as_busy_is_asked_for_its_seats_again(make_client, upstreams, tokenizer, caplog):
    """A node that says 2 seats but holds only 1 (it restarted with fewer): its 429 makes the router ask again, and
    the gate then holds one lease there."""
    node = SeatNode(upstreams, tokenizer, seats=1, advertise=2)
    caplog.set_level(logging.WARNING, logger="expresslane.router.fleet.capabilities")
    cfg = _patient(capabilities={"refresh_s": 3600, "retry_s": 0.05})
    async with make_client(cfg) as (client, app):
        gate = gate_of(app)
        await _wait(lambda: gate.seats_total == 2)
        a = asyncio.ensure_future(client.post("/v1/completions", json=COMP))
        await _wait(lambda: len(node.held) == 1)
        node.advertise = 1  # what it says when asked again
        calls = node.capability_calls
        b = asyncio.ensure_future(client.post("/v1/completions", json=dict(COMP, model="tiny-x")))
        await _wait(lambda: node.capability_calls > calls and gate.seats_total == 1)
        node.release.set()
        rs = await asyncio.gather(a, b)
    assert rs[0].status_code == 200
    assert rs[1].status_code in (200, 429)  # served after a requeue, or refused by the alias's policy (busy_retries)
    assert any("1 seat(s) (was 2)" in r.getMessage() for r in caplog.records)


async def test_tilert_nodes_are_one_seat_and_never_asked(upstreams, tokenizer, make_client):
    d = config_dict()
    d["pools"]["express"]["kind"] = "tilert"
    FakeNode(upstreams, tokenizer, kind="tilert")
    async with make_client(parse_config(d)) as (client, app):
        await asyncio.sleep(0.05)
        assert gate_of(app).seats_total == 1
    assert not any(p == "/capabilities" for (_, p, _) in upstreams.calls)


async def test_a_failed_fetch_keeps_the_last_known_seats():
    cfg = make_config(capabilities={"refresh_s": 0.01, "retry_s": 0.01})
    answers = [httpx.Response(200, json={"seats": 4, "features": FEATURES}), httpx.ConnectError("down")]

    def handler(request):
        a = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(a, Exception):
            raise a
        return a

    seen: list[int] = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        from prometheus_client import Counter

        caps = CapabilityRouter(cfg, client, RouterSecrets(), Counter("x_total", "x", registry=CollectorRegistry()),
                                clock=asyncio.get_running_loop().time)
        caps.on_seats(lambda node, n: seen.append(n))
        await caps.refresh()
        url = cfg.pools["express"].nodes[0].url
        assert caps.node_seats(url) == 4
        await asyncio.sleep(0.02)
        await caps.refresh()  # this one fails
        assert caps.node_seats(url) == 4 and seen == [4]
        assert caps.node_seats("http://never-asked:1") == 1

