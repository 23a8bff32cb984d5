"""REAL loopback: KVSender -> KVReceiver over TCP control + NIXL WRITE between two agents on localhost."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("nixl")

from expresslane.engine.protocol.layout import KVLayoutSpec  # noqa: E402
from expresslane.engine.transfer import (  # noqa: E402
    KVCancelled,
    KVReceiver,
    KVRefused,
    KVTimeout,
    KVTransferFailed,
    SendError,
)
from expresslane.engine.transfer.nixl_transport import NixlEndpoint  # noqa: E402
from expresslane.engine.transfer.sender import KVSender, SenderConfig, SendJob  # noqa: E402
from expresslane.engine.transfer.staging import StagingPool  # noqa: E402

L, H, D, MAX = 3, 4, 16, 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def receiver():
    rx = KVReceiver(L, H, D, torch.float32, "cpu", MAX, "127.0.0.1", ctrl_port=_free_port(), num_slots=1,
                    unclaimed_ttl_s=1.0)
    rx.start()
    yield rx
    rx.stop()


class _Prefill:
    """One prefill rank: staging pool + NIXL endpoint + sender."""

    def __init__(self, layout: KVLayoutSpec, heads: int | None = None, rank: int = 0, world: int = 1,
                 busy_retry_s: float = 0.3, fingerprint: str = "") -> None:
        self.layout = layout
        self.heads = layout.num_kv_heads if heads is None else heads
        self.pool = StagingPool(2, layout.request_nbytes(MAX, self.heads))
        self.endpoint = NixlEndpoint("test-prefill")
        region = self.endpoint.register(self.pool.buffer)
        self.sender = KVSender(self.endpoint, region, layout, rank=rank, world_size=world,
                               head_start=rank * self.heads, num_heads=self.heads,
                               config=SenderConfig(busy_retry_s=busy_retry_s, io_timeout_s=5),
                               model_fingerprint=fingerprint)

    def stage(self, rid: str, port: int, T: int, seed: int = 0):
        slot = self.pool.acquire()
        assert slot is not None
        k, v = slot.dense_kv(L, T, self.heads, D, self.layout.torch_dtype)
        gen = torch.Generator().manual_seed(seed)
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
        job = SendJob(rid=rid, host="127.0.0.1", port=port, num_tokens=T, slot=slot,
                      nbytes=self.layout.request_nbytes(T, self.heads))
        return job, k.clone(), v.clone()


LAYOUT = KVLayoutSpec(L, H, D, "float32", MAX)


async def test_byte_exact_arrival_then_release(receiver: KVReceiver) -> None:
    tx = _Prefill(LAYOUT)
    receiver.expect("r1", 5)
    job, k, v = tx.stage("r1", receiver.ctrl_port, 37)
    await asyncio.to_thread(tx.sender.send, job)
    assert tx.pool.num_free == 2  # slot released after the send
    got = await receiver.wait_for("r1", 5)  # arrived before wait_for was called
    assert got.rid == "r1" and got.num_tokens == 37 and got.k.shape == (L, 37, H, D)
    assert torch.equal(got.k, k) and torch.equal(got.v, v)
    assert got.nbytes == LAYOUT.request_nbytes(37) and got.wire_wait_s < 0.5
    assert receiver.stats["slots_in_use"] == 1
    got.release()
    got.release()  # idempotent
    assert receiver.stats["slots_in_use"] == 0
    # The slot is free again: a second request fits the single receive slot; wait_for reserves it.
    job, k2, _ = tx.stage("r2", receiver.ctrl_port, 5, seed=1)
    waiter = asyncio.create_task(receiver.wait_for("r2", 5))  # waiting before the KV arrives
    await asyncio.sleep(0.05)
    await asyncio.to_thread(tx.sender.send, job)
    got2 = await waiter
    assert torch.equal(got2.k, k2)
    got2.release()


async def test_kv_for_an_unknown_rid_is_refused_at_admit(receiver: KVReceiver) -> None:
    tx = _Prefill(LAYOUT)
    job, _, _ = tx.stage("nobody-asked", receiver.ctrl_port, 4)
    with pytest.raises(SendError) as e:
        await asyncio.to_thread(tx.sender.send, job)
    assert e.value.reason == "rejected_unknown_rid"
    assert receiver.stats["refused_unknown_rid"] == 1 and receiver.stats["slots_in_use"] == 0
    assert tx.pool.num_free == 2


async def test_one_slot_expect_refuses_a_second_rid(receiver: KVReceiver) -> None:
    receiver.expect("held", 5)
    with pytest.raises(KVRefused) as e:
        receiver.expect("other", 5)
    assert e.value.reason == "no_slot"
    receiver.cancel("held")
    receiver.expect("other", 5)  # freed by the cancel at once (nothing was writing)
    receiver.cancel("other")


async def test_too_long_layout_and_model_mismatch_are_not_retried(receiver: KVReceiver) -> None:
    long_layout = KVLayoutSpec(L, H, D, "float32", MAX * 2)
    tx = _Prefill(long_layout)
    tx.pool = StagingPool(1, long_layout.request_nbytes(MAX + 1))
    tx.sender.staging_region = tx.endpoint.register(tx.pool.buffer)
    slot = tx.pool.acquire()
    receiver.expect("rl", 5)
    job = SendJob("rl", "127.0.0.1", receiver.ctrl_port, MAX + 1, slot, long_layout.request_nbytes(MAX + 1))
    with pytest.raises(SendError) as e:
        tx.sender.send(job)
    assert e.value.reason == "rejected_too_long"
    # the sender told the node at once: the reserved rid failed, its waiter does not wait out its timeout
    with pytest.raises(KVTransferFailed) as f:
        await receiver.wait_for("rl", 5)
    assert f.value.reason == "aborted:rejected_too_long"

    bad = _Prefill(KVLayoutSpec(L, H, D, "bfloat16", MAX))
    job, _, _ = bad.stage("rm", receiver.ctrl_port, 4)
    with pytest.raises(SendError) as e:
        bad.sender.send(job)
    assert e.value.reason == "incompatible" and "dtype" in e.value.detail
    assert bad.pool.num_free == 2

    receiver.model_fingerprint = "a" * 32
    other = _Prefill(LAYOUT, fingerprint="b" * 32)
    receiver.expect("rf", 5)
    job, _, _ = other.stage("rf", receiver.ctrl_port, 4)
    with pytest.raises(SendError) as e:
        other.sender.send(job)
    assert e.value.reason == "incompatible"
    assert "a" * 32 in e.value.detail and "b" * 32 in e.value.detail  # names both sides
    receiver.model_fingerprint = ""


async def test_timeout_and_unclaimed_expiry(receiver: KVReceiver) -> None:
    with pytest.raises(KVTimeout):
        await receiver.wait_for("never", 0.2)
    await asyncio.sleep(1.6)  # the wait's reservation expires just after the wait (WAIT_GRACE_S)
    assert receiver.stats["slots_in_use"] == 0
    tx = _Prefill(LAYOUT)
    receiver.expect("rx", 0.5)
    job, _, _ = tx.stage("rx", receiver.ctrl_port, 4)
    tx.sender.send(job)
    await asyncio.sleep(2.0)  # unclaimed_ttl_s=1: dropped by the reaper, slot freed
    assert receiver.stats["expired"] >= 1 and receiver.stats["slots_in_use"] == 0
    with pytest.raises(KVTransferFailed) as e:
        await receiver.wait_for("rx", 0.1)
    assert e.value.reason == "expired"
    receiver.expect("ry", 5)
    job, _, _ = tx.stage("ry", receiver.ctrl_port, 4)
    tx.sender.send(job)  # the slot was given back
    (await receiver.wait_for("ry", 1)).release()


async def test_cancel_wakes_waiter_and_rejects_late_admit(receiver: KVReceiver) -> None:
    waiter = asyncio.create_task(receiver.wait_for("rk", 5))
    await asyncio.sleep(0.05)
    receiver.cancel("rk")
    with pytest.raises(KVCancelled):
        await waiter
    tx = _Prefill(LAYOUT)
    job, _, _ = tx.stage("rk", receiver.ctrl_port, 4)
    with pytest.raises(SendError) as e:
        tx.sender.send(job)
    assert e.value.reason == "rejected_cancelled"
    with pytest.raises(KVCancelled):
        await receiver.wait_for("rk", 0.1)
    # Cancel after arrival frees the slot at once.
    receiver.expect("rz", 5)
    job, _, _ = tx.stage("rz", receiver.ctrl_port, 4)
    tx.sender.send(job)
    receiver.cancel("rz")
    receiver.expect("rw", 5)
    job, _, _ = tx.stage("rw", receiver.ctrl_port, 4)
    tx.sender.send(job)
    (await receiver.wait_for("rw", 1)).release()


async def test_two_ranks_assemble_heads(receiver: KVReceiver) -> None:
    """TP=2 prefill: each rank writes its half of the KV heads; the receiver hands out all heads."""
    ranks = [_Prefill(LAYOUT, heads=H // 2, rank=r, world=2) for r in range(2)]
    staged = [p.stage("rt", receiver.ctrl_port, 9, seed=r) for r, p in enumerate(ranks)]
    waiter = asyncio.create_task(receiver.wait_for("rt", 5))
    await asyncio.sleep(0.05)
    await asyncio.gather(*(asyncio.to_thread(p.sender.send, job) for p, (job, _, _) in zip(ranks, staged)))
    got = await waiter
    assert torch.equal(got.k, torch.cat([staged[0][1], staged[1][1]], dim=2))
    assert torch.equal(got.v, torch.cat([staged[0][2], staged[1][2]], dim=2))
    got.release()


def test_unreachable_decode_node_fails_fast() -> None:
    tx = _Prefill(LAYOUT)
    job, _, _ = tx.stage("ru", _free_port(), 4)
    t0 = time.monotonic()
    with pytest.raises(SendError) as e:
        tx.sender.send(job)
    assert e.value.reason == "connect" and "3 attempt" in e.value.detail  # bounded retries
    assert time.monotonic() - t0 < 3
    assert tx.pool.num_free == 2


def test_staging_pool_never_blocks_and_reports_in_use() -> None:
    seen: list[int] = []
    pool = StagingPool(2, 1000, on_change=seen.append)
    a, b = pool.acquire(), pool.acquire()
    assert pool.acquire() is None
    a.release()
    a.release()
    assert pool.num_free == 1 and pool.acquire() is a
    assert pool.slot_nbytes % 256 == 0 and b.offset == pool.slot_nbytes
    assert seen == [1, 2, 1, 2]


def _cpu_seconds_over(wall_s: float) -> float:
    t0 = time.process_time()
    time.sleep(wall_s)
    return time.process_time() - t0


async def test_idle_endpoints_do_not_busy_poll(receiver: KVReceiver) -> None:
    """An idle prefill endpoint and an idle receiver must leave the CPU alone: NIXL's own progress thread
    busy-polls a whole core, and inside vLLM's pinned worker that slowed every unclaimed decode step 4-15x.
    After a transfer (so UCX endpoints are wired up), both sides idle again."""
    tx = _Prefill(LAYOUT)
    assert await asyncio.to_thread(_cpu_seconds_over, 1.0) < 0.3
    receiver.expect("idle", 5)
    job, k, _ = tx.stage("idle", receiver.ctrl_port, 8)
    await asyncio.to_thread(tx.sender.send, job)
    got = await receiver.wait_for("idle", 5)
    assert torch.equal(got.k, k)
    got.release()
    assert await asyncio.to_thread(_cpu_seconds_over, 1.0) < 0.3


def test_health_names_what_is_down() -> None:
    rx = KVReceiver(L, H, D, torch.float32, "cpu", MAX, "127.0.0.1", ctrl_port=_free_port(), num_slots=1)
    assert rx.health()["control_plane"] != "ok"  # not started
    rx.start()
    try:
        assert rx.health() == {"control_plane": "ok", "nixl": "ok"}
    finally:
        rx.stop()
    assert rx.health()["control_plane"] != "ok"


# ---------------------------------------------------------------- done.checksum algorithms (crc32 | wsum16)

def _record_algorithms(monkeypatch) -> list[str]:
    """Wrap the sender's checksum so the test sees which algorithm the real path chose."""
    from expresslane.engine.transfer import sender as send_mod

    seen: list[str] = []
    real = send_mod.checksum

    def recording(data, algorithm="crc32"):
        seen.append(algorithm)
        return real(data, algorithm)

    monkeypatch.setattr(send_mod, "checksum", recording)
    return seen


async def test_hello_advertises_the_checksums_the_node_verifies(receiver: KVReceiver) -> None:
    assert receiver._hello().transport["checksums"] == ["crc32", "wsum16"]


async def test_a_dram_pair_keeps_crc32(receiver: KVReceiver, monkeypatch) -> None:
    seen = _record_algorithms(monkeypatch)
    tx = _Prefill(LAYOUT)
    receiver.expect("c1", 5)
    job, k, v = tx.stage("c1", receiver.ctrl_port, 9)
    await asyncio.to_thread(tx.sender.send, job)
    got = await receiver.wait_for("c1", 5)
    assert seen == ["crc32"] and torch.equal(got.k, k) and torch.equal(got.v, v)
    got.release()


async def test_wsum16_is_verified_by_the_receiver(receiver: KVReceiver, monkeypatch) -> None:
    """The device-side algorithm (what a VRAM pair uses) over the real path on CPU: lands, checked, exact."""
    seen = _record_algorithms(monkeypatch)
    tx = _Prefill(LAYOUT)
    tx.sender.config = SenderConfig(io_timeout_s=5, checksum_algorithm="wsum16")
    receiver.expect("w1", 5)
    job, k, v = tx.stage("w1", receiver.ctrl_port, 33)
    await asyncio.to_thread(tx.sender.send, job)
    got = await receiver.wait_for("w1", 5)
    assert seen == ["wsum16"] and torch.equal(got.k, k) and torch.equal(got.v, v)
    assert receiver.stats["checksum_failures"] == 0
    got.release()


@pytest.mark.parametrize("forged", ["wsum16:" + "0" * 32, "sha1:" + "0" * 40, "nonsense"])
async def test_a_wrong_or_unknown_checksum_fails_the_transfer(receiver: KVReceiver, monkeypatch,
                                                              forged: str) -> None:
    """A wrong wsum16, or an algorithm this node does not know: nack + checksum_mismatch, never accepted."""
    from expresslane.engine.transfer import sender as send_mod

    monkeypatch.setattr(send_mod, "checksum", lambda data, algorithm="crc32": forged)
    tx = _Prefill(LAYOUT)
    receiver.expect("bad", 5)
    job, _, _ = tx.stage("bad", receiver.ctrl_port, 7)
    with pytest.raises(SendError) as e:
        await asyncio.to_thread(tx.sender.send, job)
    assert e.value.reason == "nack_checksum_mismatch"
    with pytest.raises(KVTransferFailed) as f:
        await receiver.wait_for("bad", 2)
    assert f.value.reason == "checksum_mismatch" and receiver.stats["checksum_failures"] == 1


def test_stop_ends_open_control_connections():
    """A receiver that stops ends its open control connections (the peer reads EOF at once) after their cleanup,
    instead of leaving their handlers to the event loop's close (seen in CI: "Exception ignored in
    ControlServer._accept ... Event loop is closed", and the peer's socket stayed open)."""
    rx = KVReceiver(L, H, D, torch.float32, "cpu", MAX, "127.0.0.1", ctrl_port=_free_port(), num_slots=1)
    rx.start()
    with socket.create_connection(("127.0.0.1", rx.ctrl_port), timeout=10) as s:
        assert s.recv(65536)  # the node's challenge: the connection is being served
        t0 = time.monotonic()
        rx.stop()
        s.settimeout(10)
        rest = b""
        while chunk := s.recv(65536):
            rest += chunk
        assert time.monotonic() - t0 < 8  # EOF, not the 10 s timeout: the node closed it
