"""models/precompile.py's contract, on any host: every job runs, in the order given where it runs serially; a job
that fails fails the batch with its own error, after one serial retry (the parallel path's own failure costs
only time). The parallel compile itself runs Triton's JIT on a GPU: test_fused_kernels.py checks there that a
pick's kernels are compiled in its batches, and test_kernels_compile_for_hopper.py that threads build the same
binaries."""

from __future__ import annotations

import logging

import pytest

precompile = pytest.importorskip("expresslane.engine.models.precompile")


def test_every_job_runs_and_the_stats_count_them():
    ran = []
    before = (precompile.STATS.batches, precompile.STATS.jobs)
    precompile.precompile([lambda i=i: ran.append(i) for i in range(5)])
    assert sorted(ran) == [0, 1, 2, 3, 4]
    assert (precompile.STATS.batches, precompile.STATS.jobs) == (before[0] + 1, before[1] + 5)
    precompile.precompile([])  # nothing to compile: no batch
    assert precompile.STATS.batches == before[0] + 1


def test_a_failing_job_raises_its_own_error(caplog):
    calls = []

    def bad():
        calls.append("bad")
        raise ValueError("kernel X: out of resources")

    with caplog.at_level(logging.WARNING, logger=precompile.__name__):
        with pytest.raises(ValueError, match="out of resources"):
            precompile.precompile([lambda: calls.append("ok"), bad])
    if precompile.threads() > 1:  # the parallel attempt, then the serial one that raises
        assert calls == ["ok", "bad", "ok", "bad"]
        assert "one at a time" in caplog.text
    else:
        assert calls == ["ok", "bad"]


def test_a_mode_left_active_by_a_failed_compile_does_not_outlive_the_batch(monkeypatch):
    """Triton 3.6's AsyncCompileMode stays active when a compile raised (3.9 resets it): the serial retry and
    every later batch must not run through that stale mode."""
    from triton.runtime import _async_compile

    class LeavesItselfActive:  # 3.6's __exit__ on a failed compile: raises before resetting the mode
        def __init__(self, executor):
            pass

        def __enter__(self):
            _async_compile.active_mode.set(self)
            return self

        def __exit__(self, *exc):
            raise RuntimeError("a compile failed")

    monkeypatch.setattr(precompile, "AsyncCompileMode", LeavesItselfActive)
    monkeypatch.setattr(precompile, "COMPILE_THREADS", 2)
    seen = []
    precompile.precompile([lambda: seen.append(_async_compile.active_mode.get())])
    assert len(seen) == 2 and isinstance(seen[0], LeavesItselfActive) and seen[1] is None  # the retry: no mode
    assert _async_compile.active_mode.get() is None


def test_compile_threads_from_the_environment(monkeypatch):
    monkeypatch.setenv("EXPRESSLANE_COMPILE_THREADS", "3")
    assert precompile._compile_threads() == 3
    for bad in ("0", "many"):
        monkeypatch.setenv("EXPRESSLANE_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match="EXPRESSLANE_COMPILE_THREADS"):
            precompile._compile_threads()
    monkeypatch.delenv("EXPRESSLANE_COMPILE_THREADS")
    assert 1 <= precompile._compile_threads() <= 32
