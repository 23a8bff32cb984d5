"""The express node with its REAL receiver (control plane + NIXL WRITE on localhost): a prefill-side
KVSender ships a reference engine's prompt KV; /pd/decode continues it token-identically."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("nixl")

from expresslane.engine.decode import DecodeEngine, SamplingParams  # noqa: E402
from expresslane.engine.protocol.layout import KVLayoutSpec  # noqa: E402
from expresslane.engine.server import ServerConfig, create_app  # noqa: E402
from expresslane.engine.server.receiver import build_receiver  # noqa: E402
from expresslane.engine.transfer.nixl_transport import NixlEndpoint  # noqa: E402
from expresslane.engine.transfer.sender import KVSender, SenderConfig, SendJob  # noqa: E402
from expresslane.engine.transfer.staging import StagingPool  # noqa: E402

from ._models import build_model  # noqa: E402
from ._live import LiveServer  # noqa: E402

MAX_SEQ = 256
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 100, 101]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("nixl-model")
    build_model(model_dir, "qwen3")
    reference = DecodeEngine.from_pretrained(model_dir, max_seq_len=MAX_SEQ)
    engine = DecodeEngine.from_pretrained(model_dir, max_seq_len=MAX_SEQ)
    config = ServerConfig(model=str(model_dir), max_seq_len=MAX_SEQ, host="127.0.0.1", ctrl_port=_free_port(),
                          kv_timeout_s=10)
    app = create_app(config, engine, build_receiver(config, engine))
    g = engine.geometry
    layout = KVLayoutSpec(g.num_layers, g.num_kv_heads, g.head_dim, "float32", MAX_SEQ)
    pool = StagingPool(1, layout.request_nbytes(MAX_SEQ))
    endpoint = NixlEndpoint("test-prefill-engine")
    sender = KVSender(endpoint, endpoint.register(pool.buffer), layout, config=SenderConfig(io_timeout_s=5))
    with LiveServer(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client, reference, pool, sender, layout, config


def _reserve(client, rid: str) -> None:
    r = client.post("/pd/reserve", json={"rid": rid, "ttl_s": 10})
    assert r.status_code == 200, r.text


def _prefill_and_send(stack, rid: str) -> int:
    client, reference, pool, sender, layout, config = stack
    first = int(reference.prefill(PROMPT).argmax())
    n = len(PROMPT)
    slot = pool.acquire()
    g = reference.geometry
    k, v = slot.dense_kv(g.num_layers, n, g.num_kv_heads, g.head_dim, g.dtype)
    k.copy_(reference.cache.k[:, :n])
    v.copy_(reference.cache.v[:, :n])
    sender.send(SendJob(rid=rid, host="127.0.0.1", port=config.ctrl_port, num_tokens=n, slot=slot,
                        nbytes=layout.request_nbytes(n)))
    return first


def _expected(reference, first, n):
    reference.prefill(PROMPT)
    return list(reference.generate(first, len(PROMPT), SamplingParams(max_tokens=n, ignore_eos=True)))


def test_kv_sent_before_decode_request(stack):
    client, reference, *_ = stack
    _reserve(client, "nixl-1")
    first = _prefill_and_send(stack, "nixl-1")
    r = client.post("/pd/decode", json={"rid": "nixl-1", "first_token_id": first, "max_tokens": 20,
                                        "sampling": {"temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert r.json()["token_ids"] == _expected(reference, first, 20)


def test_decode_request_waits_for_kv(stack):
    client, reference, *_ = stack
    first = int(reference.prefill(PROMPT).argmax())
    _reserve(client, "nixl-2")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", client.post("/pd/decode", json={
        "rid": "nixl-2", "first_token_id": first, "max_tokens": 12, "stream": False,
        "sampling": {"temperature": 0, "ignore_eos": True}})))
    t.start()
    deadline = time.monotonic() + 20
    while client.get("/decode_status").json().get("phase") != "waiting_kv":  # the node holds it, no KV yet
        assert time.monotonic() < deadline, "the node never started waiting for the KV"
        time.sleep(0.01)
    t_seen = time.monotonic()
    time.sleep(0.2)
    t_send = time.monotonic()  # no KV can land before this: the sender has not started
    _prefill_and_send(stack, "nixl-2")
    t.join(20)
    out = result["r"].json()
    assert out["token_ids"] == _expected(reference, first, 12)
    # Causal, not a speed bound: the node was waiting by t_seen and the KV was sent after t_send.
    assert out["timing_ms"]["wire_wait"] >= (t_send - t_seen) * 1000
    assert client.get("/decode_status").json()["state"] == "idle"
