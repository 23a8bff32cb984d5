"""The dev stack's CPU placement rule (scripts/dev_stack.py cpu_split)."""

from __future__ import annotations

import pytest
from dev_stack import cpu_split


def test_two_cpus_park_both_progress_threads_on_cpu0_and_compute_on_cpu1() -> None:
    env = cpu_split(2)
    assert env["PREFILL_CPU_BIND"] == env["DECODE_NATIVE_CPU_BIND"] == "0"
    assert env["EXPRESS_CPU_BIND"] == "1" and env["EXPRESS_THREADS"] == "1"
    assert env["PREFILL_RESTORE_OMP_AFFINITY"] == "0"


@pytest.mark.parametrize("ncpu,first,second,threads", [(4, "0-1", "2-3", "2"), (3, "0", "1-2", "2"),
                                                       (8, "0-3", "4-7", "4")])
def test_larger_hosts_split_in_halves(ncpu: int, first: str, second: str, threads: str) -> None:
    env = cpu_split(ncpu)
    assert (env["PREFILL_CPU_BIND"], env["DECODE_NATIVE_CPU_BIND"], env["EXPRESS_CPU_BIND"]) == (first, second, second)
    assert env["EXPRESS_THREADS"] == threads and "PREFILL_RESTORE_OMP_AFFINITY" not in env


def test_one_cpu_leaves_placement_to_vllm() -> None:
    assert cpu_split(1) == {}
