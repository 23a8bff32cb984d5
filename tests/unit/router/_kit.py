"""Router unit-test kit: a tiny byte-level BPE tokenizer, a config factory, and fake upstreams
(prefill, native decode, express node) behind one httpx.MockTransport that records every call."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from expresslane.router.app import create_app
from expresslane.router.config import RouterConfig, parse_config
from expresslane.router.openai.detokenizer import ModelText

PREFILL = "http://prefill:8000"
NATIVE = "http://native:8100"
EXPRESS = "http://express:5557"
EOS = "<|eos|>"
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello router",
          "once upon a time there was a tiny llama", "stop here STOP now", "tokens and more tokens"] * 4


@pytest.fixture(scope="session")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|bos|>", EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="session")
def eos_id(tokenizer) -> int:
    return tokenizer.token_to_id(EOS)


@pytest.fixture(scope="session")
def model_text(tokenizer, eos_id) -> ModelText:
    return ModelText(tokenizer, frozenset({eos_id}), {"temperature": 0.7})


def config_dict(**over: Any) -> dict:
    d: dict[str, Any] = {
        "prefill": {"url": PREFILL, "model": "served"},
        "tokenizer_dir": "/unused",
        "max_model_len": 64,
        "timeouts": {"connect_s": 1, "prefill_s": 5, "decode_s": 5, "kv_wait_s": 3, "cancel_s": 1},
        "health": {"enabled": False},  # router-path: no background probes unless a test turns them on
        "pools": {
            "native": {"kind": "native", "nodes": [NATIVE]},
            "express": {"kind": "expresslane", "nodes": [{"url": EXPRESS, "ctrl_host": "10.0.0.9", "ctrl_port": 5556}],
                        "busy_retries": 1},
        },
        "aliases": {
            "tiny": {"pool": "native"},
            # unsupported: refuse keeps the lane tests about the express lane itself (capability routing to
            # native, the default, is tested in test_router_capabilities.py).
            "tiny-x": {"pool": "express", "queue": {"max_waiting": 2, "max_wait_s": 0.3, "when_full": "reject"},
                       "unsupported": "refuse"},
            "tiny-xs": {"pool": "express", "queue": {"max_waiting": 0, "max_wait_s": 0, "when_full": "spill",
                                                     "spill_to": "native"}},
        },
    }
    for k, v in over.items():
        d[k] = v
    return d


def make_config(**over: Any) -> RouterConfig:
    return parse_config(config_dict(**over))


def ndjson(*objs: dict) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objs)


def sse_bytes(*objs: Any) -> bytes:
    out = b""
    for o in objs:
        out += b"data: " + (o.encode() if isinstance(o, str) else json.dumps(o).encode()) + b"\n\n"
    return out


class Upstreams:
    """Fake upstream servers. `routes[(base, path)]` is a handler `(request, body) -> httpx.Response`
    (sync or async); every call is recorded in `calls` as (base, path, json body)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.routes: dict[tuple[str, str], Callable[..., Any]] = {}

    def on(self, base: str, path: str, handler: Callable[..., Any]) -> None:
        self.routes[(base, path)] = handler

    def bodies(self, base: str, path: str) -> list[Any]:
        return [b for (ba, p, b) in self.calls if ba == base and p == path]

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        body = json.loads(request.content) if request.content else None
        self.calls.append((base, request.url.path, body))
        handler = self.routes.get((base, request.url.path))
        if handler is None:
            return httpx.Response(404, json={"detail": "no fake route"})
        out = handler(request, body)
        if asyncio.iscoroutine(out):
            out = await out
        return out

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


@pytest.fixture
def upstreams() -> Upstreams:
    return Upstreams()


@pytest.fixture
def make_client(upstreams, model_text):
    """`async with make_client(config) as (client, app)`: the app in-process, lifespan running."""

    @contextlib.asynccontextmanager
    async def factory(config: RouterConfig | None = None, **kw: Any):
        app = create_app(config or make_config(), transport=upstreams.transport, registry=CollectorRegistry(),
                         model_text=model_text, **kw)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                         timeout=10) as client:
                yield client, app

    return factory


def parse_sse(text: str) -> list[Any]:
    """The data payloads of an SSE body, JSON-decoded except the final [DONE] (kept as the string)."""
    assert text.endswith("\n\n"), "SSE body must end with a blank line"
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events
