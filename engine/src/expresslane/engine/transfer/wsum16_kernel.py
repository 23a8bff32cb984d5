"""wsum16's per-row sums in one Triton pass over the words (checksum.py defines the sum; this only computes it).

The torch form reads the int16 words twice and writes / reads an int32 product (~12 B of device traffic a
word); this kernel reads each word once (2 B) and writes two int64 per row. Program r sums row r (words
r*R .. r*R+R-1, masked past the end): s1_r = sum(w), s2_r = sum(j * w_j), j the position in the row. Exact:
|j * w_j| < 2**30 fits int32, the accumulators are int64. Imported only where used (a CUDA tensor, or a test
under TRITON_INTERPRET=1 on CPU), since importing triton costs seconds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUB = 4096  # words a program loads per step


@triton.jit
def _rows_kernel(w_ptr, s1_ptr, s2_ptr, nw, R: tl.constexpr, SUB: tl.constexpr):
    row = tl.program_id(0)
    base = row.to(tl.int64) * R
    acc1 = tl.zeros([SUB], dtype=tl.int64)
    acc2 = tl.zeros([SUB], dtype=tl.int64)
    for k in range(0, R, SUB):
        j = k + tl.arange(0, SUB)
        idx = base + j
        w = tl.load(w_ptr + idx, mask=idx < nw, other=0).to(tl.int32)
        acc1 += w.to(tl.int64)
        acc2 += (w * j).to(tl.int64)
    tl.store(s1_ptr + row, tl.sum(acc1, axis=0))
    tl.store(s2_ptr + row, tl.sum(acc2, axis=0))


def row_sums(words: torch.Tensor, row_words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(s1, s2) int64 per row of ``row_words`` words (a multiple of SUB) of a contiguous 1-D int16 tensor."""
    if words.dtype != torch.int16 or words.dim() != 1 or not words.is_contiguous():
        raise ValueError("row_sums wants a contiguous 1-D int16 tensor")
    if row_words % SUB:
        raise ValueError(f"row_words must be a multiple of {SUB}")
    nw = words.numel()
    rows = -(-nw // row_words)
    s1 = torch.empty(rows, dtype=torch.int64, device=words.device)
    s2 = torch.empty(rows, dtype=torch.int64, device=words.device)
    if rows:
        _rows_kernel[(rows,)](words, s1, s2, nw, R=row_words, SUB=SUB)
    return s1, s2
