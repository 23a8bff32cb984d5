"""The dev stack's CPU placement rule (scripts/dev_stack.py cpu_split)."""

from __future__ import annotations

import pytest
from dev_stack import cpu_split


@pytest.mark.parametrize("ncpu,first,second,threads", [(2, "0", "1", "1"), (4, "0-1", "2-3", "2"),
                                                       (3, "0", "1-2", "2"), (8, "0-3", "4-7", "4")])
def test_prefill_first_half_decode_lanes_second(ncpu: int, first: str, second: str, threads: str) -> None:
    env = cpu_split(ncpu)
    assert (env["PREFILL_CPU_BIND"], env["DECODE_NATIVE_CPU_BIND"]) == (first, second)
    assert env["EXPRESS_THREADS"] == threads
    assert "EXPRESS_CPU_BIND" not in env  # pinned next to a NIXL progress thread it decoded 10x slower


def test_one_cpu_leaves_placement_to_vllm() -> None:
    assert cpu_split(1) == {}
