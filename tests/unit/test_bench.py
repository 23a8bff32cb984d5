"""scripts/bench.py's statistics and report code: percentiles, tokens/s accounting, metric deltas, the JSON
keys docs/performance.md documents. No servers."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from bench_lib import extract, overheads, report  # noqa: E402
from bench_lib.client import completion_body, token_prompt  # noqa: E402
from bench_lib.prom import Snapshot, hist_quantile, parse  # noqa: E402
from bench_lib.stats import RequestResult, distribution, percentile, summarize  # noqa: E402

DOC = (REPO / "docs" / "performance.md").read_text()


# ---- percentiles ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
def test_percentile_matches_numpy_linear(n):
    rng = random.Random(n)
    xs = [rng.uniform(0, 100) for _ in range(n)]
    for q in (0, 1, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-12)


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_keys_scale_and_empty():
    d = distribution([0.001, 0.002, 0.003], (50, 99), scale=1e3)
    assert list(d) == ["p50", "p99", "mean", "n"]
    assert d["p50"] == 2.0 and d["mean"] == 2.0 and d["n"] == 3
    assert distribution([], (50,)) == {"p50": None, "mean": None, "n": 0}


# ---- per-request accounting ----------------------------------------------------------------------

def _req(sent, chunks, tokens=None, status=200, error=None, end=None):
    return RequestResult(sent_at=sent, chunk_times=list(chunks), finished_at=end if end is not None else
                         (chunks[-1] if chunks else sent), completion_tokens=tokens, status=status, error=error)


def test_request_ttft_itl_and_user_tokens_per_second():
    r = _req(10.0, [10.5, 10.6, 10.8, 11.5], tokens=4)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.itls_s == pytest.approx([0.1, 0.2, 0.7])
    # tokens after the first / time from first to last text chunk
    assert r.user_tok_s == pytest.approx(3 / 1.0)


def test_user_tokens_per_second_counts_usage_tokens_not_chunks():
    # a lane that batches: 2 chunks carrying 9 tokens (usage says 9)
    r = _req(0.0, [1.0, 2.0], tokens=9)
    assert r.user_tok_s == pytest.approx(8 / 1.0)
    # no usage chunk: fall back to the number of chunks (a lower bound)
    r = _req(0.0, [1.0, 1.5, 2.0])
    assert r.tokens == 3 and r.user_tok_s == pytest.approx(2 / 1.0)


def test_one_token_has_no_decode_speed():
    r = _req(0.0, [0.3], tokens=1)
    assert r.ttft_s == pytest.approx(0.3)
    assert r.user_tok_s is None and r.decode_s is None and r.itls_s == []


def test_failed_requests_are_errors_not_samples():
    rs = [_req(0.0, [1.0, 2.0], tokens=2), _req(0.0, [], status=429, error="HTTP 429: busy"),
          _req(0.0, [0.5], status=200, error="stream error: boom"), _req(0.0, [], status=200)]
    s = summarize(rs, expected_tokens=2, wall_s=4.0)
    assert (s.requests, s.ok, s.errors) == (4, 1, 3)
    assert s.error_samples == ["HTTP 429: busy", "stream error: boom", "no text chunks"]
    assert s.ttft_ms["n"] == 1 and s.ttft_ms["p50"] == 1000.0
    assert s.completion_tokens == 2 and s.aggregate_tok_s == 0.5


def test_summary_aggregate_and_short_outputs():
    rs = [_req(0.0, [1.0 + 0.1 * i for i in range(5)], tokens=5, end=1.5),
          _req(0.5, [2.0 + 0.2 * i for i in range(5)], tokens=5, end=3.0),
          _req(1.0, [1.5, 2.5], tokens=4, end=2.6)]
    s = summarize(rs, expected_tokens=5)
    assert s.wall_s == pytest.approx(3.0)  # first sent (0.0) -> last finished (3.0)
    assert s.completion_tokens == 14
    assert s.aggregate_tok_s == pytest.approx(14 / 3.0, abs=0.01)
    assert s.short_outputs == 1
    assert s.tokens_per_chunk == pytest.approx(14 / 12, abs=1e-3)
    assert s.user_tok_s["n"] == 3
    assert s.user_tok_s["p50"] == pytest.approx(5.0)  # 4/0.4, 4/0.8, 3/1.0 = 10, 5, 3
    assert s.itl_ms["n"] == 4 + 4 + 1
    assert set(s.as_dict()) <= set(report.SCENARIO_KEYS)


# ---- prompts and bodies --------------------------------------------------------------------------

def test_token_prompts_exact_length_unique_and_deterministic():
    a = token_prompt(3800, "n/express/1/3800/0", 1024)
    assert len(a) == 3800 and a == token_prompt(3800, "n/express/1/3800/0", 1024)
    assert all(16 <= t < 1024 - 16 for t in a)
    # different keys differ already in the first block (the prefix cache hashes whole blocks)
    assert a[:16] != token_prompt(3800, "n/express/1/3800/1", 1024)[:16]


def test_completion_body_streams_with_usage_and_ignores_eos():
    b = completion_body("m", [1, 2], 64, stream=True)
    assert b["ignore_eos"] is True and b["max_tokens"] == 64 and b["stream_options"] == {"include_usage": True}
    assert "stream_options" not in completion_body("m", [1], 1, stream=False)


# ---- Prometheus scrapes ----------------------------------------------------------------------------

SCRAPE_1 = """
# HELP expresslane_decode_handoff_seconds x
# TYPE expresslane_decode_handoff_seconds histogram
expresslane_decode_handoff_seconds_bucket{le="0.01"} 1.0
expresslane_decode_handoff_seconds_bucket{le="0.1"} 2.0
expresslane_decode_handoff_seconds_bucket{le="+Inf"} 2.0
expresslane_decode_handoff_seconds_count 2.0
expresslane_decode_handoff_seconds_sum 0.05
expresslane_decode_handoff_bytes_total 1e6
expresslane_router_queue_wait_seconds_bucket{lane="express",le="0.1"} 0.0
expresslane_router_queue_wait_seconds_bucket{lane="express",le="1.0"} 0.0
expresslane_router_queue_wait_seconds_bucket{lane="express",le="+Inf"} 0.0
expresslane_router_queue_wait_seconds_count{lane="express"} 0.0
expresslane_router_queue_wait_seconds_sum{lane="express"} 0.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny-llama"} 5.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny-llama"} 1.0
"""
SCRAPE_2 = """
expresslane_decode_handoff_seconds_bucket{le="0.01"} 1.0
expresslane_decode_handoff_seconds_bucket{le="0.1"} 6.0
expresslane_decode_handoff_seconds_bucket{le="+Inf"} 6.0
expresslane_decode_handoff_seconds_count 6.0
expresslane_decode_handoff_seconds_sum 0.25
expresslane_decode_handoff_bytes_total 5e6
expresslane_router_queue_wait_seconds_bucket{lane="express",le="0.1"} 1.0
expresslane_router_queue_wait_seconds_bucket{lane="express",le="1.0"} 3.0
expresslane_router_queue_wait_seconds_bucket{lane="express",le="+Inf"} 4.0
expresslane_router_queue_wait_seconds_count{lane="express"} 4.0
expresslane_router_queue_wait_seconds_sum{lane="express"} 3.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny-llama"} 7.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny-llama"} 1.5
"""


def test_parse_labels_and_colons():
    s = parse(SCRAPE_1)
    key = ("vllm:request_prefill_time_seconds_count", frozenset({("engine", "0"), ("model_name", "tiny-llama")}))
    assert s[key] == 5.0
    assert s[("expresslane_decode_handoff_bytes_total", frozenset())] == 1e6


def test_delta_histogram_and_handoff_rate():
    d = Snapshot(parse(SCRAPE_2)) - Snapshot(parse(SCRAPE_1))
    h = d.hist("expresslane_decode_handoff_seconds")
    assert h["count"] == 4 and h["sum"] == pytest.approx(0.2)
    assert h["buckets"] == [(0.01, 0.0), (0.1, 4.0), (float("inf"), 4.0)]
    ho = extract.express_handoff(d)
    assert ho["n"] == 4 and ho["mean_ms"] == pytest.approx(50.0)
    assert ho["bytes_per_request"] == 1_000_000
    assert ho["gb_per_s"] == pytest.approx(4e6 / 0.2 / 1e9)


def test_hist_quantile_like_prometheus():
    buckets = [(0.1, 1.0), (1.0, 3.0), (float("inf"), 4.0)]
    assert hist_quantile(0.5, buckets) == pytest.approx(0.1 + 0.9 * (2 - 1) / 2)
    assert hist_quantile(0.99, buckets) == 1.0  # in the +Inf bucket: the last finite bound
    assert hist_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None


def test_unavailable_source_gives_null_blocks():
    d = Snapshot(parse(SCRAPE_2)) - Snapshot({}, available=False)
    assert not d.available
    blocks = extract.extract("express", {"express": d})
    assert set(blocks) == {"queue_wait_ms", "router", "handoff", "decode", "express_steps", "connector",
                           "prefill_server"}
    assert all(v is None for v in blocks.values())


def test_extract_per_lane():
    d = Snapshot(parse(SCRAPE_2)) - Snapshot(parse(SCRAPE_1))
    ex = extract.extract("express", {k: d for k in extract.SOURCES})
    assert ex["queue_wait_ms"]["n"] == 4 and ex["queue_wait_ms"]["mean_ms"] == 750.0
    assert ex["prefill_server"]["n"] == 2 and ex["prefill_server"]["prefill_mean_ms"] == 250.0
    assert ex["handoff"]["source"] == "express_node"
    na = extract.extract("native", {k: d for k in extract.SOURCES})
    assert na["queue_wait_ms"] is None and na["handoff"] is None  # no vllm:nixl_* series exported
    assert extract.extract("single", {k: d for k in extract.SOURCES})["router"] is None


def test_express_steps_by_row_class():
    before = """
expresslane_decode_step_seconds_bucket{le="0.005",rows="1"} 10.0
expresslane_decode_step_seconds_bucket{le="+Inf",rows="1"} 10.0
expresslane_decode_step_seconds_count{rows="1"} 10.0
expresslane_decode_step_seconds_sum{rows="1"} 0.05
"""
    after = """
expresslane_decode_step_seconds_bucket{le="0.005",rows="1"} 30.0
expresslane_decode_step_seconds_bucket{le="+Inf",rows="1"} 30.0
expresslane_decode_step_seconds_count{rows="1"} 30.0
expresslane_decode_step_seconds_sum{rows="1"} 0.15
expresslane_decode_step_seconds_bucket{le="0.005",rows="4"} 0.0
expresslane_decode_step_seconds_bucket{le="0.01",rows="4"} 4.0
expresslane_decode_step_seconds_bucket{le="+Inf",rows="4"} 4.0
expresslane_decode_step_seconds_count{rows="4"} 4.0
expresslane_decode_step_seconds_sum{rows="4"} 0.026
"""
    d = Snapshot(parse(after)) - Snapshot(parse(before))
    steps = extract.extract("express", {"express": d})["express_steps"]
    assert steps == {"1": {"steps": 20, "mean_ms": 5.0}, "4": {"steps": 4, "mean_ms": 6.5}}
    assert extract.extract("native", {"express": d})["express_steps"] is None


def test_nixl_handoff_from_vllm_histograms():
    before = Snapshot(parse('vllm:nixl_xfer_time_seconds_count{engine="0"} 1\nvllm:nixl_xfer_time_seconds_sum{engine="0"} 0.01\n'
                            'vllm:nixl_bytes_transferred_sum{engine="0"} 100\n'))
    after = Snapshot(parse('vllm:nixl_xfer_time_seconds_count{engine="0"} 3\nvllm:nixl_xfer_time_seconds_sum{engine="0"} 0.05\n'
                           'vllm:nixl_bytes_transferred_sum{engine="0"} 8100\n'))
    h = extract.nixl_handoff(after - before)
    assert h == {"source": "vllm_nixl", "n": 2, "mean_ms": 20.0, "bytes_per_request": 4000, "gb_per_s": 0.0002}


def test_server_decode_speed_per_lane():
    ex = Snapshot(parse('expresslane_decode_phase_seconds_count{phase="decode"} 2\n'
                        'expresslane_decode_phase_seconds_sum{phase="decode"} 0.5\n'
                        'expresslane_decode_phase_seconds_count{phase="inject"} 2\n'
                        'expresslane_decode_phase_seconds_sum{phase="inject"} 9\n'
                        'expresslane_decode_generated_tokens_total 100\n'))
    d = extract.decode_speed("express", {"express": ex})
    assert d == {"source": "express_node", "n": 2, "tok_s": 200.0}
    # vLLM counts each request's first token in request_generation_tokens: 2 requests x 51 tokens, 2 s
    vl = Snapshot(parse('vllm:request_decode_time_seconds_count{engine="0"} 2\n'
                        'vllm:request_decode_time_seconds_sum{engine="0"} 2.0\n'
                        'vllm:request_generation_tokens_sum{engine="0"} 102\n'))
    none = Snapshot({}, available=False)
    assert extract.decode_speed("native", {"native": vl, "prefill": none})["tok_s"] == 50.0
    assert extract.decode_speed("single", {"native": none, "prefill": vl})["tok_s"] == 50.0
    assert extract.decode_speed("native", {"native": none, "prefill": vl}) is None


# ---- overheads ---------------------------------------------------------------------------------------

def test_paired_overhead_pct():
    # without the connector 1 % and 3 % faster in two rounds -> overhead 2 %, noise +-1 %
    o, n = overheads.paired_overhead_pct([100.0, 100.0], [101.0, 103.0])
    assert o == pytest.approx(2.0) and n == pytest.approx(1.0)
    assert overheads.paired_overhead_pct([100.0], [99.0]) == (pytest.approx(-1.0), None)
    assert overheads.paired_overhead_pct([], []) == (None, None)


def _scenario(lane, conc, prompt, ttft_p50, tps_p50, prefill_ms=None, copy_ms=None, server_tps=None):
    stats = {"requests": 2, "ok": 2, "errors": 0, "error_samples": [], "short_outputs": 0,
             "completion_tokens": 10, "wall_s": 1.0,
             "ttft_ms": {"p50": ttft_p50, "p90": ttft_p50, "p99": ttft_p50, "mean": ttft_p50, "n": 2},
             "itl_ms": {"p50": 1.0, "p99": 2.0, "mean": 1.0, "n": 8},
             "e2e_ms": {"p50": 90.0, "p90": 90.0, "p99": 90.0, "mean": 90.0, "n": 2}, "tokens_per_chunk": 1.0,
             "user_tok_s": {"p10": tps_p50, "p50": tps_p50, "p90": tps_p50, "mean": tps_p50, "n": 2},
             "aggregate_tok_s": 10.0}
    server = {"queue_wait_ms": None, "router": {"spillover": 0, "rejected": 0, "upstream_errors": 0},
              "handoff": None,
              "decode": {"source": "x", "n": 2, "tok_s": server_tps} if server_tps is not None else None,
              "connector": {"staging_copy_mean_ms": copy_ms} if copy_ms is not None else None,
              "prefill_server": {"prefill_mean_ms": prefill_ms, "ttft_mean_ms": prefill_ms}}
    return report.scenario_record(lane, conc, prompt, 5, stats, [1.0, 1.0], server)


SCENARIOS = [_scenario("express", 1, 128, 10.0, 400.0, 5.0, 0.1), _scenario("native", 1, 128, 11.0, 100.0, 4.0),
             _scenario("express", 1, 1024, 30.0, 300.0, 20.0, 0.4), _scenario("native", 1, 1024, 25.0, 120.0, 19.0),
             _scenario("express", 2, 128, 50.0, 390.0), _scenario("native", 2, 128, 12.0, 90.0),
             _scenario("single", 1, 128, 9.0, 80.0)]


def test_connector_claimed_compares_lanes_at_lowest_concurrency():
    rows = overheads.connector_claimed(SCENARIOS)
    assert [r["prompt_tokens"] for r in rows] == [128, 1024]
    assert rows[0]["overhead_ms"] == 1.0 and rows[0]["overhead_pct"] == 25.0 and rows[0]["staging_copy_ms"] == 0.1
    assert rows[1]["claimed_prefill_ms"] == 20.0 and rows[1]["unclaimed_prefill_ms"] == 19.0


def test_goals():
    ovh = {"connector_unclaimed": {"overhead_pct": 0.1, "noise_pct": 0.8},
           "router": {"overhead_p50_ms": 2.5}}
    g = {x["name"]: x for x in report.goals(SCENARIOS, ovh)}
    assert list(g) == list(report.GOALS)
    tps = g["express_user_tok_s_vs_native"]
    assert tps["per_prompt_tokens"] == {"128": 4.0, "1024": 2.5} and tps["measured"] == 2.5 and tps["met"] is False
    ttft = g["express_ttft_vs_native"]
    assert ttft["measured"] == pytest.approx(1.2) and ttft["met"] is False
    assert g["connector_unclaimed_overhead_pct"]["met"] is True
    assert g["router_p50_overhead_ms"]["met"] is False
    assert tps["basis"] == "client_user_tok_s_p50"  # no server decode speeds in SCENARIOS
    none = {x["name"]: x["met"] for x in report.goals([], {})}
    assert set(none.values()) == {None}


@pytest.mark.parametrize("overhead, noise, met", [
    (0.2, 0.5, True),     # 0.7 < 1: under the limit even at the noise's edge
    (-3.0, 3.5, True),
    (0.5, 0.5, None),     # straddles 1 %: inconclusive
    (1.5, 2.0, None),
    (1.5, 0.2, False),    # over the limit even at the noise's edge
    (0.9, None, True),    # one round: no noise estimate
    (None, None, None),
])
def test_connector_goal_within_noise(overhead, noise, met):
    g = report.goals([], {"connector_unclaimed": {"overhead_pct": overhead, "noise_pct": noise}})
    assert g[2]["name"] == "connector_unclaimed_overhead_pct" and g[2]["met"] is met


# ---- the report: stable keys, documented ------------------------------------------------------------

def _fake_report():
    return {"schema": report.SCHEMA, "started_at": "2025-01-01T00:00:00+00:00",
            "finished_at": "2025-01-01T00:10:00+00:00", "complete": True, "command": "scripts/bench.py --quick", "mode": "quick",
            "host": {"cpus": 2, "loadavg_start": [1.0, 1.0, 1.0], "loadavg_end": [2.0, 1.0, 1.0],
                     "copy_gb_per_s": 10.0, "read_gb_per_s": 12.0,
                     "placement": {"prefill": {"idle_cpu_pct": 95.0, "processes": [
                         {"name": "python", "cpus": [0, 1], "threads": 11, "idle_cpu_pct": 1.0},
                         {"name": "VLLM::Worker", "cpus": [1], "threads": 57, "idle_cpu_pct": 94.0}]}}},
            "model": {"weight_bytes": 1}, "bound": {"weight_bytes_read_per_token": 12_658_688,
                                                    "kv_bytes_per_token": 4096, "bandwidth_gb_per_s": 10.0,
                                                    "bandwidth_kind": "copy",
                                                    "per_context": [{"context_tokens": 160, "bytes_per_token": 13e6,
                                                                     "tok_s_bound": 769.2}]},
            "config": {"output_tokens": 5}, "endpoints": {}, "scenarios": SCENARIOS,
            "overheads": {"connector_unclaimed": None, "connector_claimed": overheads.connector_claimed(SCENARIOS),
                          "router": None},
            "goals": report.goals(SCENARIOS, {}), "samples": {"ttft_ms": {"express/1/128": [10.0, 12.0]}}}


def test_scenario_record_has_exactly_the_stable_keys_in_order():
    assert list(SCENARIOS[0]) == list(report.SCENARIO_KEYS)
    assert json.loads(json.dumps(SCENARIOS[0]))["lane"] == "express"


def test_stable_keys_are_frozen():
    """Renaming or dropping a key breaks consumers of bench.json: bump report.SCHEMA and docs/performance.md."""
    assert report.SCHEMA == "expresslane-bench/1"
    assert report.TOP_KEYS == ("schema", "started_at", "finished_at", "complete", "command", "mode", "host", "model", "bound",
                               "config", "endpoints", "scenarios", "overheads", "goals", "samples")
    assert report.SCENARIO_KEYS == ("lane", "concurrency", "prompt_tokens", "output_tokens", "requests", "ok",
                                    "errors", "error_samples", "short_outputs", "completion_tokens", "wall_s",
                                    "ttft_ms", "itl_ms", "e2e_ms", "tokens_per_chunk", "user_tok_s", "aggregate_tok_s",
                                    "loadavg", "server")


def test_every_stable_key_is_documented():
    documented = set(re.findall(r"`([a-z_0-9]+)`", DOC))
    server_keys = set(extract.extract("express", {}))
    goal_names = set(report.GOALS)
    missing = (set(report.TOP_KEYS) | set(report.SCENARIO_KEYS) | server_keys | goal_names) - documented
    assert not missing, f"docs/performance.md does not document {sorted(missing)}"
    assert report.SCHEMA in DOC


def test_markdown_renders_every_scenario_and_goal():
    md = report.markdown(_fake_report())
    rows = [line for line in md.splitlines() if line.split(" |")[0] in ("| express", "| native", "| single")]
    assert len(rows) == len(SCENARIOS)
    for name in report.GOALS:
        assert name in md
    assert "* prefill: VLLM::Worker on CPUs 1; idle 95 % of one core" in md


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    report.plot(_fake_report(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_partial_report_written_with_the_stable_keys(tmp_path):
    """bench.py rewrites bench.json after every scenario; an interrupted run leaves complete=false."""
    import bench

    args = bench.parse_args(["--quick", "--out", str(tmp_path)])
    rep = bench.Report(tmp_path, args, ["--quick"], concurrency=[1], prompt_tokens=[128], output_tokens=64)
    rep.write()
    data = json.loads((tmp_path / "bench.json").read_text())
    assert tuple(data) == report.TOP_KEYS and data["complete"] is False
    assert "INCOMPLETE" in (tmp_path / "bench.md").read_text()
    rep.data["scenarios"] = list(SCENARIOS)
    rep.write(complete=True)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["complete"] is True and len(data["overheads"]["connector_claimed"]) == 2
    assert [g["name"] for g in data["goals"]] == list(report.GOALS)


def test_speed_goal_prefers_the_decoding_servers_own_speed():
    """A lane that delivers its tokens in a burst looks fast client-side; the goal uses the servers' tok/s."""
    sc = [_scenario("express", 1, 128, 10.0, 5000.0, server_tps=180.0),
          _scenario("native", 1, 128, 11.0, 150.0, server_tps=160.0)]
    g = report.goals(sc, {})[0]
    assert g["basis"] == "server_decode_tok_s"
    assert g["per_prompt_tokens"] == {"128": 1.125} and g["met"] is False
    assert g["client_per_prompt_tokens"] == {"128": 33.333}


@pytest.mark.parametrize("env, expected", [
    ({"PREFILL_CPU_BIND": "0", "DECODE_NATIVE_CPU_BIND": "1"}, ((0,), (1,))),
    ({"PREFILL_CPU_BIND": "0-1", "DECODE_NATIVE_CPU_BIND": "2,3"}, ((0, 1), (2, 3))),
    ({"PREFILL_CPU_BIND": "0", "DECODE_NATIVE_CPU_BIND": "0"}, None),  # shared: nothing to give the baseline
    ({"PREFILL_CPU_BIND": "0", "DECODE_NATIVE_CPU_BIND": "1-2"}, None),  # unequal: not a like-for-like pair
    ({"PREFILL_CPU_BIND": "auto", "DECODE_NATIVE_CPU_BIND": "1"}, None),
    ({}, None),
])
def test_baseline_gets_the_decode_servers_cpus_only_in_a_halves_layout(env, expected):
    from bench_lib.servers import isolated_baseline_cpus

    assert isolated_baseline_cpus(env) == expected


def test_router_cpu_seconds_of_live_processes_only():
    import os
    import subprocess

    assert overheads._cpu_seconds(None) is None and overheads._cpu_seconds([]) is None
    spent = overheads._cpu_seconds([os.getpid()])
    sum(i * i for i in range(300_000))  # burn a little CPU in this process
    assert overheads._cpu_seconds([os.getpid()]) > spent > 0
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert overheads._cpu_seconds([os.getpid(), gone.pid]) is None


def test_bench_router_config_is_one_the_router_and_the_express_node_accept(tmp_path):
    """The bench router's kv_wait_s is sent to the express node as timeout_s: above the node's default
    --max-timeout-s the node refuses every express request (400), and the whole bench fails at warm-up."""
    import yaml

    from bench_lib.servers import Endpoints, bench_router_yaml
    from expresslane.engine.server.config import ServerConfig
    from expresslane.router.config import parse_config

    ep = Endpoints(router="http://127.0.0.1:1", prefill="http://127.0.0.1:2", native="http://127.0.0.1:3",
                   express="http://127.0.0.1:4", connector_metrics=None, express_ctrl_host="127.0.0.1",
                   express_ctrl_port=5, model_dir=tmp_path)
    cfg = parse_config(yaml.safe_load(bench_router_yaml(ep, 6, 4096)))
    assert 0 < cfg.timeouts.kv_wait_s <= ServerConfig(model="m").max_timeout_s


def test_plot_from_renders_a_report_and_decode_bench_lines(tmp_path):
    """`bench.py --plot-from` picks the plot by the file: a bench.json report, or the decode bench's JSON lines
    (records of other engines carry an `engine` key); a file with neither is a clear error, not a traceback."""
    pytest.importorskip("matplotlib")
    import bench

    rep = tmp_path / "bench.json"
    rep.write_text(json.dumps(_fake_report()))
    assert bench.main(["--plot-from", str(rep), "--plot-out", str(tmp_path / "a.png")]) == 0
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = tmp_path / "decode.jsonl"
    recs = [{"model": "m/llama-8b", "context": c, "mode": "plain", "tok_per_s": t, "bound_tok_per_s": 260.0}
            for c, t in ((1024, 248.5), (8192, 234.5))]
    recs += [{"model": "m/llama-8b", "context": 1024, "mode": "plain", "tok_per_s": 200.1, "engine": "vllm"},
             {"kind": "env"}]
    lines.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert bench.main(["--plot-from", str(lines)]) == 0
    assert (tmp_path / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "other.jsonl"
    empty.write_text('{"kind": "env"}\n')
    with pytest.raises(SystemExit, match="no decode-bench records"):
        bench.main(["--plot-from", str(empty)])


def test_key_files_become_bearer_headers_and_never_reach_the_report(tmp_path):
    """--vllm-api-key-file / --router-api-key-file (a closed compose stack): the file's key (a ROUTER_API_KEYS
    line: the key, then its options) as a bearer header; an empty file is refused by name; the report keeps the
    command line (the file's path), never the key."""
    import bench

    keys = tmp_path / "keys"
    keys.write_text("sk-bench-123 name=bench lanes=express,native\nsk-other\n")
    assert bench._bearer(keys) == {"Authorization": "Bearer sk-bench-123"}
    assert bench._bearer(None) is None
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(OSError, match="holds no key"):
        bench._bearer(empty)
    argv = ["--quick", "--out", str(tmp_path), "--router-api-key-file", str(keys)]
    args = bench.parse_args(argv)
    assert args.router_api_key_file == keys
    bench.Report(tmp_path, args, argv, concurrency=[1], prompt_tokens=[128], output_tokens=64).write()
    assert "sk-bench-123" not in (tmp_path / "bench.json").read_text()
