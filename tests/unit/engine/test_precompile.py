"""models/precompile.py's contract, on any host: every job runs, in the order given where it runs serially; a job
that fails fails the batch with its own error, after one serial retry (the parallel path's own failure costs
only time). The parallel compile itself runs Triton's JIT on a GPU: test_fused_kernels.py checks there that a
pick's kernels are compiled in its batches, and test_kernels_compile_for_hopper.py that threads build the same
binaries."""

from __future__ import annotations

import inspect
import logging
import threading

import pytest

precompile = pytest.importorskip("expresslane.engine.models.precompile")
try:
    from triton.runtime import _async_compile
except ImportError:  # no Triton: the tests of the parallel path skip (two_threads)
    _async_compile = None


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


class FakeJIT:
    """A JIT function's compile on warm-up as Triton's JITFunction._do_compile runs it: under an active
    AsyncCompileMode (Triton's own, real) the compile is submitted to the mode and its FutureKernel put in the
    cache at once; otherwise it compiles here. `cleanup`: the mode removes a failed placeholder from the cache
    (Triton >= 3.9) or leaves it there (3.4 - 3.6)."""

    def __init__(self, compile_fn, cleanup: bool = True):
        self.compile_fn, self.cleanup, self.cache, self.compiled_on = compile_fn, cleanup, {}, []

    def _compile(self, key):
        self.compiled_on.append(threading.current_thread() is threading.main_thread())
        return self.compile_fn(key)

    def warmup(self, key):
        if key in self.cache:
            return self.cache[key]
        mode = _async_compile.active_mode.get()
        if mode is None:
            self.cache[key] = self._compile(key)
            return self.cache[key]

        def finalize(kernel):
            self.cache[key] = kernel

        def cleanup(future_kernel):
            if self.cleanup and self.cache.get(key) is future_kernel:
                del self.cache[key]

        args = [key, lambda: self._compile(key), finalize]
        if "cleanup_fn" in inspect.signature(mode.submit).parameters:
            args.append(cleanup)
        self.cache[key] = mode.submit(*args)
        return self.cache[key]

    def unresolved(self):
        return [k for k, v in self.cache.items() if isinstance(v, _async_compile.FutureKernel) and v.kernel is None]

    def compiling(self):
        """Placeholders whose compile is still running on the pool."""
        return [k for k in self.unresolved() if self.cache[k].future is not None and not self.cache[k].future.done()]


@pytest.fixture
def two_threads(monkeypatch):
    if precompile.AsyncCompileMode is None:
        pytest.skip("this Triton has no AsyncCompileMode")
    monkeypatch.setattr(precompile, "COMPILE_THREADS", 2)


def test_a_kernel_that_does_not_compile_raises_its_error_and_nothing_is_left_compiling(two_threads):
    """A real AsyncCompileMode stops at the first failed compile and leaves the batch's other kernels compiling
    on the pool, as placeholders in the JIT cache. precompile raises that kernel's error, and only once every
    other kernel of the batch is compiled."""
    gate = threading.Event()

    def compile_fn(key):
        if key == "bad":
            raise ValueError("kernel bad: out of resources")
        gate.wait(5)  # still compiling when the mode gives up on the batch
        return f"binary {key}"

    jit = FakeJIT(compile_fn)
    threading.Timer(0.3, gate.set).start()
    with pytest.raises(ValueError, match="out of resources"):
        precompile.precompile([lambda k=k: jit.warmup(k) for k in ("a", "bad", "b")])
    assert jit.cache["a"] == "binary a" and jit.cache["b"] == "binary b"
    assert jit.compiling() == []
    if precompile.FutureKernel is not None and "cleanup_fn" in inspect.signature(
            precompile.AsyncCompileMode(None).submit).parameters:
        # Triton >= 3.9 dropped the failed placeholder: "bad" compiled once more, in this thread
        assert jit.unresolved() == [] and jit.compiled_on.count(True) == 1
    else:  # Triton 3.4 - 3.6 keep it in the JIT cache, failed (precompile's _serially says so)
        assert jit.unresolved() == ["bad"] and jit.cache["bad"].future.exception() is not None


def test_a_failure_of_the_parallel_path_itself_is_retried_one_at_a_time(two_threads, caplog):
    """A compile that fails only on a pool thread (a Triton whose compile is not thread-safe): where Triton
    removes the failed placeholder (>= 3.9), the retry compiles it here and the batch succeeds."""
    if "cleanup_fn" not in inspect.signature(precompile.AsyncCompileMode(None).submit).parameters:
        pytest.skip("this Triton keeps a failed placeholder in the JIT cache: its error stands")

    def compile_fn(key):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("not thread-safe")
        return f"binary {key}"

    jit = FakeJIT(compile_fn)
    with caplog.at_level(logging.WARNING, logger=precompile.__name__):
        precompile.precompile([lambda k=k: jit.warmup(k) for k in ("a", "b")])
    assert jit.cache == {"a": "binary a", "b": "binary b"} and "one at a time" in caplog.text


def test_a_triton_that_keeps_a_failed_placeholder_raises_the_parallel_error(two_threads):
    """Triton 3.4 - 3.6 leave a failed FutureKernel in the cache: warm-up returns it, so the retry raises the
    parallel compile's error (not a silent success with a broken kernel in the cache)."""

    def compile_fn(key):
        if key == "bad":
            raise ValueError("kernel bad: out of resources")
        return f"binary {key}"

    jit = FakeJIT(compile_fn, cleanup=False)
    with pytest.raises((ValueError, RuntimeError), match="out of resources"):  # its own, or naming it
        precompile.precompile([lambda k=k: jit.warmup(k) for k in ("a", "bad")])
    assert jit.cache["a"] == "binary a"


def test_compile_threads_from_the_environment(monkeypatch):
    monkeypatch.setenv("EXPRESSLANE_COMPILE_THREADS", "3")
    assert precompile._compile_threads() == 3
    for bad in ("0", "many"):
        monkeypatch.setenv("EXPRESSLANE_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match="EXPRESSLANE_COMPILE_THREADS"):
            precompile._compile_threads()
    monkeypatch.delenv("EXPRESSLANE_COMPILE_THREADS")
    assert 1 <= precompile._compile_threads() <= 32
