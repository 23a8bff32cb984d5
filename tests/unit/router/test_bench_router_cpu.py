"""The bench's per-request router CPU sampling (scripts/bench_lib/overheads.threads_cpu_ns): the sum of a process's
threads' schedstat runtimes, read against a real child process that burns a known amount of CPU in two threads
and reports its own CPU clock (CLOCK_PROCESS_CPUTIME_ID, ns)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))

from bench_lib.overheads import threads_cpu_ns  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")

CHILD = textwrap.dedent("""
    import sys, threading, time

    def burn(s):
        t = time.thread_time()
        while time.thread_time() - t < s:
            pass

    go, done = threading.Event(), threading.Event()

    def worker():  # a second thread that stays alive until the parent has read the counters
        go.wait()
        burn(float(sys.argv[2]))
        done.set()
        threading.Event().wait()

    threading.Thread(target=worker, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.process_time_ns()
    go.set()
    burn(float(sys.argv[1]))
    done.wait()
    print(time.process_time_ns() - t0, flush=True)
    sys.stdin.readline()
""")


@pytest.mark.parametrize("main_s,thread_s", [(0.15, 0.10), (0.0, 0.25), (0.05, 0.0)])
def test_threads_cpu_ns_matches_the_childs_own_cpu_clock(main_s: float, thread_s: float) -> None:
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(main_s), str(thread_s)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        before = threads_cpu_ns([p.pid])
        p.stdin.write("go\n")
        p.stdin.flush()
        child_ns = int(p.stdout.readline())
        after = threads_cpu_ns([p.pid])
        assert before is not None and after is not None
        delta = after - before
        # the child burned what it was told (its own clock), and the sampler saw the same CPU: the only
        # difference is the child's few lines between its clock reads and ours (well under 20 ms)
        assert child_ns >= (main_s + thread_s) * 1e9
        assert abs(delta - child_ns) < 20e6, (delta, child_ns)
    finally:
        p.stdin.write("exit\n")
        p.stdin.close()
        p.wait(10)


def test_threads_cpu_ns_sums_processes_and_none_for_a_gone_one() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.readline()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        one = threads_cpu_ns([p.pid])
        both = threads_cpu_ns([p.pid, p.pid])
        assert one is not None and one > 0
        assert both == 2 * one  # an idle child: its counters do not move between the two reads
    finally:
        p.stdin.close()
        p.wait(10)
    assert threads_cpu_ns([p.pid]) is None  # reaped: no /proc entry
    assert threads_cpu_ns(None) is None and threads_cpu_ns([]) is None
