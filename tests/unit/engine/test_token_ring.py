"""GreedyChain's read of the lean step's token ring (decode/chain.py): a slot counts only when it holds the
step's own number (a stale slot of an earlier step, or of a warm-up, is never taken for it), a token written
later by another thread is picked up, and a step that never finishes surfaces as an error within the bound.
The ring's writer is fused.greedy_advance (tests in test_fused_kernels.py; on a GPU the ring is pinned host
memory, and test_greedy_chain.py's GPU run reads every token through it)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from expresslane.engine.decode.chain import GreedyChain
from expresslane.engine.models import fused


def _entry(seq: int, token: int) -> int:
    return (seq & 0x7FFFFFFF) * 2**32 + token


def _reader(seq0: int, ring: np.ndarray) -> GreedyChain:
    chain = GreedyChain.__new__(GreedyChain)  # the ring read alone: no runner, no device
    chain._ring_view, chain._seq0 = ring, seq0
    return chain


def test_a_slot_counts_only_with_the_steps_own_number():
    ring = np.full(8, -1, dtype=np.int64)
    chain = _reader(seq0=41, ring=ring)  # step 0 is the 42nd greedy step
    ring[42 % 8] = _entry(42, 1234)
    assert chain._read_ring(0) == 1234
    ring[43 % 8] = _entry(35, 77)  # the same slot, 8 steps older: stale
    chain.READ_TIMEOUT_S = 0.2
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="did not finish on the device in"):
        chain._read_ring(1)
    assert time.monotonic() - t0 < 5.0
    assert fused.ring_entry(int(ring[43 % 8])) == (35, 77)


def test_a_token_written_while_the_reader_waits_is_returned():
    ring = np.full(8, -1, dtype=np.int64)
    chain = _reader(seq0=2**31 - 1, ring=ring)  # the step number wraps at 2^31
    seq = 2**31  # step 0
    writer = threading.Timer(0.05, lambda: ring.__setitem__(seq % 8, _entry(seq, 99)))
    writer.start()
    try:
        assert chain._read_ring(0) == 99  # the reader yields the GIL while it polls: the timer thread runs
    finally:
        writer.cancel()
