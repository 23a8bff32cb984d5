"""The prefill forward thread goes back to its OpenMP core after NixlConnector's CPU reservation moved it."""

from __future__ import annotations

import os
import threading

import pytest

from expresslane.engine.connector.cpu_affinity import omp_master_cpu, restore_forward_affinity


@pytest.mark.parametrize("env,cpu", [
    ({"GOMP_CPU_AFFINITY": "3 4 5"}, 3),
    ({"GOMP_CPU_AFFINITY": "0"}, 0),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[6,7]"}, 6),
    ({"OMP_PLACES": "{2,3}", "OMP_PROC_BIND": "true"}, 2),
    ({}, None),
    ({"OMP_PLACES": "cores"}, None),
    ({"GOMP_CPU_AFFINITY": ""}, None),
])
def test_master_cpu_from_vllm_omp_env(env: dict, cpu: int | None) -> None:
    assert omp_master_cpu(env) == cpu


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to move a thread between")
def test_moved_forward_thread_is_pinned_back() -> None:
    """Reproduces NixlConnector's move (the thread to the last CPU), then restores the OpenMP CPU. Affinity
    is per thread on Linux, so a scratch thread stands in for the worker's main thread."""
    cpus = sorted(os.sched_getaffinity(0))
    first, last = cpus[0], cpus[-1]
    env = {"GOMP_CPU_AFFINITY": f"{first} {last}"}
    seen: list = []

    def forward_thread() -> None:
        os.sched_setaffinity(0, {last})
        seen.append(restore_forward_affinity(env))
        seen.append(restore_forward_affinity(env))  # already there: nothing to do
        seen.append(sorted(os.sched_getaffinity(0)))

    t = threading.Thread(target=forward_thread)
    t.start()
    t.join(10)
    assert seen == [first, None, [first]]
    assert sorted(os.sched_getaffinity(0)) == cpus  # other threads untouched
