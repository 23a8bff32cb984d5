"""Pools end to end, real processes: 2 stock vLLM prefills (MultiConnector with our connector), 2 stock vLLM native
decodes, our express node and the router (scripts/dev_stack.py --prefills 2 --natives 2).

- both lanes are exact through EITHER prefill member (the express connector's allow-list and the node's
  reservations do not care which prefill pushes the KV);
- traffic spreads: the router's per-member counters and each member's own metrics show both members used;
- a conversation's second turn goes to the member that served its first and hits that member's prefix cache
  (vLLM's `vllm:prefix_cache_hits_total` moves there, not on the other member);
- a prefill SIGKILLed under load loses nothing: every request of the burst gets its exact answer, and a native
  decode whose KV that prefill had computed but not yet handed over recomputes it.

The numbers each test measured are printed (run with -s to see them).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import threading
import time

import httpx
import pytest

from dev_stack import DevStack
from exactness import EXPRESS_ALIAS, NATIVE_ALIAS, chat, completion, token_prompt
from expresslane.router.fleet.pools import _weight, affinity_key

MAX_TOKENS = 16
PREFIX_CHARS = 256  # compose/config/router.yaml's prefill.affinity.prefix_chars
# A dead member is marked unhealthy within unhealthy_threshold rounds of its death (the router's defaults,
# router/src/expresslane/router/resilience.py: 3 rounds of interval_s 2 s, a refused probe failing at once), plus a
# round already under way and a loaded host's slack
EJECTION_BOUND_S = 16.0


@pytest.fixture(scope="module")
def pool_stack(tiny_model_dir, tmp_path_factory):
    base = int(os.environ.get("EXPRESSLANE_TEST_PORT_BASE", "20000")) + 500
    with DevStack(model_dir=tiny_model_dir, state_dir=tmp_path_factory.mktemp("pool-stack"), port_base=base,
                  prefills=2, natives=2) as stack:  # (each service's log stays in the state directory)
        yield stack


def metric_values(http, url: str, name: str) -> dict[str, float]:
    """{label text: value} of every sample of `name` on `url`/metrics."""
    out: dict[str, float] = {}
    for line in http.get(f"{url}/metrics").text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1) or ""] = out.get(m.group(1) or "", 0.0) + float(m.group(2))
    return out


def total(http, url: str, name: str) -> float:
    return sum(metric_values(http, url, name).values())


def router_per_member(http, stack) -> dict[str, float]:
    """Prefill legs the router sent to each prefill member (all choices)."""
    out: dict[str, float] = {}
    for labels, v in metric_values(http, stack.router_url, "expresslane_router_prefill_requests_total").items():
        member = re.search(r'member="([^"]+)"', labels).group(1)
        out[member] = out.get(member, 0.0) + v
    return out


def preferred(stack, body: dict) -> str:
    """The member the router's affinity hash prefers for `body` (pools.py, the same function)."""
    key = affinity_key(body, PREFIX_CHARS)
    return max(stack.member_urls("prefill"), key=lambda u: _weight(key, u))


def prompts_for_each_member(stack, n_each: int, length: int) -> list[list[int]]:
    """Token prompts, n_each preferred by each prefill member (so both are exercised deterministically)."""
    want = {u: n_each for u in stack.member_urls("prefill")}
    out, salt = [], 0
    while any(want.values()):
        p = token_prompt(length + salt % 7, salt=salt + 1000)
        u = preferred(stack, {"prompt": p})
        if want[u]:
            want[u] -= 1
            out.append(p)
        salt += 1
    return out


def reference(http, stack, prompt) -> dict:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    return completion(http, stack.prefill_url, body)["choices"][0]


def ask(http, stack, alias: str, prompt) -> httpx.Response:
    return http.post(f"{stack.router_url}/v1/completions",
                     json={"model": alias, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                           "return_token_ids": True})


def test_both_lanes_exact_through_either_prefill(pool_stack, http):
    s = pool_stack
    prefills = s.member_urls("prefill")
    connectors = [s.connector_metrics_url, s.url("CONNECTOR_METRICS_PORT_2")]
    claimed = "expresslane_connector_claimed_requests_total"
    before_claims = [total(http, u, claimed) for u in connectors]
    before_router = router_per_member(http, s)
    prompts = prompts_for_each_member(s, 3, 150)
    for p in prompts:
        ref = reference(http, s, p)
        for alias, lane in ((NATIVE_ALIAS, "native"), (EXPRESS_ALIAS, "express")):
            r = ask(http, s, alias, p)
            assert r.status_code == 200, r.text
            assert r.headers["x-expresslane-lane"] == lane
            got = r.json()["choices"][0]
            assert got["text"] == ref["text"], f"{lane} via {preferred(s, {'prompt': p})} differs"
            assert got.get("token_ids") == ref["token_ids"]
    claims = [total(http, u, claimed) - b for u, b in zip(connectors, before_claims)]
    router = {m: v - before_router.get(m, 0.0) for m, v in router_per_member(http, s).items()}
    print(f"\n[pools] {len(prompts)} prompts x 2 lanes, exact; prefill legs per member {router}; "
          f"express handoffs claimed per prefill {dict(zip(prefills, claims))}")
    assert claims == [3.0, 3.0], "each prefill member must have pushed its express requests' KV"
    assert sorted(router.values()) == [6.0, 6.0]


def test_side_calls_are_answered_through_the_pool(pool_stack, http):
    """/tokenize, /v1/models/{id} and /version through the router (compose/config/router.yaml has no single prefill
    URL, only the pool): answered by a serving member, the same answer as that member's own, not counted as legs."""
    s = pool_stack
    before = router_per_member(http, s)
    for prompt in prompts_for_each_member(s, 2, 40):
        text = " ".join(map(str, prompt))  # a text prompt keyed as the prefill sees it
        member = preferred(s, {"prompt": text})
        r = http.post(f"{s.router_url}/tokenize", json={"model": NATIVE_ALIAS, "prompt": text})
        direct = http.post(f"{member}/tokenize", json={"model": "tiny-llama", "prompt": text})
        assert r.status_code == 200 and r.json()["tokens"] == direct.json()["tokens"], r.text
    card = http.get(f"{s.router_url}/v1/models/{NATIVE_ALIAS}")
    version = http.get(f"{s.router_url}/version")
    assert card.status_code == 200 and isinstance(card.json()["max_model_len"], int), card.text
    assert version.status_code == 200 and version.json()["version"], version.text
    assert router_per_member(http, s) == before  # side calls are not prefill legs


def test_concurrent_native_traffic_uses_both_decode_members(pool_stack, http):
    s = pool_stack
    natives = s.member_urls("decode-native")
    name = "vllm:request_success_total"
    before = [total(http, u, name) for u in natives]
    prompts = [token_prompt(60 + i, salt=2000 + i) for i in range(12)]
    with cf.ThreadPoolExecutor(6) as pool:
        statuses = list(pool.map(lambda p: ask(http, s, NATIVE_ALIAS, p).status_code, prompts))
    assert statuses == [200] * len(prompts)
    served = [total(http, u, name) - b for u, b in zip(natives, before)]
    print(f"\n[pools] 12 concurrent native requests: served per native decode member {dict(zip(natives, served))}")
    assert sum(served) == len(prompts) and min(served) > 0


def test_second_turn_lands_on_its_prefix_and_hits_the_prefix_cache(pool_stack, http):
    s = pool_stack
    prefills = s.member_urls("prefill")
    hits, queries = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
    story = " ".join(["the river carried the copper lamp past the garden window"] * 40)  # well over one KV block
    turn1 = [{"role": "system", "content": "You are a terse assistant."},
             {"role": "user", "content": f"Read this and remember it: {story}"}]
    home = preferred(s, {"messages": turn1})
    r1 = chat(http, s.router_url, {"model": NATIVE_ALIAS, "messages": turn1, "max_tokens": MAX_TOKENS,
                                   "temperature": 0})
    turn2 = turn1 + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Now say it again, shorter."}]
    assert preferred(s, {"messages": turn2}) == home
    before = {u: (total(http, u, hits), total(http, u, queries)) for u in prefills}
    router_before = router_per_member(http, s)
    r2 = chat(http, s.router_url, {"model": NATIVE_ALIAS, "messages": turn2, "max_tokens": MAX_TOKENS,
                                   "temperature": 0})
    after = {u: (total(http, u, hits), total(http, u, queries)) for u in prefills}
    delta = {u: (after[u][0] - before[u][0], after[u][1] - before[u][1]) for u in prefills}
    router_delta = {m: v - router_before.get(m, 0.0) for m, v in router_per_member(http, s).items()}
    print(f"\n[pools] second turn ({r2['usage']['prompt_tokens']} prompt tokens): prefill legs {router_delta}; "
          f"prefix-cache (hit tokens, queried tokens) per member {delta}; home member {home}")
    home_label = home.split("://", 1)[1]
    assert router_delta.get(home_label) == 1.0 and sum(router_delta.values()) == 1.0
    other = next(u for u in prefills if u != home)
    assert delta[home][0] >= 128, "the second turn must reuse the first turn's cached blocks on its member"
    assert delta[other] == (0.0, 0.0)


def test_a_prefill_sigkilled_under_load_loses_nothing(pool_stack, http):
    s = pool_stack
    prompts = [token_prompt(80 + i % 5, salt=3000 + i) for i in range(24)]
    refs = [reference(http, s, p)["text"] for p in prompts]
    aliases = [NATIVE_ALIAS if i % 2 else EXPRESS_ALIAS for i in range(len(prompts))]
    # A KV that prefill-2 computed for a native decode that has not read it yet when prefill-2 dies (the race the
    # burst below may or may not hit): the decode must compute the blocks itself (KV_LOAD_FAILURE_POLICY=recompute)
    orphan = token_prompt(90, salt=4000)
    orphan_ref = reference(http, s, orphan)["text"]
    pre = completion(http, s.url("PREFILL_PORT_2"), {"model": "tiny-llama", "prompt": orphan, "max_tokens": 1,
                                                     "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}})
    started = threading.Event()
    results: list[tuple[int, str, str] | None] = [None] * len(prompts)

    def one(i: int) -> None:
        started.set()
        r = ask(http, s, aliases[i], prompts[i])
        results[i] = (r.status_code, r.headers.get("x-expresslane-lane", ""),
                      r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(len(prompts))]
        started.wait(30)
        time.sleep(1.0)  # requests in flight on both members
        s.kill("prefill-2")
        killed_at = time.monotonic() - t0
        for f in futures:
            f.result(timeout=600)
    lost = [(i, res) for i, res in enumerate(results) if res is None or res[0] != 200 or res[2] != refs[i]]
    lanes = [res[1] for res in results if res]
    retries = metric_values(http, s.router_url, "expresslane_router_prefill_requests_total")
    print(f"\n[pools] SIGKILL prefill-2 at {killed_at:.1f}s into a burst of {len(prompts)} "
          f"({len(prompts) // 2} native, {len(prompts) // 2} express): lost {len(lost)}; lanes served "
          f"{ {lane: lanes.count(lane) for lane in set(lanes)} }; router prefill legs by member/choice {retries}")
    assert not lost, f"lost or wrong: {lost[:3]}"
    orphaned = http.post(f"{s.native_url}/v1/completions",
                         json={"model": "tiny-llama", "prompt": orphan, "max_tokens": MAX_TOKENS, "temperature": 0,
                               "kv_transfer_params": pre["kv_transfer_params"]})
    assert orphaned.status_code == 200, f"a decode whose prefill died: {orphaned.text}"
    assert orphaned.json()["choices"][0]["text"] == orphan_ref
    # Ejected, and the pool still serves. A request that could not connect to prefill-2 starts a probe round at
    # once, but the burst may have finished on prefill-1 alone (its prompts' affinity, the race above): then the
    # periodic probes eject it (EJECTION_BOUND_S after the kill).
    deadline = t0 + killed_at + EJECTION_BOUND_S
    while True:
        ready = http.get(f"{s.router_url}/ready").json()
        if ready["upstreams"][s.url("PREFILL_PORT_2")]["healthy"] is False or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert ready["upstreams"][s.url("PREFILL_PORT_2")]["healthy"] is False, \
        f"prefill-2 not ejected {EJECTION_BOUND_S} s after its SIGKILL: {ready['upstreams']}"
