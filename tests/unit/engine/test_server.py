"""The express decode server's HTTP contract (TileRT's decode node), served by uvicorn in-process over a
real DecodeEngine. KV arrives through LocalKVSource, computed by a second engine's prefill."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from expresslane.engine.decode import DecodeEngine, SamplingParams
from expresslane.engine.server import LocalKVSource, ServerConfig, create_app

from ._live import LiveServer
from ._models import VOCAB, build_model

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
MAX_SEQ = 2048


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("server-model")
    build_model(out, "qwen2")
    return out


@pytest.fixture(scope="module")
def reference(model_dir):
    """A second engine: computes the prompt KV the 'prefill' ships, and the expected continuation."""
    return DecodeEngine.from_pretrained(model_dir, max_seq_len=MAX_SEQ)


@pytest.fixture(scope="module")
def node(model_dir):
    engine = DecodeEngine.from_pretrained(model_dir, max_seq_len=MAX_SEQ)
    engine.warmup()
    source = LocalKVSource()
    config = ServerConfig(model=str(model_dir), max_seq_len=MAX_SEQ, kv_timeout_s=5.0)
    app = create_app(config, engine, source)
    with LiveServer(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert source.started
        yield client, source, app
    assert not source.started  # lifespan stopped it


@pytest.fixture(autouse=True)
def node_idle_after(request):
    yield
    if "node" in request.fixturenames:
        client = request.getfixturevalue("node")[0]
        wait_idle(client)


def wait_idle(client, within_s: float = 1.0) -> float:
    t0 = time.monotonic()
    while client.get("/decode_status").json()["state"] != "idle":
        assert time.monotonic() - t0 < within_s, "node still busy"
        time.sleep(0.01)
    return time.monotonic() - t0


def status_of(client) -> dict:
    """/decode_status's one-seat fields (TileRT's state / rid / phase) and the seats held."""
    s = client.get("/decode_status").json()
    return {k: s[k] for k in ("state", "rid", "phase", "seats_busy") if k in s}


def reserve(client, rid, ttl_s=5.0):
    r = client.post("/pd/reserve", json={"rid": rid, "ttl_s": ttl_s})
    assert r.status_code == 200, r.text
    return r


def ship(client, reference, source, rid, prompt=PROMPT):
    """What the router + prefill do: reserve the node, run the prompt, send its KV, return the first token."""
    reserve(client, rid)
    first = int(reference.prefill(prompt).argmax())
    n = len(prompt)
    assert source.put(rid, reference.cache.k[:, :n].clone(), reference.cache.v[:, :n].clone())
    return first


def expected(reference, first, max_tokens, prompt=PROMPT, **sampling):
    reference.prefill(prompt)
    return list(reference.generate(first, len(prompt), SamplingParams(max_tokens=max_tokens, **sampling)))


def body(rid, first, max_tokens=24, stream=False, **sampling):
    sampling = {"temperature": 0.0, "ignore_eos": True, **sampling}
    return {"rid": rid, "first_token_id": first, "max_tokens": max_tokens, "sampling": sampling, "stream": stream,
            "timeout_s": 5}


def read_ndjson(resp) -> list[dict]:
    return [json.loads(line) for line in resp.iter_lines() if line.strip()]


def metric(client, name: str, labels: str = "") -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + (("{" + labels + "}") if labels else " ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{labels}}} not exported")


def test_non_stream_reply_continues_the_prompt_exactly(node, reference):
    client, source, _ = node
    first = ship(client, reference, source, "r-plain")
    r = client.post("/pd/decode", json=body("r-plain", first, max_tokens=24))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["rid"] == "r-plain"
    assert out["token_ids"] == expected(reference, first, 24, ignore_eos=True)
    assert out["token_ids"][0] == first
    assert out["seq_len"] == len(PROMPT) + 24
    assert out["finish_reason"] == "length"
    assert set(out["timing_ms"]) >= {"wire_wait", "convert", "inject", "decode", "total"}
    assert source.delivered[-1].released


def test_stream_ndjson_shape(node, reference):
    client, source, _ = node
    first = ship(client, reference, source, "r-stream")
    with client.stream("POST", "/pd/decode", json=body("r-stream", first, max_tokens=30, stream=True)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = read_ndjson(r)
    *chunks, done = lines
    assert chunks and all(set(c) == {"t"} and isinstance(c["t"], list) for c in chunks)
    tokens = [t for c in chunks for t in c["t"]]
    assert tokens == expected(reference, first, 30, ignore_eos=True)
    assert done["done"] is True and done["n"] == 30 and done["seq_len"] == len(PROMPT) + 30
    assert done["finish_reason"] == "length" and "decode" in done["timing_ms"]


def test_stop_token_ends_with_stop(node, reference):
    client, source, _ = node
    first = int(reference.prefill(PROMPT).argmax())
    ref = expected(reference, first, 24, ignore_eos=True)
    stop = ref[5]
    first = ship(client, reference, source, "r-stop2")
    r = client.post("/pd/decode", json=body("r-stop2", first, max_tokens=24, stop_token_ids=[stop]))
    out = r.json()
    assert out["token_ids"] == ref[: ref.index(stop) + 1] and out["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible_over_http(node, reference):
    client, source, _ = node
    outs = []
    for i, seed in enumerate((7, 7, 8)):
        first = ship(client, reference, source, f"r-seed-{i}")
        r = client.post("/pd/decode", json=body(f"r-seed-{i}", first, max_tokens=20, temperature=1.5, top_p=0.9,
                                                  top_k=40, seed=seed))
        outs.append(r.json()["token_ids"])
    assert outs[0] == outs[1] != outs[2]


def test_busy_while_waiting_for_kv_then_cancel_frees_node(node, reference):
    client, source, _ = node
    results = {}

    reserve(client, "r-wait")

    def first_request():
        results["a"] = client.post("/pd/decode", json=body("r-wait", 5))

    t = threading.Thread(target=first_request)
    t.start()
    deadline = time.monotonic() + 5
    while status_of(client) != {"state": "busy", "rid": "r-wait", "phase": "waiting_kv", "seats_busy": 1}:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert source.busy is False  # the awaited KV must still be admitted by the control plane
    busy = client.post("/pd/reserve", json={"rid": "r-other", "ttl_s": 1})
    assert busy.status_code == 429 and busy.json()["error"] == "busy"
    unreserved = client.post("/pd/decode", json=body("r-other", 5))
    assert unreserved.status_code == 409 and unreserved.json()["error"] == "not_reserved"
    c = client.post("/pd/cancel", json={"rid": "r-wait"})
    assert c.json() == {"rid": "r-wait", "cancelled": True}
    t.join(5)
    assert results["a"].status_code == 499 and results["a"].json()["error"] == "cancelled"
    assert wait_idle(client) < 1.0
    assert source.busy is False


def test_kv_timeout_is_504(node):
    client, _, _ = node
    before = metric(client, "expresslane_decode_kv_timeouts_total")
    reserve(client, "r-never")
    r = client.post("/pd/decode", json={**body("r-never", 5), "timeout_s": 0.2})
    assert r.status_code == 504 and r.json()["error"] == "kv_transfer_timeout"
    assert metric(client, "expresslane_decode_kv_timeouts_total") == before + 1
    assert client.get("/decode_status").json()["state"] == "idle"


def test_cancel_during_decode_frees_node_within_1s(node, reference):
    client, source, _ = node
    first = ship(client, reference, source, "r-long")
    cancels = metric(client, "expresslane_decode_cancellations_total")
    with client.stream("POST", "/pd/decode", json=body("r-long", first, max_tokens=MAX_SEQ, stream=True)) as r:
        lines = r.iter_lines()
        assert "t" in json.loads(next(lines))
        assert source.busy is True  # KV claimed, engine decoding: other admissions are refused
        assert client.post("/pd/cancel", json={"rid": "r-long"}).json()["cancelled"] is True
        t0 = time.monotonic()
        wait_idle(client, within_s=1.0)
        rest = [json.loads(x) for x in lines if x.strip()]
    assert time.monotonic() - t0 < 1.0
    assert rest[-1]["error"] == "cancelled"
    assert source.busy is False
    n = sum(len(x.get("t", [])) for x in rest) + 1
    assert n < MAX_SEQ - len(PROMPT)
    assert metric(client, "expresslane_decode_cancellations_total") == cancels + 1


def test_client_disconnect_mid_stream_cancels(node, reference):
    client, source, _ = node
    first = ship(client, reference, source, "r-gone")
    cancels = metric(client, "expresslane_decode_cancellations_total")
    with httpx.Client(base_url=str(client.base_url), timeout=30) as other:
        with other.stream("POST", "/pd/decode", json=body("r-gone", first, max_tokens=MAX_SEQ, stream=True)) as r:
            assert "t" in json.loads(next(r.iter_lines()))
    # the connection is closed: the node must notice, stop decoding and free itself
    assert wait_idle(client, within_s=2.0) < 2.0
    assert metric(client, "expresslane_decode_cancellations_total") == cancels + 1


@pytest.mark.parametrize(
    "payload, status, needle",
    [
        (b"{not json", 400, "invalid"),
        (b"", 400, "empty"),
        ({"first_token_id": 1, "max_tokens": 4}, 400, "rid"),
        ({"rid": "x", "first_token_id": 1, "max_tokens": 0}, 400, "max_tokens"),
        ({"rid": "x", "first_token_id": VOCAB, "max_tokens": 4}, 400, "first_token_id"),
        ({"rid": "x", "first_token_id": 1, "max_tokens": 4, "sampling": {"min_p": 1.5}}, 400, "min_p"),
        ({"rid": "x", "first_token_id": 1, "max_tokens": 4, "sampling": {"typical_p": 0.5}}, 400, "typical_p"),
        ({"rid": "x", "first_token_id": 1, "max_tokens": 4, "sampling": {"logit_bias": {"a": 1}}}, 400, "logit_bias"),
        ({"rid": "x", "first_token_id": 1, "max_tokens": 4, "sampling": {"logit_bias": {str(VOCAB): 1}}}, 400,
         "logit_bias"),
        ({"rid": "x", "first_token_id": 1, "max_tokens": 4, "sampling": {"allowed_token_ids": []}}, 400,
         "allowed_token_ids"),
        ({"rid": "x", "first_token_id": 1, "max_tokens": 4, "sampling": {"top_p": 0}}, 400, "top_p"),
        ({"rid": "x", "first_token_id": 1, "max_tokens": 4, "sampling": {"stop_token_ids": [VOCAB + 1]}}, 400,
         "stop_token_ids"),
        ({"rid": "x", "first_token_id": 1, "max_tokens": 4, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"rid": "x", "first_token_id": 1, "max_tokens": 4, "top_logprobs": -1}, 400, "top_logprobs"),
        ({"rid": "x", "first_token_id": 1, "max_tokens": 4, "structured_outputs": {"regex": "a", "choice": ["b"]}},
         400, "exactly one"),
        ({"rid": "x", "first_token_id": 1, "max_tokens": 4, "structured_outputs": {"jsonschema": {}}}, 400,
         "jsonschema"),
        # this node's model directory has no tokenizer: no grammar backend, said so (features too)
        ({"rid": "x", "first_token_id": 1, "max_tokens": 4, "structured_outputs": {"regex": "a+"}}, 501,
         "tokenizer"),
    ],
)
def test_bad_requests_get_clear_errors(node, payload, status, needle):
    client, _, _ = node
    if isinstance(payload, bytes):
        r = client.post("/pd/decode", content=payload, headers={"content-type": "application/json"})
    else:
        r = client.post("/pd/decode", json=payload)
    assert r.status_code == status, r.text
    err = r.json()
    assert needle in err["message"] and "Traceback" not in r.text
    assert client.get("/decode_status").json()["state"] == "idle"


def test_null_sampling_fields_mean_defaults(node, reference):
    client, source, _ = node
    first = ship(client, reference, source, "r-null")
    payload = {"rid": "r-null", "first_token_id": first, "max_tokens": 6,
               "sampling": {"temperature": 0, "top_p": None, "top_k": None, "seed": None, "ignore_eos": True}}
    r = client.post("/pd/decode", json=payload)
    assert r.status_code == 200 and len(r.json()["token_ids"]) == 6


def test_info_endpoints(node):
    client, _, _ = node
    assert client.get("/health").json() == {"status": "ok",
                                            "checks": {"engine": "ok", "control_plane": "ok", "nixl": "ok"}}
    caps = client.get("/capabilities").json()
    assert caps["max_seq_len"] == MAX_SEQ and caps["max_concurrent_requests"] == 1
    for option in ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "ignore_eos", "seed",
                   "stop_token_ids"):
        assert option in caps["sampling"]
    assert status_of(client) == {"state": "idle", "rid": None, "seats_busy": 0}
    assert client.post("/pd/cancel", json={"rid": "nobody"}).json() == {"rid": "nobody", "cancelled": False}


def test_metrics_exported_with_zeros_and_counts(node):
    client, _, _ = node
    text = client.get("/metrics").text
    for name in ("expresslane_decode_busy", "expresslane_decode_handoff_bytes_total",
                 "expresslane_decode_handoff_seconds_bucket", "expresslane_decode_tokens_per_second_bucket",
                 "expresslane_decode_handoff_throughput_gigabytes_per_second_bucket",
                 "expresslane_decode_generated_tokens_total", "expresslane_decode_cancellations_total",
                 "expresslane_decode_kv_timeouts_total"):
        assert name in text, name
    for phase in ("wire_wait", "convert", "inject", "decode"):
        assert f'expresslane_decode_phase_seconds_count{{phase="{phase}"}}' in text
    for status in ("ok", "busy", "bad_request", "cancelled", "kv_timeout", "not_reserved", "not_ready",
                   "kv_transfer_failed", "stalled", "deadline"):
        assert f'expresslane_decode_requests_total{{status="{status}"}}' in text
    assert metric(client, "expresslane_decode_busy") == 0


def test_ok_request_updates_metrics(node, reference):
    client, source, _ = node
    ok = metric(client, "expresslane_decode_requests_total", 'status="ok"')
    gen = metric(client, "expresslane_decode_generated_tokens_total")
    nbytes = metric(client, "expresslane_decode_handoff_bytes_total")
    first = ship(client, reference, source, "r-metrics")
    assert client.post("/pd/decode", json=body("r-metrics", first, max_tokens=9)).status_code == 200
    assert metric(client, "expresslane_decode_requests_total", 'status="ok"') == ok + 1
    assert metric(client, "expresslane_decode_generated_tokens_total") == gen + 8
    kv_bytes = 2 * reference.geometry.token_bytes() // 2 * len(PROMPT)
    assert metric(client, "expresslane_decode_handoff_bytes_total") == nbytes + kv_bytes



SPEC_COUNTERS = ("verify_steps", "plain_steps", "drafted_tokens", "accepted_tokens")


def spec_counters(client) -> dict[str, float]:
    return {name: metric(client, f"expresslane_decode_spec_{name}_total") for name in SPEC_COUNTERS}


def test_speculative_opt_out_decodes_identically_and_moves_the_counters(node, reference):
    """Greedy output is the same with sampling.speculative true, false and absent. prompt_token_ids is the
    lookup context: holding the continuation (as an edit request's output copies its input) the drafts are
    accepted; holding only the prompt (random weights do not copy it) they mostly miss. Only speculating
    requests move verify/drafted/accepted; an opted-out one decodes one plain step per token."""
    client, source, _ = node
    n = 40
    first = int(reference.prefill(PROMPT).argmax())
    want = expected(reference, first, n, ignore_eos=True, speculative=False)
    cases = (("on", True, PROMPT + want), ("off", False, PROMPT + want), ("default", None, PROMPT + want),
             ("prompt-only", True, PROMPT))
    for label, speculative, lookup in cases:
        rid = f"r-spec-{label}"
        before = spec_counters(client)
        first = ship(client, reference, source, rid)
        payload = {**body(rid, first, max_tokens=n, speculative=speculative), "prompt_token_ids": lookup}
        r = client.post("/pd/decode", json=payload)
        assert r.status_code == 200, r.text
        assert r.json()["token_ids"] == want, label
        delta = {k: v - before[k] for k, v in spec_counters(client).items()}
        # every generated token past the first came from a forward: accepted drafts + one per forward
        assert delta["accepted_tokens"] + delta["verify_steps"] + delta["plain_steps"] == n - 1, (label, delta)
        assert delta["drafted_tokens"] >= delta["accepted_tokens"]
        if speculative is False:
            assert delta == {"verify_steps": 0, "plain_steps": n - 1, "drafted_tokens": 0, "accepted_tokens": 0}
        elif label != "prompt-only":
            assert delta["accepted_tokens"] >= n // 2, (label, delta)  # several tokens per forward


def test_speculation_histogram_and_capabilities(node, reference):
    client, source, _ = node
    caps = client.get("/capabilities").json()
    assert caps["features"]["speculative"] is True
    assert caps["speculation"]["method"] == "prompt_lookup" and caps["speculation"]["k"] == 4
    first = ship(client, reference, source, "r-spec-hist")
    want = expected(reference, first, 30, ignore_eos=True)
    payload = {**body("r-spec-hist", first, max_tokens=30), "prompt_token_ids": PROMPT + want}
    assert client.post("/pd/decode", json=payload).json()["token_ids"] == want
    name = "expresslane_decode_spec_accepted_per_verify_step"
    steps = metric(client, f"{name}_count")
    assert steps == metric(client, "expresslane_decode_spec_verify_steps_total") > 0
    assert metric(client, f"{name}_sum") == metric(client, "expresslane_decode_spec_accepted_tokens_total")
    buckets = [metric(client, f"{name}_bucket", f'le="{le}"') for le in ("0", "1", "2", "3", "4", "+Inf")]
    assert buckets == sorted(buckets) and buckets[-1] == buckets[-2] == steps  # k=4: nothing above 4
    assert buckets[-1] > buckets[0]  # some verify steps kept drafts
    # the step costs the drafter weighs a verify by: measured at warm-up, in capabilities and as a gauge
    costs = caps["speculation"]["step_costs"]
    assert costs["measured"] and len(costs["short"]) == len(costs["long"]) == 5
    for length, row_costs in zip(costs["lengths"], (costs["short"], costs["long"])):
        for rows, seconds in enumerate(row_costs, start=1):
            got = metric(client, "expresslane_decode_spec_step_seconds", f'context_tokens="{length}",rows="{rows}"')
            assert got == pytest.approx(seconds), (rows, length)


def test_speculative_must_be_a_boolean(node):
    client, _, _ = node
    r = client.post("/pd/decode", json=body("r-spec-bad", 1, speculative="yes"))
    assert r.status_code == 400 and "speculative" in r.text


def test_node_without_speculation_says_so_and_decodes_plain(model_dir, reference):
    """--speculation off: the engine has no drafter; capabilities say so and every step is plain, even for a
    request that asks for speculation (the opt-in is a no-op there, not an error)."""
    engine = DecodeEngine.from_pretrained(model_dir, max_seq_len=MAX_SEQ, speculation=None)
    source = LocalKVSource()
    app = create_app(ServerConfig(model=str(model_dir), max_seq_len=MAX_SEQ, speculation=False), engine, source)
    with LiveServer(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        caps = client.get("/capabilities").json()
        assert caps["features"]["speculative"] is False and caps["speculation"] is None
        first = ship(client, reference, source, "r-nospec")
        want = expected(reference, first, 12, ignore_eos=True)
        payload = {**body("r-nospec", first, max_tokens=12, speculative=True), "prompt_token_ids": PROMPT + want}
        assert client.post("/pd/decode", json=payload).json()["token_ids"] == want
        assert spec_counters(client) == {"verify_steps": 0, "plain_steps": 11, "drafted_tokens": 0,
                                         "accepted_tokens": 0}
        wait_idle(client)


def test_logit_bias_allowed_token_ids_and_min_p(node, reference):
    """vLLM's order: logprobs are raw (before allowed_token_ids / logit_bias), the sampling sees both;
    min_p = 1 keeps only the top token, so sampling at temperature 1 is greedy."""
    client, source, _ = node
    first = ship(client, reference, source, "r-bias")
    greedy = expected(reference, first, 8, ignore_eos=True, temperature=0.0)
    forced = (greedy[1] + 1) % VOCAB
    r = client.post("/pd/decode", json={**body("r-bias", first, max_tokens=8, logit_bias={str(forced): 1000.0}),
                                        "top_logprobs": 1})
    out = r.json()
    assert r.status_code == 200 and out["token_ids"][1:] == [forced] * 7, out
    assert out["logprobs"][1] < -1.0 and out["top_logprobs"][1][0][0] != forced  # raw: the bias is not in them
    wait_idle(client)
    allowed = [greedy[3], (greedy[3] + 5) % VOCAB]
    first = ship(client, reference, source, "r-allowed")
    out = client.post("/pd/decode", json=body("r-allowed", first, max_tokens=8, allowed_token_ids=allowed)).json()
    assert set(out["token_ids"][1:]) <= set(allowed), out
    wait_idle(client)
    first = ship(client, reference, source, "r-minp")
    out = client.post("/pd/decode", json=body("r-minp", first, max_tokens=8, temperature=1.0, min_p=1.0,
                                              seed=3)).json()
    assert out["token_ids"] == greedy, out


def test_a_per_request_node_runs_each_request_on_a_family_and_counts_it(model_dir, reference):
    """A node whose engine holds a runner of each GEMV family (lean_gemv per-request, decode/family.py; on the
    CPU both run the PyTorch step): replies are the reference's tokens whichever family ran, capabilities show
    both families' measured costs, and /metrics counts the requests each family ran."""
    engine = DecodeEngine.from_pretrained(model_dir, max_seq_len=MAX_SEQ, lean_gemv="per-request")
    engine.warmup()
    source = LocalKVSource()
    app = create_app(ServerConfig(model=str(model_dir), max_seq_len=MAX_SEQ, kv_timeout_s=5.0), engine, source)
    with LiveServer(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        caps = client.get("/capabilities").json()
        assert caps["lean_gemv"] == "per-request"
        assert {f: c["step_costs"]["measured"] for f, c in caps["gemv_families"].items()} == \
            {"cuda-core": True, "tensor-core": True}
        loop = PROMPT * 8
        for i, lookup in enumerate((loop, None)):
            first = ship(client, reference, source, f"r-family-{i}", prompt=loop)
            want = expected(reference, first, 20, prompt=loop, ignore_eos=True)
            payload = {**body(f"r-family-{i}", first, max_tokens=20),
                       **({"prompt_token_ids": lookup} if lookup else {})}
            r = client.post("/pd/decode", json=payload)
            assert r.status_code == 200 and r.json()["token_ids"] == want, r.text
            wait_idle(client)
        ran = {f: metric(client, "expresslane_decode_spec_family_requests_total", f'family="{f}"')
               for f in ("cuda-core", "tensor-core")}
        assert sum(ran.values()) == 2, ran
