"""kv_layout.PagedKVLayout.token_index: the (kernel block, offset) of every token, the same on every device.

The connector builds it inside vLLM's step; on a GPU the block ids go over from pinned memory and the index is
computed there (no host wait for the forward), and must be the host's index exactly."""

from __future__ import annotations

import random

import pytest
import torch

from expresslane.engine.kv_layout import PagedKVLayout, PageView

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def layout(block_size: int, kernel_block_size: int) -> PagedKVLayout:
    split = (PageView(0, None, (8,), None), PageView(8, None, (8,), None))
    return PagedKVLayout(backend="test", block_size=block_size, kernel_block_size=kernel_block_size,
                         num_kv_heads=2, head_dim=8, dtype=torch.float32, k=split[0], v=split[1])


def reference(block_ids: list[int], num_tokens: int, block_size: int, kernel: int) -> tuple[list[int], list[int]]:
    ratio = block_size // kernel
    blk, off = [], []
    for t in range(num_tokens):
        manager, within = divmod(t, block_size)
        blk.append(block_ids[manager] * ratio + within // kernel)
        off.append(within % kernel)
    return blk, off


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size,kernel", [(16, 16), (64, 16), (32, 32)])
@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 1000, 8192])
def test_token_index_is_every_tokens_block_and_offset(device, block_size, kernel, num_tokens):
    rng = random.Random(num_tokens * 31 + block_size)
    need = -(-num_tokens // block_size)
    block_ids = rng.sample(range(4 * need + 8), need + 2)  # shuffled, more than needed
    blk, off = layout(block_size, kernel).token_index(block_ids, num_tokens, device)
    assert blk.device.type == device and off.device.type == device
    assert blk.dtype == off.dtype == torch.long
    want_blk, want_off = reference(block_ids, num_tokens, block_size, kernel)
    assert blk.tolist() == want_blk and off.tolist() == want_off


def test_too_few_blocks_refused():
    with pytest.raises(ValueError, match="need 2 blocks"):
        layout(16, 16).token_index([3], 17)
