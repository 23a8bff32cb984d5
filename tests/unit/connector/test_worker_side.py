"""Worker side: real paged CPU KV caches written by vLLM's op -> staging -> NIXL -> a real KVReceiver."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch

from .conftest import BLOCK, HEAD_DIM, HEADS, LAYERS, make_kv_cache_config, make_vllm_config

pytest.importorskip("vllm")
pytest.importorskip("nixl")

NUM_BLOCKS = 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _caches() -> dict[str, torch.Tensor]:
    """Per-layer caches exactly as vLLM's CPU worker builds them (create_kv_cache_views, LBHNC)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    page = spec.page_size_bytes
    raw = torch.zeros(NUM_BLOCKS * page * len(LAYERS), dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, NUM_BLOCKS, KVCacheLayout.LBHNC,
                                  KVCacheTensor(size=raw.numel(), layers=LAYERS, layer_stride=NUM_BLOCKS * page,
                                                block_stride=page))
    return dict(zip(LAYERS, views))


def _write(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """CPUAttentionBackendImpl.do_kv_cache_update, verbatim."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    nb, h, bs, _ = cache.size()
    key_cache, value_cache = cache.view((nb, h, bs * 2, -1)).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots,
                                   _get_attn_isa(torch.float32, bs, HEAD_DIM, "auto"))


def _stats(w) -> dict:
    """What the worker has recorded and not yet handed to vLLM (get_kv_connector_stats drains it)."""
    return w.stats.peek().data


@pytest.fixture()
def worker(model_dir):
    from expresslane.engine.connector.config import ExpressLaneConnectorConfig
    from expresslane.engine.connector.worker import ExpressLaneWorker

    w = ExpressLaneWorker(make_vllm_config(model_dir), make_kv_cache_config(NUM_BLOCKS),
                          ExpressLaneConnectorConfig(staging_slots=1, staging_max_tokens=256, busy_retry_s=0.2))
    caches = _caches()
    w.register_kv_caches(caches)
    yield w, caches
    w.shutdown()


def test_stages_and_ships_byte_exact(worker) -> None:
    from expresslane.engine.connector.metadata import Claim, ExpressLaneConnectorMetadata, ShipRequest
    from expresslane.engine.transfer import KVReceiver

    w, caches = worker
    assert w._layouts[0].backend == "CPU_ATTN"
    T, blocks = 40, [7, 2, 19]
    slots = torch.tensor([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(T)])
    ks = [torch.randn(T, HEADS, HEAD_DIM) for _ in LAYERS]
    vs = [torch.randn(T, HEADS, HEAD_DIM) for _ in LAYERS]
    for name, k, v in zip(LAYERS, ks, vs):
        _write(caches[name], k, v, slots)

    port = _free_port()
    rx = KVReceiver(len(LAYERS), HEADS, HEAD_DIM, torch.float32, "cpu", 256, "127.0.0.1", ctrl_port=port)
    rx.start()
    rx.expect("rid-1", 30)
    try:
        meta = ExpressLaneConnectorMetadata(
            ship=[ShipRequest("req-1", Claim("127.0.0.1", port, "rid-1"), T, (blocks + [25],))])
        w.wait_for_save(meta)
        assert _stats(w)["staging_copies"] == 1  # copied inside the step
        # Overwrite the paged cache right after the step: what ships is the staged copy.
        for cache in caches.values():
            cache.zero_()
        got = asyncio.run(rx.wait_for("rid-1", 10))
        assert torch.equal(got.k, torch.stack(ks)) and torch.equal(got.v, torch.stack(vs))
        got.release()
    finally:
        rx.stop()
    w.sender.stop()  # drain: the observer has run
    stats = w.get_stats()  # what vLLM's get_kv_connector_stats hands over, once
    m = stats.data
    assert m["sent_requests"] == 1 and len(m["send_seconds"]) == 1 and len(m["staging_copy_seconds"]) == 1
    assert m["sent_bytes"] == m["staging_bytes"] == 2 * 2 * T * HEADS * HEAD_DIM * 4
    assert w.pool.num_free == 1 and m["staging_slots_in_use"] == {"0": 0} and m["staging_slots_free"] == {"0": 1}
    # the scheduler side learns the rid is done (it keeps vLLM stepping until then), after its numbers left
    assert w.build_worker_meta().done == {"rid-1": 1} and w.build_worker_meta() is None
    assert w.get_stats() is None  # drained


def test_unclaimed_step_touches_nothing(worker) -> None:
    from expresslane.engine.connector.metadata import ExpressLaneConnectorMetadata

    w, _ = worker
    before = w.pool.buffer.clone()
    w.wait_for_save(None)
    w.wait_for_save(ExpressLaneConnectorMetadata())
    w.get_stats()  # the gauges' initial values
    w.wait_for_save(ExpressLaneConnectorMetadata(stats_delta={"unclaimed_requests": 3}))  # side port off: ignored
    assert w.get_stats() is None and w.build_worker_meta() is None
    assert w.pool.num_free == 1 and torch.equal(before, w.pool.buffer)
    assert not w.sender._destinations  # no worker thread was even started


def test_no_free_slot_fails_loudly_without_blocking(worker) -> None:
    from expresslane.engine.connector.metadata import Claim, ExpressLaneConnectorMetadata, ShipRequest

    w, _ = worker
    from expresslane.engine.transfer import KVReceiver, KVTransferFailed

    w, _ = worker
    port = _free_port()
    rx = KVReceiver(len(LAYERS), HEADS, HEAD_DIM, torch.float32, "cpu", 256, "127.0.0.1", ctrl_port=port)
    rx.start()
    try:
        rx.expect("rid", 30)
        held = w.pool.acquire()  # the only slot is in flight
        assert _stats(w)["staging_slots_in_use"] == {"0": 1}
        meta = ExpressLaneConnectorMetadata(ship=[ShipRequest("r", Claim("127.0.0.1", port, "rid"), 10, ([1],)),
                                                  ShipRequest("r2", Claim("127.0.0.1", 1, "rid2"), 999, ([1],))])
        t0 = time.monotonic()
        w.wait_for_save(meta)
        assert time.monotonic() - t0 < 0.5  # the forward never waits
        assert _stats(w)["send_failures"] == {"no_staging_slot": 1, "too_long": 1}
        assert "staging_copies" not in _stats(w)
        # the node's waiter learns at once (abort frame), it does not wait out its timeout
        with pytest.raises(KVTransferFailed) as e:
            asyncio.run(rx.wait_for("rid", 10))
        assert e.value.reason == "aborted:no_staging_slot"
        held.release()
        assert _stats(w)["staging_slots_in_use"] == {"0": 0}
        w.sender.stop()  # the abort jobs have ended: both rids are done for the scheduler side ...
        assert w.build_worker_meta() is None  # ... once their numbers have been handed to vLLM
        w.get_stats()
        assert w.build_worker_meta().done == {"rid": 1, "rid2": 1}
    finally:
        rx.stop()


def test_unreachable_decode_node_counts_a_failure_and_frees_the_slot(worker) -> None:
    from expresslane.engine.connector.metadata import Claim, ExpressLaneConnectorMetadata, ShipRequest

    w, _ = worker
    w.wait_for_save(ExpressLaneConnectorMetadata(
        ship=[ShipRequest("r", Claim("127.0.0.1", _free_port(), "rid"), 10, ([1],))]))
    w.sender.stop()
    assert _stats(w)["send_failures"] == {"connect": 1}
    assert w.pool.num_free == 1 and _stats(w)["staging_slots_in_use"] == {"0": 0}
    w.get_stats()
    assert w.build_worker_meta().done == {"rid": 1}
