"""The load client: token-id prompts, streaming completions timed per chunk, closed-loop concurrency."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence

import httpx

from .stats import RequestResult

__all__ = ["token_prompt", "completion_body", "stream_one", "run_closed_loop", "timed_post"]

SPECIAL_IDS = 16  # ids below this (and the top 16 of the vocab) are never used in prompts


def token_prompt(length: int, key: str, vocab: int) -> list[int]:
    """`length` pseudo-random token ids, a pure function of `key`. Every request of a run gets its own key
    (run nonce + scenario + index) so vLLM's prefix cache never shortens a measured prefill."""
    rng = random.Random(key)
    return [rng.randrange(SPECIAL_IDS, vocab - SPECIAL_IDS) for _ in range(length)]


def completion_body(model: str, prompt: list[int], max_tokens: int, *, stream: bool) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None) -> RequestResult:
    """POST a streaming completion; record the arrival time of every chunk that carries text."""
    res = RequestResult(sent_at=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300].decode(errors='replace')}"
                return res
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except ValueError:
                    res.error = f"bad SSE event {data[:120]!r}"
                    break
                if "error" in obj:
                    res.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    break
                for choice in obj.get("choices") or ():
                    if choice.get("text"):
                        res.chunk_times.append(now)
                        break
                usage = obj.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    res.completion_tokens = usage["completion_tokens"]
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.finished_at = time.perf_counter()
    return res


async def run_closed_loop(url: str, bodies: Sequence[dict], concurrency: int, *, headers: dict | None = None,
                          timeout_s: float = 900.0) -> tuple[list[RequestResult], float]:
    """`concurrency` users, each sending its next request as soon as its previous one finished, until
    `bodies` are used up. Returns the results (in body order) and the wall time."""
    results: list[RequestResult | None] = [None] * len(bodies)
    next_index = 0
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits,
                                 trust_env=False) as client:

        async def user() -> None:
            nonlocal next_index
            while next_index < len(bodies):
                i = next_index
                next_index += 1
                results[i] = await stream_one(client, url, bodies[i], headers)

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall


def timed_post(client: httpx.Client, url: str, body: dict) -> tuple[float, dict | None, str | None]:
    """(seconds, JSON reply or None, error or None) of one non-streaming POST."""
    t0 = time.perf_counter()
    try:
        r = client.post(url, json=body)
    except httpx.HTTPError as e:
        return time.perf_counter() - t0, None, f"{type(e).__name__}: {e}"
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        return dt, None, f"HTTP {r.status_code}: {r.text[:300]}"
    try:
        return dt, r.json(), None
    except ValueError:
        return dt, None, "reply is not JSON"
