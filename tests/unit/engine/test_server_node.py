"""The express node off the happy path: reservations (expiry, cancel, 409), no orphaned KV, health (503 naming
the failing check), fast KV-failure (502 at once), the stall watchdog and the deadline, bearer-token auth, the
capability features. Real DecodeEngine + LocalKVSource (with the receiver's admission rule) behind uvicorn."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest

from expresslane.engine.decode import DecodeEngine
from expresslane.engine.server import LocalKVSource, ServerConfig, create_app

from ._live import LiveServer
from ._models import build_model
from .test_server import MAX_SEQ, PROMPT, body, metric, read_ndjson, status_of, wait_idle

TOKEN = "node-token-for-tests"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("node-model")
    build_model(out, "qwen2")
    return out


@pytest.fixture(scope="module")
def reference(model_dir):
    return DecodeEngine.from_pretrained(model_dir, max_seq_len=MAX_SEQ)


@contextlib.contextmanager
def make_node(model_dir, **overrides):
    engine = DecodeEngine.from_pretrained(model_dir, max_seq_len=MAX_SEQ)
    source = LocalKVSource()
    config = ServerConfig(model=str(model_dir), max_seq_len=MAX_SEQ, kv_timeout_s=5.0, warmup=False,
                          **{"health_interval_s": 0.1, **overrides})
    app = create_app(config, engine, source)
    headers = {"authorization": f"Bearer {config.node_token}"} if config.node_token else {}
    with LiveServer(app) as url, httpx.Client(base_url=url, timeout=30, headers=headers) as client:
        yield client, source, engine, app


@pytest.fixture(scope="module")
def node(model_dir):
    with make_node(model_dir, reservation_ttl_s=2.0) as n:
        yield n


def kv(reference, prompt=PROMPT):
    first = int(reference.prefill(prompt).argmax())
    n = len(prompt)
    return first, reference.cache.k[:, :n].clone(), reference.cache.v[:, :n].clone()


def reserve(client, rid, ttl_s=2.0):
    return client.post("/pd/reserve", json={"rid": rid, "ttl_s": ttl_s})


def post_in_background(client, payload) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def go():
        t0 = time.monotonic()
        out["r"] = client.post("/pd/decode", json=payload)
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=go)
    t.start()
    return t, out


def wait_phase(client, phase, within_s=5.0):
    t0 = time.monotonic()
    while client.get("/decode_status").json().get("phase") != phase:
        assert time.monotonic() - t0 < within_s, f"never reached {phase}"
        time.sleep(0.01)


# ---------------------------------------------------------------- reservations
def test_reserve_caps_ttl_and_refuses_another_rid(node):
    client, source, _, _ = node
    r = reserve(client, "res-a", ttl_s=100)
    assert r.status_code == 200 and r.json() == {"rid": "res-a", "reserved": True, "ttl_s": 2.0, "seat": 0}
    assert source.expected("res-a")
    other = reserve(client, "res-b")
    assert other.status_code == 429 and other.json()["error"] == "busy" and other.headers["retry-after"] == "1"
    assert reserve(client, "res-a", ttl_s=1).status_code == 200  # a retry of the holder refreshes it
    assert client.post("/pd/cancel", json={"rid": "res-a"}).json() == {"rid": "res-a", "cancelled": True}
    assert not source.expected("res-a") and ("cancel", "res-a") in source.calls
    assert client.get("/decode_status").json()["state"] == "idle"


def test_reservation_expires_frees_slot_and_refuses_late_kv(node, reference):
    client, source, _, _ = node
    expired = metric(client, "expresslane_decode_reservations_total", 'outcome="expired"')
    assert reserve(client, "res-exp", ttl_s=0.3).status_code == 200
    wait_idle(client, within_s=2.0)  # the node's timer expires it, nobody has to ask
    assert metric(client, "expresslane_decode_reservations_total", 'outcome="expired"') == expired + 1
    first, k, v = kv(reference)
    refused = source.stats["refused_unknown_rid"]
    assert source.put("res-exp", k, v) is False  # late KV does not land
    assert source.stats["refused_unknown_rid"] == refused + 1
    r = client.post("/pd/decode", json=body("res-exp", first))
    assert r.status_code == 409 and r.json()["error"] == "not_reserved"


def test_a_cancelled_rid_is_refused_by_the_receiver_when_reserved_again(node):
    client, source, _, _ = node
    refused = metric(client, "expresslane_decode_reservations_total", 'outcome="refused"')
    assert reserve(client, "once").status_code == 200
    client.post("/pd/cancel", json={"rid": "once"})
    again = reserve(client, "once")
    assert again.status_code == 429 and "cancelled" in again.json()["message"]
    assert metric(client, "expresslane_decode_reservations_total", 'outcome="refused"') == refused + 1
    assert client.get("/decode_status").json()["state"] == "idle"  # the refused reservation holds nothing


def test_decode_without_reservation_is_409_and_touches_nothing(node):
    client, source, _, _ = node
    r = client.post("/pd/decode", json=body("never-reserved", 5))
    assert r.status_code == 409 and r.json()["error"] == "not_reserved"
    assert status_of(client) == {"state": "idle", "rid": None, "seats_busy": 0}
    assert metric(client, "expresslane_decode_requests_total", 'status="not_reserved"') >= 1


def test_kv_timeout_cancels_rid_so_late_kv_is_refused(node, reference):
    client, source, _, _ = node
    assert reserve(client, "late").status_code == 200
    r = client.post("/pd/decode", json={**body("late", 5), "timeout_s": 0.2})
    assert r.status_code == 504
    first, k, v = kv(reference)
    assert source.put("late", k, v) is False
    # and the next request is served normally
    assert reserve(client, "after-late").status_code == 200
    assert source.put("after-late", k, v)
    ok = client.post("/pd/decode", json=body("after-late", first, max_tokens=4))
    assert ok.status_code == 200 and len(ok.json()["token_ids"]) == 4


def test_client_gone_while_waiting_for_kv_cancels_the_rid(node, reference):
    client, source, _, _ = node
    assert reserve(client, "gone").status_code == 200
    with httpx.Client(base_url=str(client.base_url), timeout=0.3) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/pd/decode", json=body("gone", 5))
    wait_idle(client, within_s=2.0)
    _, k, v = kv(reference)
    assert source.put("gone", k, v) is False and ("cancel", "gone") in source.calls


# ---------------------------------------------------------------- fast failure
def test_transfer_failure_is_502_at_once(node):
    client, source, _, _ = node
    before = metric(client, "expresslane_decode_kv_transfer_failures_total", 'reason="aborted"')
    assert reserve(client, "abort-me").status_code == 200
    t, out = post_in_background(client, {**body("abort-me", 5), "timeout_s": 30})
    wait_phase(client, "waiting_kv")
    source.fail("abort-me", "aborted:no_staging_slot")
    t.join(5)
    r = out["r"]
    assert r.status_code == 502, r.text
    assert r.json()["error"] == "kv_transfer_failed" and r.json()["reason"] == "aborted:no_staging_slot"
    assert out["s"] < 2.0  # not after timeout_s=30
    assert metric(client, "expresslane_decode_kv_transfer_failures_total", 'reason="aborted"') == before + 1
    wait_idle(client, within_s=2.0)


def test_timeout_above_the_node_cap_is_400(node):
    client, _, _, _ = node
    r = client.post("/pd/decode", json={**body("too-long", 5), "timeout_s": 3600})
    assert r.status_code == 400 and "timeout_s" in r.json()["message"]


# ---------------------------------------------------------------- health
def test_health_names_the_failing_check_and_requests_are_refused(node):
    client, source, _, _ = node
    ok = client.get("/health")
    assert ok.status_code == 200 and ok.json()["checks"] == {"engine": "ok", "control_plane": "ok", "nixl": "ok"}
    assert client.get("/ready").status_code == 200
    assert metric(client, "expresslane_decode_healthy") == 1
    source.degrade("nixl", "agent gone")
    try:
        bad = client.get("/health")
        assert bad.status_code == 503 and bad.json()["checks"]["nixl"] == "agent gone"
        assert bad.json()["checks"]["engine"] == "ok"
        assert client.get("/ready").status_code == 503
        t0 = time.monotonic()
        r = reserve(client, "sick")
        assert r.status_code == 503 and r.json()["error"] == "not_ready" and r.json()["detail"]["nixl"] == "agent gone"
        d = client.post("/pd/decode", json=body("sick", 5))
        assert d.status_code == 503
        source.degrade("nixl", None)
        assert reserve(client, "sick-held").status_code == 200
        source.degrade("nixl", "agent gone")
        d = client.post("/pd/decode", json=body("sick-held", 5))
        assert d.status_code == 503 and client.get("/decode_status").json()["state"] == "idle"  # not held
        assert ("cancel", "sick-held") in source.calls
        assert time.monotonic() - t0 < 1.0
        assert metric(client, "expresslane_decode_healthy") == 0
    finally:
        source.degrade("nixl", None)
    assert client.get("/health").status_code == 200 and reserve(client, "well").status_code == 200
    client.post("/pd/cancel", json={"rid": "well"})


def test_stuck_engine_thread_makes_the_node_unhealthy(model_dir):
    with make_node(model_dir, health_probe_timeout_s=0.2) as (client, _, _, app):
        gate = threading.Event()
        app.state.runner.thread.submit(gate.wait, 30)  # the one engine thread stops answering
        try:
            bad = client.get("/health")
            assert bad.status_code == 503 and "did not answer" in bad.json()["checks"]["engine"]
            assert reserve(client, "x").status_code == 503
        finally:
            gate.set()
        assert client.get("/health").status_code == 200
        assert reserve(client, "x").status_code == 200


# ---------------------------------------------------------------- watchdog + deadline
def _stall_after(engine: DecodeEngine, n_steps: int) -> threading.Event:
    """Fault injection into the real engine: its decode step blocks after n_steps (a hung device)."""
    gate, calls = threading.Event(), [0]

    def stalling(step):
        def stalled(*args):
            calls[0] += 1
            if calls[0] > n_steps:
                gate.wait(30)
            return step(*args)
        return stalled

    # plain steps of speculating requests run on the greedy chain (decode/chain.py), verifies on forward
    engine.runner.forward = stalling(engine.runner.forward)
    engine._chain.result = stalling(engine._chain.result)
    return gate


def test_stalled_decode_ends_the_stream_with_a_stall_error(model_dir, reference):
    with make_node(model_dir, stall_timeout_s=0.5) as (client, source, engine, _):
        gate = _stall_after(engine, 5)
        first, k, v = kv(reference)
        assert reserve(client, "stall").status_code == 200 and source.put("stall", k, v)
        t0 = time.monotonic()
        with client.stream("POST", "/pd/decode", json=body("stall", first, max_tokens=100, stream=True)) as r:
            assert r.status_code == 200
            lines = read_ndjson(r)
        took = time.monotonic() - t0
        *chunks, last = lines
        assert sum(len(c["t"]) for c in chunks) == 6  # first token + 5 steps
        assert last["error"] == "decode stalled" and last["error_type"] == "stall"
        assert took < 2.0
        # the engine thread is still stuck: the node says so and refuses work
        h = client.get("/health")
        assert h.status_code == 503 and "stalled" in h.json()["checks"]["engine"]
        assert reserve(client, "next").status_code == 503
        gate.set()  # the device comes back: the cancelled decode stops, the slot is released
        wait_idle(client, within_s=2.0)
        assert client.get("/health").status_code == 200
        assert metric(client, "expresslane_decode_requests_total", 'status="stalled"') == 1
        assert ("cancel", "stall") in source.calls


def test_deadline_bounds_decode_and_kv_wait(model_dir, reference):
    with make_node(model_dir, request_deadline_s=0.5, stall_timeout_s=10) as (client, source, engine, _):
        assert reserve(client, "dl-wait").status_code == 200
        t0 = time.monotonic()
        r = client.post("/pd/decode", json={**body("dl-wait", 5), "timeout_s": 5})
        assert r.status_code == 504 and r.json()["error"] == "deadline_exceeded"
        assert time.monotonic() - t0 < 1.5
        gate = _stall_after(engine, 3)
        first, k, v = kv(reference)
        assert reserve(client, "dl").status_code == 200 and source.put("dl", k, v)
        r = client.post("/pd/decode", json=body("dl", first, max_tokens=100))
        assert r.status_code == 504 and r.json()["error"] == "deadline_exceeded"
        gate.set()
        wait_idle(client, within_s=2.0)
        assert metric(client, "expresslane_decode_requests_total", 'status="deadline"') == 2


# ---------------------------------------------------------------- auth
def test_bearer_token_guards_private_endpoints_only(model_dir):
    with make_node(model_dir, node_token=TOKEN) as (client, _, _, _):
        base = str(client.base_url)
        with httpx.Client(base_url=base, timeout=10) as anon:
            for method, path in (("POST", "/pd/reserve"), ("POST", "/pd/decode"), ("POST", "/pd/cancel"),
                                 ("GET", "/decode_status"), ("GET", "/capabilities")):
                for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {TOKEN}"}):
                    r = anon.request(method, path, json={"rid": "x"}, headers=headers)
                    assert r.status_code == 401, (method, path, headers)
                    assert r.json()["error"] == "unauthorized" and TOKEN not in r.text
            assert reserve(client, "secret-rid").status_code == 200  # the token works
            for path in ("/health", "/ready", "/metrics"):
                r = anon.get(path)
                assert r.status_code == 200 and "secret-rid" not in r.text
        assert client.get("/decode_status").json()["rid"] == "secret-rid"
        assert TOKEN not in repr(client.get("/capabilities").json())
        client.post("/pd/cancel", json={"rid": "secret-rid"})


def test_config_repr_hides_secrets():
    c = ServerConfig(model="m", node_token=TOKEN, peer_secret=b"peer-secret")
    assert TOKEN not in repr(c) and "peer-secret" not in repr(c)


# ---------------------------------------------------------------- capabilities + metrics
def test_capabilities_features_say_what_the_node_honours(node):
    client, _, _, _ = node
    f = client.get("/capabilities").json()["features"]
    assert set(f) == {"logprobs", "top_logprobs", "structured_output", "tools", "n", "echo", "prompt_logprobs",
                      "logit_bias", "min_p", "allowed_token_ids", "bad_words", "stop_token_ids", "min_tokens",
                      "penalties", "seed", "speculative"}
    # speculative: the engine's (on by default; exact, so a request may opt out with sampling.speculative=false)
    # structured_output needs the model directory's tokenizer, which this test model lacks
    assert {k for k, v in f.items() if v} == {"stop_token_ids", "min_tokens", "penalties", "seed", "speculative",
                                              "logprobs", "top_logprobs", "min_p", "logit_bias",
                                              "allowed_token_ids"}
    caps = client.get("/capabilities").json()
    assert caps["max_top_logprobs"] == 20 and caps["structured_output_backend"] is None
    # what is advertised false is refused, not ignored
    r = client.post("/pd/decode", json={**body("x", 5), "structured_outputs": {"json_object": True}})
    assert r.status_code == 501 and "structured_outputs" in r.json()["message"]
    r = client.post("/pd/decode", json=body("x", 5, bad_words=[[1, 2]]))
    assert r.status_code == 400


def test_reservation_metrics_exported_with_zeros(node):
    client, _, _, _ = node
    text = client.get("/metrics").text
    for outcome in ("reserved", "refreshed", "taken", "cancelled", "expired", "busy", "refused", "not_ready"):
        assert f'expresslane_decode_reservations_total{{outcome="{outcome}"}}' in text
    assert "expresslane_decode_healthy " in text
