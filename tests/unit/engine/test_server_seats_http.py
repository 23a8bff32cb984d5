"""A node of four seats over HTTP (uvicorn in-process, a real 4-seat DecodeEngine, KV through LocalKVSource): four
concurrent users each get the tokens the node gives them alone; a fifth reservation is refused (429 with
Retry-After) while the four hold their seats; one user's cancel or disconnect leaves the others' tokens as they
were; /decode_status, /capabilities and /metrics say how many seats there are and how wide the steps ran."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from expresslane.engine.decode import DecodeEngine
from expresslane.engine.server import LocalKVSource, ServerConfig, create_app

from ._live import LiveServer
from ._models import VOCAB, build_model
from .test_server import body, metric, read_ndjson

SEATS = 4
MAX_SEQ = 512
PROMPTS = [[(7 * i + 3 * u) % VOCAB for i in range(12 + 9 * u)] for u in range(SEATS)]
PROMPTS[1] = PROMPTS[1][:6] * 5  # one that repeats itself: its drafts are verified among the others' rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("seats-model")
    build_model(out, "llama")
    return out


@pytest.fixture(scope="module")
def reference(model_dir):
    """Computes the prompt KV the 'prefill' ships (a one-seat engine: its prefill, a separate process's)."""
    return DecodeEngine.from_pretrained(model_dir, max_seq_len=MAX_SEQ)


@pytest.fixture(scope="module")
def node(model_dir):
    engine = DecodeEngine.from_pretrained(model_dir, max_seq_len=MAX_SEQ, seats=SEATS)
    engine.warmup()
    source = LocalKVSource()
    app = create_app(ServerConfig(model=str(model_dir), max_seq_len=MAX_SEQ, kv_timeout_s=10.0), engine, source)
    with LiveServer(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client, source, engine


def ship(client, reference, source, rid, prompt) -> int:
    r = client.post("/pd/reserve", json={"rid": rid, "ttl_s": 10})
    assert r.status_code == 200, r.text
    first = int(reference.prefill(prompt).argmax())
    n = len(prompt)
    assert source.put(rid, reference.cache.k[:, :n].clone(), reference.cache.v[:, :n].clone())
    return first


def wait_free(client, within_s: float = 5.0) -> None:
    t0 = time.monotonic()
    while client.get("/decode_status").json()["seats_busy"]:
        assert time.monotonic() - t0 < within_s, "seats still held"
        time.sleep(0.01)


def decode(client, payload) -> list[int]:
    if payload["stream"]:
        with client.stream("POST", "/pd/decode", json=payload) as r:
            assert r.status_code == 200
            lines = read_ndjson(r)
        assert lines[-1].get("done"), lines[-1]
        return [t for ln in lines[:-1] for t in ln["t"]]
    r = client.post("/pd/decode", json=payload)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


@pytest.fixture(scope="module")
def alone(node, reference):
    """Each prompt's tokens from this node with nobody else on it."""
    client, source, _ = node
    out = []
    for u, prompt in enumerate(PROMPTS):
        first = ship(client, reference, source, f"alone-{u}", prompt)
        out.append(decode(client, body(f"alone-{u}", first, max_tokens=60)))
        wait_free(client)
    return out


def run_together(client, reference, source, tag, payloads_for) -> dict[int, object]:
    firsts = [ship(client, reference, source, f"{tag}-{u}", p) for u, p in enumerate(PROMPTS)]
    results: dict[int, object] = {}

    def go(u):
        try:
            results[u] = decode(client, payloads_for(u, firsts[u]))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            results[u] = e

    threads = [threading.Thread(target=go, args=(u,)) for u in range(SEATS)]
    for t in threads:
        t.start()
    return results, threads


def test_four_users_at_once_each_get_their_tokens_alone(node, reference, alone):
    client, source, engine = node
    steps_before = metric(client, "expresslane_decode_step_rows_count")
    shared_before = sum(n for users, n in engine.scheduler.users_histogram.items() if users > 1)
    results, threads = run_together(client, reference, source, "four",
                                    lambda u, f: body(f"four-{u}", f, max_tokens=60, stream=u % 2 == 1))
    status = client.get("/decode_status").json()
    fifth = client.post("/pd/reserve", json={"rid": "fifth", "ttl_s": 5})
    for t in threads:
        t.join(60)
    assert [results[u] for u in range(SEATS)] == alone
    assert status["seats"] == SEATS
    if status["seats_busy"] == SEATS:  # the four still held their seats when the fifth asked
        assert fifth.status_code == 429 and fifth.headers["retry-after"] == "1" and status["state"] == "busy"
    else:
        client.post("/pd/cancel", json={"rid": "fifth"})
    wait_free(client)
    assert metric(client, "expresslane_decode_step_rows_count") > steps_before
    assert metric(client, "expresslane_decode_seats") == SEATS
    assert sum(n for users, n in engine.scheduler.users_histogram.items() if users > 1) > shared_before + 20


def test_all_seats_held_then_a_fifth_reservation_is_429(node):
    client, _, _ = node
    for u in range(SEATS):
        assert client.post("/pd/reserve", json={"rid": f"hold-{u}", "ttl_s": 5}).status_code == 200
    st = client.get("/decode_status").json()
    assert st["state"] == "busy" and st["seats_busy"] == SEATS
    assert {s["rid"] for s in st["seat_states"]} == {f"hold-{u}" for u in range(SEATS)}
    r = client.post("/pd/reserve", json={"rid": "fifth", "ttl_s": 5})
    assert r.status_code == 429 and r.json()["error"] == "busy" and r.headers["retry-after"] == "1"
    assert client.post("/pd/cancel", json={"rid": "hold-2"}).json()["cancelled"]
    assert client.post("/pd/reserve", json={"rid": "fifth", "ttl_s": 5}).json()["seat"] == 2
    for rid in ("hold-0", "hold-1", "hold-3", "fifth"):
        client.post("/pd/cancel", json={"rid": rid})
    wait_free(client)


def test_one_users_cancel_and_anothers_disconnect_leave_the_rest_as_alone(node, reference, alone):
    client, source, _ = node
    firsts = [ship(client, reference, source, f"mixed-{u}", p) for u, p in enumerate(PROMPTS)]
    results: dict[int, object] = {}

    def keep(u):
        results[u] = decode(client, body(f"mixed-{u}", firsts[u], max_tokens=60, stream=True))

    def cancelled():  # streams, then its rid is cancelled after a few batches
        with client.stream("POST", "/pd/decode", json=body("mixed-1", firsts[1], max_tokens=400,
                                                            stream=True)) as r:
            lines = []
            for line in r.iter_lines():
                if line.strip():
                    lines.append(line)
                if len(lines) == 3:
                    client.post("/pd/cancel", json={"rid": "mixed-1"})
            results[1] = lines[-1]

    def disconnects():  # reads a little and hangs up
        with httpx.Client(base_url=str(client.base_url), timeout=60) as own:
            with own.stream("POST", "/pd/decode", json=body("mixed-3", firsts[3], max_tokens=400, stream=True)) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i == 2:
                        break
        results[3] = "gone"

    threads = [threading.Thread(target=keep, args=(0,)), threading.Thread(target=cancelled),
               threading.Thread(target=keep, args=(2,)), threading.Thread(target=disconnects)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[0] == alone[0] and results[2] == alone[2]
    assert '"cancelled"' in results[1] and results[3] == "gone"
    wait_free(client)
    assert metric(client, "expresslane_decode_seats_busy") == 0


def test_one_users_deadline_leaves_the_others_as_alone(model_dir, reference, alone):
    """A node whose request deadline is short: the user whose KV never comes ends with deadline_exceeded when the
    deadline passes, its seat freed; the users beside it, decoding meanwhile, get their alone tokens."""
    engine = DecodeEngine.from_pretrained(model_dir, max_seq_len=MAX_SEQ, seats=SEATS)
    engine.warmup()
    source = LocalKVSource()
    config = ServerConfig(model=str(model_dir), max_seq_len=MAX_SEQ, kv_timeout_s=3.0, request_deadline_s=1.5)
    with LiveServer(create_app(config, engine, source)) as url, httpx.Client(base_url=url, timeout=60) as client:
        assert client.post("/pd/reserve", json={"rid": "late-0", "ttl_s": 10}).status_code == 200  # KV never sent
        firsts = {u: ship(client, reference, source, f"late-{u}", PROMPTS[u]) for u in (1, 2)}
        results: dict[int, object] = {}

        def late():
            results[0] = client.post("/pd/decode", json=body("late-0", 5, max_tokens=20))

        def ok(u):
            results[u] = decode(client, body(f"late-{u}", firsts[u], max_tokens=60, stream=True))

        threads = [threading.Thread(target=late)] + [threading.Thread(target=ok, args=(u,)) for u in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results[0].status_code == 504 and results[0].json()["error"] == "deadline_exceeded"
        assert results[1] == alone[1] and results[2] == alone[2]
        wait_free(client)
