#!/usr/bin/env python3
"""Smoke-test a running expresslane stack through its router: both lanes, every API shape, greedy exactness.

    python scripts/smoke.py http://127.0.0.1:8080 [--native NAME] [--express NAME-express]
                            [--api-key KEY] [--max-tokens 48] [--users 4] [--timeout 120] [--wait 0]

The lanes' aliases default to what the router lists: the model whose lane is native and its NAME-express (the
shipped router config derives both from the served model's name, e.g. smollm2-135m-instruct).

Checks (one row each in the printed table; exit code 0 only when every row passes):
  health          GET /health answers 200
  models          GET /v1/models lists both aliases, each with a "lane" field (native / express)
  answer          the chat answer of each lane, printed in full after the table (the default model is real:
                  it answers the question)
  chat            POST /v1/chat/completions, non-streaming, per lane: text and usage come back
  completions     POST /v1/completions, non-streaming, per lane
  chat-stream     the same chat request streamed (SSE, ends with [DONE]): the same text as non-streaming
  compl-stream    the same completion streamed: the same text as non-streaming
  exact-chat      temperature 0: express text == native text (token-identical greedy decoding)
  exact-compl     the same for /v1/completions
  users           --users N (default 4) users on the express lane at once, each its own question at temperature
                  0: every answer is the one its question gets alone (a node of several seats decodes them in one
                  step each; its tokens must not depend on the others)
  metrics         GET /metrics answers Prometheus text

Dependencies: the Python standard library only (urllib, json), so a bare `python3` runs it on any machine, and
so does `docker compose run --rm smoke` (the compose service of the same name). ROUTER_API_KEY in the
environment is used when --api-key is not given (the router only checks it when it is configured with one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

PROMPT_CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPT_COMPLETION = "The quick brown fox jumps over the lazy dog. Once upon a time"
USER_QUESTIONS = ["Name three primary colours.", "What is twelve times twelve?", "Write a haiku about the sea.",
                  "Give one word that means fast.", "Which planet is the largest?", "Say hello in Spanish.",
                  "What is the boiling point of water in Celsius?", "Name a famous painter."]


class CheckFailed(Exception):
    """A check's expectation did not hold; the message says what was seen."""


class TransportError(Exception):
    """The router could not be reached or the connection broke (refused, reset, timed out)."""


@dataclasses.dataclass
class Response:
    status: int
    headers: dict[str, str]
    text: str

    def json(self) -> dict:
        try:
            return json.loads(self.text)
        except json.JSONDecodeError as exc:
            raise CheckFailed(f"not JSON ({exc}): {self.text[:200]!r}") from None


@dataclasses.dataclass
class Client:
    """A few HTTP calls on urllib: one base URL, fixed headers, one per-request timeout (connect and each read)."""

    base_url: str
    headers: dict[str, str]
    timeout_s: float

    def _request(self, method: str, path: str, body: dict | None):
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self.headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:  # a status >= 400: an answer, not a transport failure
            return exc
        except (urllib.error.URLError, OSError) as exc:
            raise TransportError(f"{method} {path}: {getattr(exc, 'reason', exc)}") from None

    def call(self, method: str, path: str, body: dict | None = None) -> Response:
        resp = self._request(method, path, body)
        with resp:
            try:
                raw = resp.read()
            except OSError as exc:
                raise TransportError(f"{method} {path}: reading the body: {exc}") from None
            return Response(resp.status, {k.lower(): v for k, v in resp.headers.items()},
                            raw.decode("utf-8", "replace"))

    def get(self, path: str) -> Response:
        return self.call("GET", path)

    def post(self, path: str, body: dict) -> Response:
        return self.call("POST", path, body)

    def stream_lines(self, path: str, body: dict) -> Iterator[str]:
        """POST and yield the response's lines as they arrive; a status other than 200 raises CheckFailed."""
        resp = self._request("POST", path, body)
        with resp:
            if resp.status != 200:
                raise CheckFailed(f"HTTP {resp.status}: {resp.read().decode('utf-8', 'replace')[:200]}")
            ctype = resp.headers.get("content-type", "")
            if not ctype.startswith("text/event-stream"):
                raise CheckFailed(f"content-type {ctype!r}, expected text/event-stream")
            try:
                for raw in resp:
                    yield raw.decode("utf-8", "replace").rstrip("\r\n")
            except OSError as exc:
                raise TransportError(f"POST {path}: stream broke: {exc}") from None


@dataclasses.dataclass
class Row:
    check: str
    lane: str
    ok: bool
    detail: str
    seconds: float


@dataclasses.dataclass
class Smoke:
    client: Client
    native: str | None  # None: the router's native alias (discovered by the models check)
    express: str | None  # None: NATIVE-express
    max_tokens: int
    users_at_once: int = 4
    rows: list[Row] = dataclasses.field(default_factory=list)
    texts: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)

    # ---- plumbing ---------------------------------------------------------------------------------------
    def run(self, check: str, lane: str, fn: Callable[[], str]) -> None:
        t0 = time.monotonic()
        try:
            detail, ok = fn(), True
        except CheckFailed as exc:
            detail, ok = str(exc), False
        except TransportError as exc:
            detail, ok = f"{type(exc).__name__}: {exc}", False
        self.rows.append(Row(check, lane, ok, detail, time.monotonic() - t0))

    def post(self, path: str, body: dict) -> dict:
        resp = self.client.post(path, body)
        if resp.status != 200:
            raise CheckFailed(f"HTTP {resp.status}: {resp.text[:200]}")
        return resp.json()

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        done = False
        for line in self.client.stream_lines(path, {**body, "stream": True}):
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                event = json.loads(data)
            except json.JSONDecodeError:
                raise CheckFailed(f"event is not JSON: {data[:200]!r}") from None
            if "error" in event:
                raise CheckFailed(f"error event: {json.dumps(event['error'])[:200]}")
            yield event
        if not done:
            raise CheckFailed("stream ended without data: [DONE]")

    def chat_body(self, model: str) -> dict:
        return {"model": model, "messages": PROMPT_CHAT, "max_tokens": self.max_tokens, "temperature": 0}

    def completion_body(self, model: str) -> dict:
        return {"model": model, "prompt": PROMPT_COMPLETION, "max_tokens": self.max_tokens, "temperature": 0}

    # ---- checks -----------------------------------------------------------------------------------------
    def health(self) -> str:
        resp = self.client.get("/health")
        if resp.status != 200:
            raise CheckFailed(f"HTTP {resp.status}: {resp.text[:200]}")
        return "200"

    def models(self) -> str:
        resp = self.client.get("/v1/models")
        if resp.status != 200:
            raise CheckFailed(f"HTTP {resp.status}: {resp.text[:200]}")
        listed = {m.get("id"): m for m in resp.json().get("data", [])}
        if self.native is None:
            natives = sorted(i for i, m in listed.items() if m.get("lane") == "native" and f"{i}-express" in listed)
            if not natives:
                raise CheckFailed(f"no native alias NAME with a NAME-express beside it (listed: {sorted(listed)}); "
                                  f"name them with --native / --express")
            self.native = natives[0]
        self.express = self.express or f"{self.native}-express"
        want = {self.native: "native", self.express: "express"}
        problems = []
        for alias, lane in want.items():
            if alias not in listed:
                problems.append(f"{alias} missing")
            elif listed[alias].get("lane") != lane:
                problems.append(f"{alias} lane={listed[alias].get('lane')!r}, expected {lane!r}")
        if problems:
            raise CheckFailed("; ".join(problems) + f" (listed: {sorted(listed)})")
        return ", ".join(f"{a}:{lane}" for a, lane in want.items())

    def chat(self, lane: str, model: str) -> str:
        out = self.post("/v1/chat/completions", self.chat_body(model))
        text = _one_choice(out)["message"].get("content") or ""
        _require_text(text, out)
        self.texts[("chat", lane)] = text
        return f"{out.get('usage', {}).get('completion_tokens', '?')} tok: {_clip(text)}"

    def completions(self, lane: str, model: str) -> str:
        out = self.post("/v1/completions", self.completion_body(model))
        text = _one_choice(out).get("text") or ""
        _require_text(text, out)
        self.texts[("compl", lane)] = text
        return f"{out.get('usage', {}).get('completion_tokens', '?')} tok: {_clip(text)}"

    def chat_stream(self, lane: str, model: str) -> str:
        parts = [c["delta"].get("content") or "" for e in self.stream("/v1/chat/completions", self.chat_body(model))
                 for c in e.get("choices", []) if "delta" in c]
        return self._same_as_unary("chat", lane, "".join(parts), len(parts))

    def compl_stream(self, lane: str, model: str) -> str:
        parts = [c.get("text") or "" for e in self.stream("/v1/completions", self.completion_body(model))
                 for c in e.get("choices", [])]
        return self._same_as_unary("compl", lane, "".join(parts), len(parts))

    def _same_as_unary(self, kind: str, lane: str, streamed: str, chunks: int) -> str:
        unary = self.texts.get((kind, lane))
        if unary is None:
            raise CheckFailed("no non-streaming text to compare with (that check failed)")
        if streamed != unary:
            raise CheckFailed(f"streamed text differs: {_clip(streamed)!r} vs {_clip(unary)!r}")
        return f"{chunks} chunks, same text"

    def exact(self, kind: str) -> str:
        native, express = self.texts.get((kind, "native")), self.texts.get((kind, "express"))
        if native is None or express is None:
            raise CheckFailed("a lane's text is missing (its check failed)")
        if native != express:
            at = next((i for i, (a, b) in enumerate(zip(native, express)) if a != b), min(len(native), len(express)))
            raise CheckFailed(f"differs at char {at}: native {native[at:at + 24]!r} express {express[at:at + 24]!r}")
        return f"{len(native)} chars identical"

    def users(self, model: str, n: int) -> str:
        """n users on one lane at once, each its own question: each answer equals its question's answer alone."""
        bodies = [{"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": self.max_tokens,
                   "temperature": 0} for q in (USER_QUESTIONS * n)[:n]]
        together: list[object] = [None] * n
        spans: list[tuple[float, float]] = [(0.0, 0.0)] * n

        def one(i: int) -> None:
            t0 = time.monotonic()
            try:
                together[i] = _one_choice(self.post("/v1/chat/completions", bodies[i]))["message"].get("content")
            except (CheckFailed, TransportError) as exc:
                together[i] = exc
            spans[i] = (t0, time.monotonic())

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [(i, r) for i, r in enumerate(together) if isinstance(r, Exception)]
        if failed:
            i, exc = failed[0]
            raise CheckFailed(f"{len(failed)} of {n} users failed; user {i}: {type(exc).__name__}: {exc}")
        for i, body in enumerate(bodies):  # the same questions one at a time
            alone = _one_choice(self.post("/v1/chat/completions", body))["message"].get("content")
            if alone != together[i]:
                raise CheckFailed(f"user {i}: with {n - 1} others {_clip(str(together[i]))!r}, "
                                  f"alone {_clip(str(alone))!r}")
        overlap = min(end for _, end in spans) - max(start for start, _ in spans)
        return f"{n} at once (all in flight together {max(0.0, overlap):.1f} s): each answer = its answer alone"

    def metrics(self) -> str:
        resp = self.client.get("/metrics")
        if resp.status != 200:
            raise CheckFailed(f"HTTP {resp.status}")
        families = sum(1 for line in resp.text.splitlines() if line.startswith("# TYPE"))
        if families == 0:
            raise CheckFailed("no '# TYPE' lines: not Prometheus text")
        return f"{families} metric families"

    def all(self) -> None:
        self.run("health", "-", self.health)
        self.run("models", "-", self.models)
        if self.native is None:  # the models check failed: nothing to ask
            return
        lanes = {"native": self.native, "express": self.express}
        for lane, model in lanes.items():
            self.run("chat", lane, lambda lane=lane, model=model: self.chat(lane, model))
            self.run("completions", lane, lambda lane=lane, model=model: self.completions(lane, model))
            self.run("chat-stream", lane, lambda lane=lane, model=model: self.chat_stream(lane, model))
            self.run("compl-stream", lane, lambda lane=lane, model=model: self.compl_stream(lane, model))
        self.run("exact-chat", "both", lambda: self.exact("chat"))
        self.run("exact-compl", "both", lambda: self.exact("compl"))
        if self.users_at_once > 0:
            self.run("users", "express", lambda: self.users(self.express, self.users_at_once))
        self.run("metrics", "-", self.metrics)


def _one_choice(out: dict) -> dict:
    choices = out.get("choices") or []
    if len(choices) != 1:
        raise CheckFailed(f"{len(choices)} choices: {json.dumps(out)[:200]}")
    return choices[0]


def _require_text(text: str, out: dict) -> None:
    if not text.strip():
        raise CheckFailed(f"empty text: {json.dumps(out)[:200]}")


def _clip(text: str, n: int = 40) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= n else text[: n - 3] + "..."


def wait_healthy(client: Client, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if client.get("/health").status == 200:
                return
        except TransportError:
            pass
        time.sleep(2)


def print_table(rows: list[Row]) -> None:
    headers = ("check", "lane", "result", "time", "detail")
    cells = [(r.check, r.lane, "PASS" if r.ok else "FAIL", f"{r.seconds:.2f}s", r.detail) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers[:-1])]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    print(fmt.format(*headers))
    print(fmt.format(*("-" * w for w in widths), "-" * 6))
    for c in cells:
        print(fmt.format(*c))


def print_answers(smoke: Smoke) -> None:
    """Each lane's whole chat answer: what a user of the stack gets back."""
    print(f"\nQ: {PROMPT_CHAT[-1]['content']}")
    for lane, model in (("native", smoke.native), ("express", smoke.express)):
        text = smoke.texts.get(("chat", lane))
        print(f"A ({lane} lane, {model}): " + (" ".join(text.split()) if text is not None else "(no answer)"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("router_url", help="e.g. http://127.0.0.1:8080")
    ap.add_argument("--native", default=None, help="native-lane alias (default: the router's native model)")
    ap.add_argument("--express", default=None, help="express-lane alias (default: NATIVE-express)")
    ap.add_argument("--api-key", default=os.environ.get("ROUTER_API_KEY", ""), help="bearer key (env ROUTER_API_KEY)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--users", type=int, default=4, help="users at once on the express lane (0: skip the check)")
    ap.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    ap.add_argument("--wait", type=float, default=0.0, help="first wait up to this many seconds for /health")
    args = ap.parse_args(argv)

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = Client(args.router_url.rstrip("/"), headers, args.timeout)
    if args.wait:
        wait_healthy(client, args.wait)
    smoke = Smoke(client, args.native, args.express, args.max_tokens, args.users)
    smoke.all()
    print_table(smoke.rows)
    print_answers(smoke)
    failed = sum(not r.ok for r in smoke.rows)
    print(f"\n{len(smoke.rows) - failed}/{len(smoke.rows)} passed" + (f", {failed} FAILED" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
