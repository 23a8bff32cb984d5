"""Helpers of the fault tests (test_faults.py) and the chaos soak (scripts/soak.py): a client that records
what each request got within an explicit bound, Prometheus scraping, a router process of our own, and a
black-hole control-plane peer (a real socket that accepts and never answers).

Nothing here fakes a component: requests go over real sockets to real processes, faults are real signals
(scripts/dev_stack.py DevStack.kill / pause / resume / restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


# ---- one request, recorded -------------------------------------------------------------------------------
# Every request below is its own client (its own connection, closed when it is abandoned), as separate users are;
# they share one TLS context. httpx builds a fresh one per client by loading the CA bundle: 23 ms of CPU, in the
# event loop, measured here. A burst of 256 requests spent 6 s (idle box) to 20 s (loaded CI runner) of the loop
# building clients, so the first connects outlived their own 5 s connect timeout (ConnectTimeout at 22.9 s,
# 2026-12-05 CI): the harness failing, not the router.
_TLS = ssl.create_default_context()


@dataclass
class Outcome:
    """What one client request got. `lost`: no complete answer within the bound (the client gave up)."""

    status: int | None = None
    elapsed_s: float = 0.0
    first_token_s: float | None = None  # first chunk carrying text (streams)
    text: str = ""
    chunks: int = 0
    done: bool = False  # stream ended with data: [DONE]
    error_type: str | None = None  # error.type of a JSON error body or of an SSE error event
    error: str | None = None
    retry_after: str | None = None
    finish_reason: str | None = None
    lost: bool = False
    disconnected: bool = False  # we closed it on purpose (disconnect_after_s)
    body: Any = None
    connect_failures: list[str] = field(default_factory=list)  # connects retried (request(connect_retries=...))

    @property
    def ok(self) -> bool:
        """A complete, successful answer: 200, no error event, [DONE] for streams."""
        return self.status == 200 and self.error_type is None and not self.lost and not self.disconnected

    @property
    def typed_error(self) -> bool:
        """A failure the client can act on: an OpenAI-style error body / SSE error event with a type."""
        return not self.lost and self.error_type is not None

    def describe(self) -> str:
        parts = [f"status={self.status}", f"{self.elapsed_s:.2f}s"]
        if self.first_token_s is not None:
            parts.append(f"first_token={self.first_token_s:.2f}s")
        if self.error_type or self.error:
            parts.append(f"error={self.error_type}: {(self.error or '')[:160]!r}")
        if self.retry_after is not None:
            parts.append(f"retry_after={self.retry_after}")
        parts.append(f"chunks={self.chunks} done={self.done} lost={self.lost} text_len={len(self.text)}")
        if self.disconnected:
            parts.append("disconnected-by-client")
        if self.connect_failures:
            parts.append(f"connect retried after: {'; '.join(self.connect_failures)}")
        return " ".join(parts)


def _error_of(obj: Any) -> tuple[str | None, str | None]:
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        err = obj["error"]
        return str(err.get("type") or err.get("code") or "error"), str(err.get("message"))
    if isinstance(obj, dict) and isinstance(obj.get("error"), str):
        return str(obj.get("error_type") or obj["error"]), str(obj.get("detail") or obj["error"])
    return None, None


async def request(base: str, path: str, body: dict, *, bound_s: float, stream: bool | None = None,
                  disconnect_after_s: float | None = None, on_chunk: Callable[[int], None] | None = None,
                  headers: dict[str, str] | None = None, client: httpx.AsyncClient | None = None,
                  connect_retries: int = 0) -> Outcome:
    """POST `body` and record the outcome. The request is abandoned (the connection closed, as a client
    with a timeout does) after `bound_s` -> lost, or on purpose after `disconnect_after_s` -> disconnected.
    `on_chunk(n)` runs after the n-th text chunk of a stream (a place to inject a fault). `client`: a pooled client
    to send it on (its idle connections reused, as an SDK's are); default: a client of its own.
    `connect_retries`: how often a connect that failed (ConnectError / ConnectTimeout: nothing was sent) is tried
    again, after 0.5 s, 1 s, ... as the openai SDK does (its default: 2); each one is recorded in
    `connect_failures`. Nothing else is retried: a failure after the connect is the outcome."""
    stream = bool(body.get("stream")) if stream is None else stream
    body = dict(body, stream=stream)
    out = Outcome()
    t0 = time.monotonic()

    async def run() -> None:
        async with contextlib.AsyncExitStack() as stack:
            c = client if client is not None else await stack.enter_async_context(httpx.AsyncClient(
                timeout=httpx.Timeout(bound_s + 5, connect=5.0), trust_env=False, verify=_TLS))
            attempt = 0
            while True:
                try:
                    r = await stack.enter_async_context(c.stream("POST", base + path, json=body, headers=headers))
                    break
                except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                    if attempt >= connect_retries:
                        raise
                    out.connect_failures.append(f"{type(e).__name__} at {time.monotonic() - t0:.2f}s")
                    await asyncio.sleep(min(8.0, 0.5 * 2 ** attempt))
                    attempt += 1
            out.status = r.status_code
            out.retry_after = r.headers.get("retry-after")
            if not stream or r.status_code != 200 or not r.headers.get("content-type", "").startswith(
                    "text/event-stream"):
                raw = await r.aread()
                try:
                    out.body = json.loads(raw)
                except ValueError:
                    out.body = raw.decode("utf-8", "replace")
                out.error_type, out.error = _error_of(out.body)
                if out.status == 200 and out.error_type is None and isinstance(out.body, dict):
                    choice = (out.body.get("choices") or [{}])[0]
                    out.text = choice.get("text") if "text" in choice else (
                        (choice.get("message") or {}).get("content") or "")
                    out.finish_reason = choice.get("finish_reason")
                elif out.status != 200 and out.error_type is None:
                    out.error = str(out.body)[:300]
                return
            async for line in r.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    out.error_type, out.error = "bad_sse", line[:200]
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    out.done = True
                    continue
                chunk = json.loads(payload)
                etype, emsg = _error_of(chunk)
                if etype is not None:
                    out.error_type, out.error = etype, emsg
                    continue
                for choice in chunk.get("choices") or []:
                    piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get(
                        "content")
                    if piece:
                        out.text += piece
                        out.chunks += 1
                        if out.first_token_s is None:
                            out.first_token_s = time.monotonic() - t0
                        if on_chunk is not None:
                            on_chunk(out.chunks)
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
            if not out.done and out.error_type is None:
                out.error_type, out.error = "truncated", "stream ended without data: [DONE]"

    limit = bound_s if disconnect_after_s is None else min(bound_s, disconnect_after_s)
    try:
        await asyncio.wait_for(run(), limit)
    except asyncio.TimeoutError:
        if disconnect_after_s is not None and disconnect_after_s <= bound_s:
            out.disconnected = True
        else:
            out.lost = True
    except (httpx.HTTPError, OSError) as e:
        out.error_type, out.error = "transport", f"{type(e).__name__}: {e}"
    out.elapsed_s = time.monotonic() - t0
    return out


def run(coro):
    """Run one coroutine to completion from synchronous code."""
    return asyncio.run(coro)


async def greedy_references(prefill: str, model: str, todo: dict[str, tuple[str, dict]], *, parallel: int,
                            timeout_s: float, headers: dict[str, str] | None = None) -> dict[str, str | None]:
    """The single server's greedy answer to each request of `todo` (key -> (kind: completion | chat, body)), asked
    of `prefill` (a plain vLLM) non-streaming, `parallel` at a time; None for one it could not answer (the soak's
    and the burst's exactness references)."""
    out: dict[str, str | None] = {}
    sem = asyncio.Semaphore(parallel)
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False, headers=headers, verify=_TLS) as client:
        async def one(key: str, kind: str, body: dict) -> None:
            path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
            async with sem:
                try:
                    r = await client.post(prefill + path, json=dict(body, model=model, stream=False))
                except httpx.HTTPError:
                    out[key] = None
                    return
            if r.status_code != 200:
                out[key] = None
                return
            choice = r.json()["choices"][0]
            out[key] = choice["text"] if kind == "completion" else choice["message"]["content"]

        await asyncio.gather(*(one(k, kind, body) for k, (kind, body) in todo.items()))
    return out


#: The widest gap (nats) between the single server's token and the one a lane chose instead at their first
#: difference that still counts as a float32 rounding tie: two implementations of the same float32 model (vLLM's
#: kernels, ours) sum in other orders, and where the top two logits lie within that rounding (0.0004 apart at
#: 86.28 in the one such case seen, a burst of 768 on the CPU, 2026-12-05) greedy can take either. A wrong K/V or
#: position diverges where the gap is wide.
TIE_NATS = 0.01


async def first_difference_is_a_tie(prefill: str, model: str, kind: str, body: dict, got: str,
                                    headers: dict[str, str] | None = None, timeout_s: float = 300) -> tuple[bool, str]:
    """Whether `got` (a lane's greedy answer to `body`) leaves the single server's answer only at a rounding tie:
    the server's own greedy answer with its top-5 logprobs, walked token by token; at the first token whose text
    `got` does not continue, the text `got` continues with must be one of the server's alternatives there, within
    TIE_NATS of the server's token. Returns (tie, what was found)."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    extra = {"logprobs": True, "top_logprobs": 5} if kind == "chat" else {"logprobs": 5}
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False, headers=headers, verify=_TLS) as client:
        r = await client.post(prefill + path, json=dict(body, model=model, stream=False, **extra))
    if r.status_code != 200:
        return False, f"the reference with logprobs failed: {r.status_code} {r.text[:200]}"
    lp = r.json()["choices"][0]["logprobs"]
    if kind == "chat":
        steps = [(c["token"], c["logprob"], {t["token"]: t["logprob"] for t in c["top_logprobs"]})
                 for c in lp["content"]]
    else:
        steps = list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
    return tie_at_first_difference(steps, got)


def tie_at_first_difference(steps: list[tuple[str, float, dict[str, float]]], got: str) -> tuple[bool, str]:
    """first_difference_is_a_tie's walk over the server's steps (its token, that token's logprob, the top
    alternatives' logprobs by token)."""
    done = ""
    for i, (token, logprob, top) in enumerate(steps):
        if got.startswith(done + token):
            done += token
            continue
        rest = got[len(done):]
        near = {alt: logprob - alp for alt, alp in top.items()
                if alt != token and alt and rest.startswith(alt) and logprob - alp <= TIE_NATS}
        where = f"token {i} after {done[-24:]!r}: the server's {token!r} ({logprob:.5f})"
        if near:
            alt, gap = min(near.items(), key=lambda kv: kv[1])
            return True, f"{where}, the lane's {alt!r} {gap:.5f} nats below it"
        return False, f"{where}; the lane went on with {rest[:16]!r}, not within {TIE_NATS} nats: {top}"
    return got == done, "the server's answer with logprobs is the lane's" if got == done else "the lane's is longer"


# ---- Prometheus text --------------------------------------------------------------------------------------
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(url: str, timeout_s: float = 5.0) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of `url` (a /metrics URL): (name, labels, value). [] when the endpoint does not answer."""
    try:
        text = httpx.get(url, timeout=timeout_s, trust_env=False).text
    except httpx.HTTPError:
        return []
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            try:
                value = float(m.group(3))
            except ValueError:
                continue
            out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), value))
    return out


def metric(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float | None:
    """Sum of the samples named `name` whose labels include `labels`; None when no such sample exists."""
    found = [v for n, lab, v in samples if n == name and all(lab.get(k) == str(x) for k, x in labels.items())]
    return sum(found) if found else None


def wait_until(cond: Callable[[], Any], timeout_s: float, interval_s: float = 0.1) -> tuple[Any, float]:
    """Poll `cond` until it returns something truthy; (that value, seconds waited). (None, waited) on timeout."""
    t0 = time.monotonic()
    while True:
        value = cond()
        if value:
            return value, time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            return None, time.monotonic() - t0
        time.sleep(interval_s)


# ---- a router process of our own -------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RouterProcess:
    """`python -m expresslane.router --config FILE` on a loopback port (a real process, own config)."""

    config_text: str
    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "RouterProcess":
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "router.yaml"
        cfg.write_text(self.config_text.replace("@PORT@", str(self.port)))
        log = open(self.workdir / "router.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "expresslane.router", "--config", str(cfg)],
                                     stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"router did not start in {timeout_s}s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, lines: int = 60) -> str:
        path = self.workdir / "router.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


# ---- a control-plane peer that accepts and never answers ---------------------------------------------------
class BlackHolePeer:
    """A TCP listener on loopback that accepts connections and never sends a byte: a decode node's control
    port whose process hangs. A prefill's sender that ships KV here holds its staging slot until its own
    timeouts give up (what the staging-exhaustion test needs)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self.sock.settimeout(0.2)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            self.accepted.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for c in self.accepted:
            c.close()
        self.sock.close()
