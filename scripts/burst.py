#!/usr/bin/env python3
"""Burst load on a running stack: rounds of N concurrent mixed requests, then an optional open-loop overload.

    python scripts/burst.py --router http://127.0.0.1:8080 --prefill http://127.0.0.1:8000 [--rounds 3] [--n 256]
    python scripts/burst.py ... --overload-s 20 --overload-rps 40      (open loop above the express pool's capacity)

A round: `--n` requests at once (both aliases, half streamed, completions and chat, prompts of 5-200 words,
8-64 greedy tokens, ignore_eos), each bounded by `--bound-s`. Every outcome is sorted into:
  served   200 and complete (streams end with [DONE], no error event)
  refused  a typed error (OpenAI-style body or SSE error event); `refused_no_node` are the 503s that say no
           healthy decode node is left (what an ejection causes)
  lost     no answer within the bound
  broken   anything else (a transport error, a stream cut without an error event)
and every served greedy output is compared with the single vLLM server's answer (the prefill, asked directly
afterwards). Printed per round: the counts, p50 / p99 latency of served requests, the router's queue depth
(the highest value seen while the round ran), the ejections the router counted, the requests whose connect
was tried again (`--connect-retries`, the openai SDK's default 2: a connect that failed sent nothing), how late
this process's event loop ran at worst, and how often the router's ran 1 s late or more.

Open loop (`--overload-s`): requests arrive at `--overload-rps` whatever the answers, all on the express pool's
own queue (`X-Lane: express` on the native alias: the pool's policy, `when_full: reject`); every one must get an
answer within the bound: served, or a typed 429 with Retry-After.

`--shared-pool`: every request of every round on ONE pooled client with the openai SDK's connection limits and
httpx's 5 s idle expiry (its idle connections reused across requests and rounds, as an SDK's are), and any typed
refusal counts as a failure: what found the router's keep-alive race (issue 42).

Exit status 1 when a round lost, broke or refused by ejection anything (with --shared-pool: refused anything), an
output differs from the reference, or an overload request got no answer. Only the standard library and httpx are used (the project venv).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "integration"))

import httpx  # noqa: E402
from fault_support import Outcome, greedy_references, metric, request, scrape  # noqa: E402

WORDS = (REPO / "scripts" / "bench_lib" / "tiny_model_corpus.txt").read_text().split()
# A client whose connect fails (ConnectError / ConnectTimeout: the request was never sent) tries again, as the
# openai SDK does with its default max_retries=2. The rounds count those retries and print them; a connect that
# keeps failing is still a broken request.
SDK_CONNECT_RETRIES = 2
# the 503 messages of a pool without a node to take the request (lanes/native.py, gate.py)
NO_NODE = ("no healthy", "takes traffic", "take no traffic", "stopped taking traffic", "is down", "are down", "went down")


@dataclass
class Sent:
    kind: str  # completion | chat
    alias: str
    stream: bool
    body: dict
    headers: dict[str, str] = field(default_factory=dict)
    outcome: Outcome | None = None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"

    def ref_key(self) -> str:
        return json.dumps([self.kind, self.body.get("prompt"), self.body.get("messages"), self.body["max_tokens"]])


def make_request(rng: random.Random, aliases: tuple[str, str]) -> Sent:
    n = rng.randint(5, 200)
    start = rng.randrange(0, max(1, len(WORDS) - n))
    text = " ".join(WORDS[start:start + n])
    chat = rng.random() < 0.3
    alias = rng.choice(aliases)
    body: dict = {"model": alias, "max_tokens": rng.randint(8, 64), "temperature": 0, "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return Sent("chat" if chat else "completion", alias, rng.random() < 0.5, body)


def classify(sents: list[Sent]) -> dict[str, list[Sent]]:
    out: dict[str, list[Sent]] = {"served": [], "refused": [], "refused_no_node": [], "lost": [], "broken": []}
    for s in sents:
        o = s.outcome
        if o.ok:
            out["served"].append(s)
        elif o.lost:
            out["lost"].append(s)
        elif o.typed_error and o.error_type not in ("truncated", "transport", "bad_sse"):
            out["refused_no_node" if any(m in (o.error or "") for m in NO_NODE) else "refused"].append(s)
        else:
            out["broken"].append(s)
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def router_counters(router: str) -> dict[str, float]:
    m = scrape(router + "/metrics")
    ej = sum(v for name, _, v in m if name == "expresslane_router_upstream_ejections_total")
    lag = "expresslane_router_event_loop_lag_seconds"
    late = (metric(m, lag + "_count") or 0.0) - (metric(m, lag + "_bucket", le="1.0") or 0.0)
    return {"ejections": ej, "queue_depth": metric(m, "expresslane_router_queue_depth") or 0.0,
            "router_loop_late_1s": late}


async def _watch_own_loop(stop: asyncio.Event, worst: list[float]) -> None:
    """The worst lateness of this process's own event loop (a 0.1 s timer): a loop that runs late fires its
    requests' connect timeouts before it reads their connects, so a client-side ConnectTimeout next to a late
    loop here is the load generator's, not the router's."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t = loop.time()
        await asyncio.sleep(0.1)
        worst[0] = max(worst[0], loop.time() - t - 0.1)


async def _watch_queue(router: str, stop: asyncio.Event, seen: list[float]) -> None:
    while not stop.is_set():
        try:
            seen.append((await asyncio.to_thread(router_counters, router))["queue_depth"])
        except (httpx.HTTPError, OSError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass


async def references(prefill: str, model: str, served: list[Sent], parallel: int = 16,
                     headers: dict[str, str] | None = None) -> dict[str, str | None]:
    """The single server's greedy answer to every distinct served request (None: it could not answer);
    `headers`: vLLM's API key on a closed stack."""
    return await greedy_references(prefill, model, {s.ref_key(): (s.kind, s.body) for s in served},
                                   parallel=parallel, timeout_s=300, headers=headers)


async def burst_round(router: str, n: int, seed: int, *, aliases: tuple[str, str], bound_s: float,
                      client: httpx.AsyncClient | None = None, connect_retries: int = SDK_CONNECT_RETRIES) -> dict:
    """`n` requests at once. A connect that fails (nothing sent) is tried again `connect_retries` times, as the
    openai SDK does; how many were is printed with how late this process's loop and the router's ran."""
    rng = random.Random(seed)
    sents = [make_request(rng, aliases) for _ in range(n)]
    before = router_counters(router)
    stop, depth, own_late = asyncio.Event(), [], [0.0]
    watchers = [asyncio.create_task(_watch_queue(router, stop, depth)), asyncio.create_task(_watch_own_loop(stop, own_late))]
    t0 = time.monotonic()

    async def one(s: Sent) -> None:
        s.outcome = await request(router, s.path, s.body, bound_s=bound_s, stream=s.stream, client=client,
                                  connect_retries=connect_retries)

    await asyncio.gather(*(one(s) for s in sents))
    wall = time.monotonic() - t0
    stop.set()
    await asyncio.gather(*watchers)
    after = router_counters(router)
    c = classify(sents)
    lat = [s.outcome.elapsed_s for s in c["served"]]
    return {"sents": sents, "classes": c, "wall_s": wall, "p50_s": percentile(lat, 0.5), "p99_s": percentile(lat, 0.99),
            "queue_depth_max": max(depth, default=0.0), "ejections": after["ejections"] - before["ejections"],
            "connect_retried": [s for s in sents if s.outcome.connect_failures], "own_loop_late_max_s": own_late[0],
            "router_loop_late_1s": after["router_loop_late_1s"] - before["router_loop_late_1s"]}


def summarize(r: dict) -> str:
    c = r["classes"]
    counts = " ".join(f"{k}={len(v)}" for k, v in c.items())
    p = (f"p50={r['p50_s']:.2f}s p99={r['p99_s']:.2f}s" if r["p50_s"] is not None else "p50=- p99=-")
    return (f"{counts} wall={r['wall_s']:.1f}s {p} queue_depth_max={r['queue_depth_max']:g} "
            f"ejections={r['ejections']:g} connect_retried={len(r['connect_retried'])} "
            f"client_loop_late_max={r['own_loop_late_max_s']:.2f}s router_loop_late_ge_1s={r['router_loop_late_1s']:g}")


def examples(r: dict, k: int = 3) -> list[str]:
    out = []
    for cls in ("lost", "broken", "refused_no_node", "refused"):
        for s in r["classes"][cls][:k]:
            out.append(f"{cls}: {s.alias} {s.kind} stream={s.stream}: {s.outcome.describe()}")
    for s in r.get("connect_retried", [])[:k]:
        out.append(f"connect retried: {s.alias} {s.kind} stream={s.stream}: {s.outcome.describe()}")
    return out


async def overload(router: str, alias: str, rps: float, duration_s: float, bound_s: float, seed: int) -> dict:
    """Open loop: a request every 1/rps seconds for duration_s on the express pool's own queue, whatever the
    answers. Counts served, typed 429 (with or without Retry-After), other outcomes, and no-answers."""
    rng = random.Random(seed)
    tasks: list[asyncio.Task] = []
    sents: list[Sent] = []
    t0 = time.monotonic()
    i = 0
    while (now := time.monotonic()) - t0 < duration_s:
        s = make_request(rng, (alias, alias))
        s.headers = {"X-Lane": "express"}
        sents.append(s)
        tasks.append(asyncio.create_task(request(router, s.path, s.body, bound_s=bound_s, stream=s.stream,
                                                 headers=s.headers, connect_retries=SDK_CONNECT_RETRIES)))
        i += 1
        await asyncio.sleep(max(0.0, t0 + i / rps - time.monotonic()))
    for s, t in zip(sents, tasks):
        s.outcome = await t
    kinds = Counter()
    for s in sents:
        o = s.outcome
        if o.ok:
            kinds["served"] += 1
        elif o.lost:
            kinds["lost"] += 1
        elif o.status == 429 and o.typed_error:
            kinds["429" if o.retry_after else "429_without_retry_after"] += 1
        else:
            kinds[f"other:{o.status}:{o.error_type}"] += 1
    return {"sent": len(sents), "kinds": dict(kinds), "sents": sents}


def overload_examples(o: dict, k: int = 5) -> list[str]:
    """The outcomes of the open loop that were neither served nor a typed 429 with Retry-After."""
    odd = [s for s in o["sents"] if not s.outcome.ok and not (s.outcome.status == 429 and s.outcome.typed_error
                                                              and s.outcome.retry_after)]
    return [f"{s.kind} stream={s.stream}: {s.outcome.describe()}" for s in odd[:k]]


async def main_async(a: argparse.Namespace) -> int:
    aliases = (a.native_alias, a.express_alias)
    bad = 0
    served_all: list[Sent] = []
    async with contextlib.AsyncExitStack() as stack:
        pool = None
        if a.shared_pool:  # the openai SDK's limits; httpx's default 5 s keep-alive expiry
            pool = await stack.enter_async_context(httpx.AsyncClient(
                timeout=httpx.Timeout(a.bound_s + 5, connect=5.0), trust_env=False,
                limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100)))
        for i in range(a.rounds):
            r = await burst_round(a.router, a.n, a.seed + i, aliases=aliases, bound_s=a.bound_s, client=pool,
                                  connect_retries=a.connect_retries)
            print(f"round {i + 1}/{a.rounds}: {summarize(r)}", flush=True)
            for line in examples(r):
                print("  " + line, flush=True)
            c = r["classes"]
            bad += len(c["lost"]) + len(c["broken"]) + len(c["refused_no_node"])
            if a.shared_pool:
                bad += len(c["refused"])
            served_all += c["served"]
    if a.check_exact and served_all:
        key = Path(a.vllm_api_key_file).read_text().strip() if a.vllm_api_key_file else None
        refs = await references(a.prefill, a.model, served_all, headers={"Authorization": f"Bearer {key}"} if key else None)
        inexact = [s for s in served_all if s.outcome.text != refs[s.ref_key()]]
        print(f"exactness: {len(served_all) - len(inexact)}/{len(served_all)} equal to the single server", flush=True)
        for s in inexact[:3]:
            print(f"  inexact: {s.alias} {s.kind}: got {s.outcome.text[:80]!r} want {refs[s.ref_key()]!r:.80}")
        bad += len(inexact)
    if a.overload_s > 0:
        o = await overload(a.router, a.native_alias, a.overload_rps, a.overload_s, a.bound_s, a.seed)
        print(f"overload: {a.overload_rps:g} req/s for {a.overload_s:g}s: sent={o['sent']} {o['kinds']}", flush=True)
        for line in overload_examples(o):
            print("  " + line, flush=True)
        bad += sum(v for k, v in o["kinds"].items() if k not in ("served", "429"))
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--router", default="http://127.0.0.1:8080")
    ap.add_argument("--prefill", default="http://127.0.0.1:8000", help="the single-server reference")
    ap.add_argument("--model", default="tiny-llama", help="the prefill's served model name")
    ap.add_argument("--native-alias", default="tiny-llama")
    ap.add_argument("--express-alias", default="tiny-llama-express")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bound-s", type=float, default=120.0, help="a request without an answer by then is lost")
    ap.add_argument("--connect-retries", type=int, default=SDK_CONNECT_RETRIES,
                    help="tries again of a connect that failed, as the openai SDK's max_retries (0: none)")
    ap.add_argument("--no-check-exact", dest="check_exact", action="store_false")
    ap.add_argument("--vllm-api-key-file", help="vLLM's API key for the reference calls (a closed dev stack: "
                                                 "<state>/secrets/vllm_api_key)")
    ap.add_argument("--shared-pool", action="store_true",
                    help="every request on one pooled client (an SDK's), reused across rounds; any refusal fails")
    ap.add_argument("--overload-s", type=float, default=0.0)
    ap.add_argument("--overload-rps", type=float, default=40.0)
    return asyncio.run(main_async(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
