"""The dev stack's CPU placement rule (scripts/dev_stack.py cpu_split)."""

from __future__ import annotations

import pytest
from dev_stack import cpu_split


def test_two_cpus_park_both_progress_threads_with_the_prefill() -> None:
    """Both vLLM servers bind to CPU 0 (their NIXL progress threads are born there); the decode lanes compute
    on CPU 1 (vLLM moves the native decode's forward to the last core; the express engine is pinned)."""
    assert cpu_split(2) == {"PREFILL_CPU_BIND": "0", "DECODE_NATIVE_CPU_BIND": "0", "EXPRESS_CPU_BIND": "1",
                            "EXPRESS_THREADS": "1"}


@pytest.mark.parametrize("ncpu,first,second,threads", [(4, "0-1", "2-3", "2"), (3, "0", "1-2", "2"),
                                                       (8, "0-3", "4-7", "4")])
def test_larger_hosts_split_in_halves(ncpu: int, first: str, second: str, threads: str) -> None:
    env = cpu_split(ncpu)
    assert (env["PREFILL_CPU_BIND"], env["DECODE_NATIVE_CPU_BIND"], env["EXPRESS_CPU_BIND"]) == (first, second, second)
    assert env["EXPRESS_THREADS"] == threads


def test_one_cpu_leaves_placement_to_vllm() -> None:
    assert cpu_split(1) == {}
