"""Compile a kernel's candidate block shapes in parallel, before the block-shape picker times them one by one.

A lean step's first forward picks a block shape for each of its kernels (fused.pick_config): every candidate is
compiled (and, where the step also verifies, its kernel of the verify's rows is compiled to read what it spills),
then timed on the device. Timing must run one kernel at a time; compiling need not. Triton compiles on the host
and releases the GIL while it does (MLIR passes, LLVM, ptxas), and its `AsyncCompileMode` (Triton >= 3.4)
turns each `kernel.warmup(...)` inside it into a job on an executor, waited for on the way out. This is what
Triton's own autotuner is being given for the same reason (triton-lang/triton PR 11847: compile every config
first, then benchmark sequentially).

Measured on a 2-core host, compiling the CUDA-core `gemv_residual` kernel's 15 block shapes for sm_90
(docs/bench/2026-12-05-parallel-compile/bench_precompile.py): one row 3.74 s one after another, 1.72 s on two threads; five rows 12.89 s and
6.65 s. The kernels are the same either way (a test compares the binaries).

`precompile(jobs)` runs each job (a call that compiles and does not launch: a launcher's `compile_only=True`) on
the pool and returns once all are compiled. Where the parallel compile raises, the jobs run again one at a time
(logged; `_serially`): a kernel that does not compile raises there, as it would have at its launch. On a host
with one CPU, or with a Triton without AsyncCompileMode, the jobs run one after another.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

try:  # Triton >= 3.4
    from triton import AsyncCompileMode
    from triton.runtime._async_compile import FutureKernel
except ImportError:  # pragma: no cover - an older Triton: compile one after another
    AsyncCompileMode = FutureKernel = None


def _host_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _compile_threads() -> int:
    """EXPRESSLANE_COMPILE_THREADS where set (as TORCHINDUCTOR_COMPILE_THREADS is for inductor: e.g. several test
    processes on one host), else the CPUs this process may run on, at most 32 (a warm-up compiles a few dozen
    kernels at a time: one pick's candidates)."""
    raw = os.environ.get("EXPRESSLANE_COMPILE_THREADS", "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            raise ValueError(f"EXPRESSLANE_COMPILE_THREADS={raw!r}: not a number of threads") from None
        if n < 1:
            raise ValueError(f"EXPRESSLANE_COMPILE_THREADS={raw!r}: must be >= 1")
        return n
    return max(1, min(32, _host_cpus()))


#: Compile threads (1: one after another, in the calling thread).
COMPILE_THREADS = _compile_threads()

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


class CompileStats:
    """What precompile did in this process: batches, kernels compiled (jobs run), and the wall seconds spent."""

    def __init__(self) -> None:
        self.batches = 0
        self.jobs = 0
        self.seconds = 0.0

    def as_dict(self) -> dict:
        return {"batches": self.batches, "jobs": self.jobs, "seconds": round(self.seconds, 3)}


STATS = CompileStats()


def threads() -> int:
    """The kernels compiled at once (1 with a Triton that has no AsyncCompileMode)."""
    return COMPILE_THREADS if AsyncCompileMode is not None else 1


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="triton-compile")
        return _pool


def _in_parallel(jobs: list[Callable[[], object]]) -> None:
    with AsyncCompileMode(_executor()):
        for job in jobs:
            job()
    # leaving the mode waited for every compile and put each kernel in its JIT function's cache


def _unresolved(kernel: object) -> bool:
    return FutureKernel is not None and isinstance(kernel, FutureKernel) and kernel.kernel is None


def _serially(job: Callable[[], object], batch_error: Exception) -> None:
    """One job of a failed parallel batch, in this thread. The batch's mode stopped at its first failed compile
    and left the others in their JIT functions' caches as FutureKernels (still compiling on the pool, or failed):
    `kernel.warmup` returns the cached one instead of compiling. So wait for it, and nothing of the batch still
    compiles when precompile returns. Where it failed: Triton >= 3.9 removed the failed placeholder from the
    cache (`cleanup_compile`), so the job runs once more and compiles here for real, raising a one-at-a-time
    compile's own error (or succeeding, where the parallel path itself was what failed). Triton 3.4 - 3.6 keep
    the failed placeholder: there the parallel batch's error is raised."""
    kernel = job()  # a compile here (not cached) raises its own error
    if not _unresolved(kernel):
        return
    if kernel.future is None:  # failed in the batch, kept in the cache
        raise RuntimeError(f"a kernel failed to compile in a parallel batch ({batch_error}) and this Triton keeps "
                           "it in its JIT cache") from batch_error
    try:
        kernel.result()
    except Exception as err:  # noqa: BLE001 - compiled once more below, whose error is the one raised
        again = job()
        if _unresolved(again):  # the failed placeholder stayed: that error stands
            raise err


def precompile(jobs: Iterable[Callable[[], object]]) -> None:
    """Run every job (a compile-only launch); in parallel on the compile pool where there is one. Returns when
    every kernel is compiled and in its JIT function's cache (the launches that follow find it there)."""
    jobs = list(jobs)
    if not jobs:
        return
    t0 = time.perf_counter()
    if threads() > 1:
        try:
            # In a context of its own: Triton 3.6's AsyncCompileMode leaves itself active when a compile raised
            # (3.9 resets it in a `finally`), and the serial retry must not run through that stale mode.
            contextvars.copy_context().run(_in_parallel, jobs)
        except Exception as e:  # noqa: BLE001 - whatever the parallel path raised, the serial one decides
            # A kernel that does not compile fails the same way one at a time (that error is the one raised);
            # a failure of the parallel path itself (a Triton whose compile is not thread-safe) costs only time.
            log.warning("compiling %d kernels in parallel failed (%s: %s); compiling them one at a time",
                        len(jobs), type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            failed = None  # every job is run (and waited for) before the first error is raised
            for job in jobs:
                try:
                    _serially(job, e)
                except Exception as err:  # noqa: BLE001 - raised below, once the batch is settled
                    failed = failed or err
            if failed is not None:
                raise failed
    else:
        for job in jobs:
            job()
    STATS.batches += 1
    STATS.jobs += len(jobs)
    STATS.seconds += time.perf_counter() - t0
