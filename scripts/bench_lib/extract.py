"""Server-side numbers of one scenario, from the difference of two scrapes of each server's /metrics.

Sources (docs/performance.md, "Method": server numbers):
  router     expresslane_router_queue_wait_seconds{lane="express"}, _spillover_total, _rejected_total,
             _upstream_errors_total                                      (the bench router)
  express    expresslane_decode_handoff_bytes_total, _handoff_seconds, _phase_seconds{phase},
             _step_seconds{rows} (express node: its decode steps by row count, wall time of each)
  connector  expresslane_connector_*                                     (prefill worker, CONNECTOR_METRICS_PORT)
  nixl       vllm:nixl_xfer_time_seconds, vllm:nixl_bytes_transferred    (native decode node, if exported)
  prefill    vllm:request_prefill_time_seconds, vllm:request_queue_time_seconds,
             vllm:time_to_first_token_seconds, vllm:prefix_cache_hits_total   (prefill server)
  decode     expresslane_decode_phase_seconds{phase="decode"}, _generated_tokens_total (express node);
             vllm:request_decode_time_seconds, vllm:request_generation_tokens (native decode / single server)
"""

from __future__ import annotations

from .prom import Snapshot, hist_quantile

__all__ = ["extract", "SOURCES"]

SOURCES = ("router", "prefill", "native", "express", "connector")


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def _mean_ms(h: dict) -> float | None:
    return _r(1e3 * h["sum"] / h["count"]) if h["count"] > 0 else None


def _gbps(nbytes: float, seconds: float) -> float | None:
    return _r(nbytes / seconds / 1e9, 4) if seconds > 0 and nbytes > 0 else None


def queue_wait(router: Snapshot, lane: str = "express") -> dict | None:
    if not router.available:
        return None
    h = router.hist("expresslane_router_queue_wait_seconds", lane=lane)
    p50, p90 = hist_quantile(0.5, h["buckets"]), hist_quantile(0.9, h["buckets"])
    return {"n": int(h["count"]), "mean_ms": _mean_ms(h),
            "p50_ms": _r(None if p50 is None else 1e3 * p50), "p90_ms": _r(None if p90 is None else 1e3 * p90)}


def router_counts(router: Snapshot) -> dict | None:
    if not router.available:
        return None
    return {"spillover": int(router.value("expresslane_router_spillover_total")),
            "rejected": int(router.value("expresslane_router_rejected_total")),
            "upstream_errors": int(router.value("expresslane_router_upstream_errors_total"))}


def express_handoff(express: Snapshot) -> dict | None:
    if not express.available:
        return None
    h = express.hist("expresslane_decode_handoff_seconds")
    nbytes = express.value("expresslane_decode_handoff_bytes_total")
    if h["count"] <= 0:
        return None
    phases = {p: _mean_ms(express.hist("expresslane_decode_phase_seconds", phase=p))
              for p in ("wire_wait", "convert", "inject", "decode")}
    return {"source": "express_node", "n": int(h["count"]), "mean_ms": _mean_ms(h),
            "bytes_per_request": int(nbytes / h["count"]), "gb_per_s": _gbps(nbytes, h["sum"]),
            "phase_mean_ms": phases}


def nixl_handoff(native: Snapshot) -> dict | None:
    if not native.available or not native.has("vllm:nixl_xfer_time_seconds_count"):
        return None
    h = native.hist("vllm:nixl_xfer_time_seconds")
    nbytes = native.value("vllm:nixl_bytes_transferred_sum")
    if h["count"] <= 0:
        return None
    return {"source": "vllm_nixl", "n": int(h["count"]), "mean_ms": _mean_ms(h),
            "bytes_per_request": int(nbytes / h["count"]), "gb_per_s": _gbps(nbytes, h["sum"])}


def connector(conn: Snapshot) -> dict | None:
    if not conn.available:
        return None
    copy = conn.hist("expresslane_connector_staging_copy_seconds")
    send = conn.hist("expresslane_connector_send_seconds")
    sent_bytes = conn.value("expresslane_connector_sent_bytes_total")
    return {"claimed": int(conn.value("expresslane_connector_claimed_requests_total")),
            "unclaimed": int(conn.value("expresslane_connector_unclaimed_requests_total")),
            "staging_copies": int(copy["count"]), "staging_copy_mean_ms": _mean_ms(copy),
            "staging_bytes": int(conn.value("expresslane_connector_staging_bytes_total")),
            "sent": int(conn.value("expresslane_connector_sent_requests_total")),
            "sent_bytes": int(sent_bytes), "send_mean_ms": _mean_ms(send),
            "send_gb_per_s": _gbps(sent_bytes, send["sum"]),
            "send_failures": int(conn.value("expresslane_connector_send_failures_total"))}


def prefill_server(prefill: Snapshot) -> dict | None:
    if not prefill.available:
        return None
    pf = prefill.hist("vllm:request_prefill_time_seconds")
    return {"n": int(pf["count"]), "prefill_mean_ms": _mean_ms(pf),
            "queue_mean_ms": _mean_ms(prefill.hist("vllm:request_queue_time_seconds")),
            "ttft_mean_ms": _mean_ms(prefill.hist("vllm:time_to_first_token_seconds")),
            "prompt_tokens": int(prefill.value("vllm:prompt_tokens_total")),
            "prefix_cache_hits": int(prefill.value("vllm:prefix_cache_hits_total"))}


def decode_speed(lane: str, d: dict[str, Snapshot]) -> dict | None:
    """The decoding server's own tokens/s (tokens after the first / decode time, summed over the scenario's
    requests): a cross-check of the client's per-user tok/s that no client or relay scheduling can distort."""
    if lane == "express":
        ex = d["express"]
        if not ex.available:
            return None
        h = ex.hist("expresslane_decode_phase_seconds", phase="decode")
        tokens = ex.value("expresslane_decode_generated_tokens_total")
        source = "express_node"
    else:
        snap = d["native"] if lane == "native" else d["prefill"]
        if not snap.available:
            return None
        h = snap.hist("vllm:request_decode_time_seconds")
        # vLLM counts the first token (the decode node's, or the single server's own) in the generation
        tokens = snap.value("vllm:request_generation_tokens_sum") - h["count"]
        source = "vllm"
    if h["count"] <= 0 or h["sum"] <= 0:
        return None
    return {"source": source, "n": int(h["count"]), "tok_s": _r(tokens / h["sum"], 2)}


def express_steps(express: Snapshot) -> dict | None:
    """The express node's decode steps in the scenario, by row class: how many and their mean wall time (the
    engine thread's step: settle, forward, deliver, consume). Beside the client's ITL it tells the node's step
    from what lies between steps (joins, injects) and between node and client."""
    if not express.available:
        return None
    out = {}
    for (name, labels), _ in express.samples.items():
        if name != "expresslane_decode_step_seconds_count":
            continue
        rows = dict(labels).get("rows")
        h = express.hist("expresslane_decode_step_seconds", rows=rows)
        if h["count"] > 0:
            out[rows] = {"steps": int(h["count"]), "mean_ms": _mean_ms(h)}
    return dict(sorted(out.items())) or None


def extract(lane: str, deltas: dict[str, Snapshot]) -> dict:
    """The `server` block of one scenario (stable keys; a block is null when its source gave nothing)."""
    none = Snapshot({}, available=False)
    d = {k: deltas.get(k, none) for k in SOURCES}
    handoff = None
    if lane == "express":
        handoff = express_handoff(d["express"])
    elif lane == "native":
        handoff = nixl_handoff(d["native"])
    return {
        "queue_wait_ms": queue_wait(d["router"]) if lane == "express" else None,
        "router": router_counts(d["router"]) if lane != "single" else None,
        "handoff": handoff,
        "decode": decode_speed(lane, d),
        "express_steps": express_steps(d["express"]) if lane == "express" else None,
        "connector": connector(d["connector"]),
        "prefill_server": prefill_server(d["prefill"]),
    }
