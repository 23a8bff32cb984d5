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
