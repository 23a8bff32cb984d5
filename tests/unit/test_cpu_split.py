"""The dev stack's CPU placement rule (scripts/dev_stack.py cpu_split)."""

from __future__ import annotations

import pytest
from dev_stack import cpu_split, nice_for_shares


@pytest.mark.parametrize("ncpu,first,second,threads", [(2, "0", "1", "1"), (4, "0-1", "2-3", "2"),
                                                       (3, "0", "1-2", "2"), (8, "0-3", "4-7", "4")])
def test_prefill_first_half_decode_lanes_second(ncpu: int, first: str, second: str, threads: str) -> None:
    env = cpu_split(ncpu)
    assert (env["PREFILL_CPU_BIND"], env["DECODE_NATIVE_CPU_BIND"]) == (first, second)
    assert env["EXPRESS_THREADS"] == threads
    assert "EXPRESS_CPU_BIND" not in env  # pinned next to a NIXL progress thread it decoded 10x slower


def test_one_cpu_leaves_placement_to_vllm() -> None:
    assert cpu_split(1) == {}


@pytest.mark.parametrize("shares,nice", [(1024, 0), (8192, -9), (512, 3), (2, 19), (1 << 20, -20)])
def test_cpu_shares_map_to_the_nice_level_of_the_nearest_cfs_weight(shares: int, nice: int) -> None:
    assert nice_for_shares(shares) == nice


def test_cpu_shares_below_dockers_minimum_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 2"):
        nice_for_shares(1)
