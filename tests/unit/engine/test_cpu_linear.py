"""The CPU step's row-invariant linear (models/cpu_linear.py): each row's bits depend on its own input alone, whatever
the other rows (how many, which, in what order) and the thread count; its values are the product's to float32
rounding; where the kernel does not apply, one F.linear a row (the same bits as a one-row step)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from expresslane.engine.models import cpu_linear


@pytest.fixture(autouse=True, scope="module")
def built():
    assert cpu_linear.kernel() is not None, "the CI host has a C compiler: the kernel must build"


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 90), rows=st.integers(1, 9), bias=st.booleans(),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_each_row_is_its_one_row_product(n, k, rows, bias, threads, seed):
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = cpu_linear.linear(x, w, b)
        alone = [cpu_linear.linear(x[r:r + 1], w, b)[0] for r in range(rows)]
        perm = torch.randperm(rows, generator=g)
        shuffled = cpu_linear.linear(x[perm], w, b)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(y[r], alone[r]) for r in range(rows))
    assert all(torch.equal(shuffled[j], alone[int(perm[j])]) for j in range(rows))
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * k)


def test_wide_projection_threads_split_rows_not_sums():
    """A projection wide enough to run on several threads (the lm_head of a real model's shape, cut down)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4096, 576, generator=g), torch.randn(6, 576, generator=g)
    before = torch.get_num_threads()
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(cpu_linear.linear(x, w))
    torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][3], cpu_linear.linear(x[3:4], w)[0])


def test_strided_rows_and_other_dtypes():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(33, 40, generator=g)
    big = torch.randn(5, 64, generator=g)
    x = big[:, :40]  # rows with a stride: the kernel reads them in place
    assert torch.equal(cpu_linear.linear(x, w), cpu_linear.linear(x.contiguous(), w))
    wb, xb = w.bfloat16(), x.bfloat16()  # not the kernel's dtype: one F.linear a row
    y = cpu_linear.linear(xb, wb)
    assert y.dtype == torch.bfloat16
    assert all(torch.equal(y[r], F.linear(xb[r:r + 1], wb)[0]) for r in range(5))
    with pytest.raises(ValueError, match="columns"):
        cpu_linear.linear(torch.randn(2, 39), w)


def test_compiled_as_one_opaque_op():
    g = torch.Generator().manual_seed(2)
    w, x, b = torch.randn(20, 16, generator=g), torch.randn(3, 16, generator=g), torch.randn(20, generator=g)
    f = torch.compile(lambda x: cpu_linear.row_linear(x, w, b) * 2, fullgraph=True)
    assert torch.equal(f(x), cpu_linear.linear(x, w, b) * 2)
