"""Split-KV (flash-decoding) attention for T query rows over the static cache, in Triton.

Fixed grid (num_kv_heads, NUM_SPLITS), so one CUDA graph serves every length: each program reads the live
length from the device (`start_pos` + T), takes its 1/NUM_SPLITS share of the live rows (rounded to
BLOCK_N) and computes an online-softmax partial for all G*T query rows of its KV head (GQA: the cache rows are
read once for the G query heads that share them). A second kernel merges the partials of the splits. Rows past
the live length are never read, whatever max_seq_len is.

A further grid dimension runs R such steps at once (`split_kv_attention_rows`): row r is a T = 1 step at
start_pos + r, computed by exactly the code of a T = 1 launch (the same kernel, the same splits of its own
length), so its output is bit-identical to that step's. The lean step's verify uses it (models/lean.py). That
dimension is the grid's fastest, so the R programs of one (KV head, split) are scheduled together and R - 1 of
them find the cache tiles they read in L2: five rows need not read the live KV from HBM five times.

Float32 inputs use IEEE dots (no TF32), so the exactness tests compare like with like; bf16/fp16 inputs use
the tensor cores with float32 accumulation. Runs under TRITON_INTERPRET=1 on CPU tensors too (the unit tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_wait, use_pdl


@triton.jit
def _softmax_step(s, visible, m_i, l_i, scale):
    """One tile's online-softmax update of the scores s (q . k, unscaled): the masked, scaled scores' running max,
    the factor the old sums are scaled by, the tile's probabilities and the new running sum. Both partial kernels
    run exactly this, which is part of what keeps a shared verify row's bits its own one-row program's."""
    s = s * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, alpha, p, l_i


@triton.jit
def _store_partial(acc_ptr, ml_ptr, step, hkv, num_kv, split, m_i, l_i, acc, rows, dims, NUM_SPLITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, D: tl.constexpr):
    """A (step, KV head, split) partial: acc [BLOCK_M, D] and (m, l) per row, where the merge reads them (num_kv:
    the KV heads of the grid)."""
    base = ((step * num_kv + hkv) * NUM_SPLITS + split) * BLOCK_M
    tl.store(acc_ptr + (base + rows)[:, None] * D + dims[None, :], acc)
    tl.store(ml_ptr + (base + rows) * 2, m_i)
    tl.store(ml_ptr + (base + rows) * 2 + 1, l_i)


@triton.jit
def _split_kv_partial(q_ptr, k_ptr, v_ptr, start_ptr, acc_ptr, ml_ptr, scale,
                      stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                      T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                      PER_ROW: tl.constexpr = 0):
    pdl_wait(PDL)  # q and the cache row at start come from the kernel before (models/pdl.py)
    # The step varies fastest in the grid, so the R programs of one (KV head, split) of a rows launch run side by
    # side and read the same cache tiles at about the same time: R - 1 of each tile's reads hit L2 instead of HBM.
    step = tl.program_id(0)  # the step of a rows launch (T = 1 each, at start_pos + step); 0 otherwise
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    if PER_ROW > 0:  # several users' rows: start_ptr holds each row's position, then (PER_ROW on) its cache row
        start = tl.load(start_ptr + step)
        seat0 = tl.load(start_ptr + PER_ROW + step) - start  # the first cache row of the row's seat
        k_ptr += seat0 * stride_ks
        v_ptr += seat0 * stride_vs
    else:
        start = tl.load(start_ptr) + step
    q_ptr += step * stride_qt
    kv_len = start + T
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_len)

    rows = tl.arange(0, BLOCK_M)  # row r = g * T + t
    t_idx = rows % T
    head = hkv * G + rows // T
    row_ok = rows < G * T
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + t_idx[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    row_pos = start + t_idx  # the last key each row may see

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        k = tl.load(k_ptr + cols[None, :] * stride_ks + hkv * stride_kh + dims[:, None],
                    mask=col_ok[None, :], other=0.0)  # [D, BLOCK_N]
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        visible = col_ok[None, :] & (cols[None, :] <= row_pos[:, None])
        m_new, alpha, p, l_i = _softmax_step(s, visible, m_i, l_i, scale)
        v = tl.load(v_ptr + cols[:, None] * stride_vs + hkv * stride_vh + dims[None, :],
                    mask=col_ok[:, None], other=0.0)  # [BLOCK_N, D]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    _store_partial(acc_ptr, ml_ptr, step, hkv, tl.num_programs(1), split, m_i, l_i, acc, rows, dims, NUM_SPLITS,
                   BLOCK_M, D)


@triton.jit
def _split_kv_merge(acc_ptr, ml_ptr, out_ptr, stride_ot, stride_oh,
                    T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    hkv = tl.program_id(0)
    r = tl.program_id(1)  # r = g * T + t
    step = tl.program_id(2)
    splits = tl.arange(0, NUM_SPLITS)
    idx = ((step * tl.num_programs(0) + hkv) * NUM_SPLITS + splits) * BLOCK_M + r
    out_ptr += step * stride_ot
    m = tl.load(ml_ptr + idx * 2)
    l = tl.load(ml_ptr + idx * 2 + 1)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    dims = tl.arange(0, D)
    acc = tl.load(acc_ptr + idx[:, None] * D + dims[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    t = r % T
    head = hkv * G + r // T
    tl.store(out_ptr + t * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _row_bounds(start_row, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key range [lo, hi) of `split` for a T = 1 step whose token is at start_row: _split_kv_partial's."""
    kv_len = start_row + 1
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    # an empty split (lo past the row's end) gives hi = kv_len < lo: no tile of its own, and the shared kernel's
    # tile range (up to the largest hi) stays inside the cache. hi = lo there read past the cache's end on the
    # H200 (2026-12-05: an illegal address where a verify straddles a chunk boundary).
    return lo, tl.minimum(lo + chunk, kv_len)


@triton.jit
def _row_tile(q, k, v, m_i, l_i, acc, cols, hi, row_pos, scale, IEEE: tl.constexpr):
    """One tile of one row's online softmax, exactly _split_kv_partial's loop body for T = 1. k [D, BLOCK_N] and
    v [BLOCK_N, D] were read once for every row, up to the longest row's end. The columns at or past this row's
    hi: their scores are -inf (`visible`) whatever k holds there (a score column depends on its own k column
    only), as the one-row kernel's are over its zero-loaded k, so k is not zeroed (zeroing it doubled the
    selects and made the five-row kernel spill: 486 B a thread at D = 128 in bf16, ptxas for sm_90a); v is
    zeroed as that kernel's masked load zeroes it, so p * v is its 0 * 0 there."""
    col_ok = cols < hi
    v = tl.where(col_ok[:, None], v, tl.zeros_like(v))
    if IEEE:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    visible = col_ok[None, :] & (cols[None, :] <= row_pos)
    m_new, alpha, p, l_i = _softmax_step(s, visible, m_i, l_i, scale)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _split_kv_partial_shared(q_ptr, k_ptr, v_ptr, start_ptr, acc_ptr, ml_ptr, scale,
                             stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                             ROWS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    """`_split_kv_partial` for ROWS (2 .. 5) one-row steps at start .. start + ROWS - 1 in ONE program per
    (KV head, split): each cache tile of the split is read once, and each row's online softmax runs over it
    with exactly the operations, operands and order of that row's own one-row program (the tiles in its own
    range [lo_r, hi_r), which lie on the same BLOCK_N grid for every row), so each row's partials, and the merge
    after them, are bit-identical to a one-row launch's. Same partial buffer layout as a rows launch."""
    pdl_wait(PDL)
    hkv = tl.program_id(0)
    split = tl.program_id(1)
    start = tl.load(start_ptr)
    rows = tl.arange(0, BLOCK_M)  # row g: query head hkv * G + g
    head = hkv * G + rows
    row_ok = rows < G
    dims = tl.arange(0, D)
    q_off = head[:, None] * stride_qh + dims[None, :]
    q0 = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)
    lo0, hi0 = _row_bounds(start, split, NUM_SPLITS, BLOCK_N)
    m0 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l0 = tl.zeros([BLOCK_M], tl.float32)
    a0 = tl.zeros([BLOCK_M, D], tl.float32)
    q1, q2, q3, q4 = q0, q0, q0, q0
    lo1, lo2, lo3, lo4 = lo0, lo0, lo0, lo0
    hi1, hi2, hi3, hi4 = hi0, hi0, hi0, hi0
    m1, m2, m3, m4 = m0, m0, m0, m0
    l1, l2, l3, l4 = l0, l0, l0, l0
    a1, a2, a3, a4 = a0, a0, a0, a0
    hi_all = hi0
    if ROWS > 1:
        q1 = tl.load(q_ptr + stride_qt + q_off, mask=row_ok[:, None], other=0.0)
        lo1, hi1 = _row_bounds(start + 1, split, NUM_SPLITS, BLOCK_N)
        hi_all = tl.maximum(hi_all, hi1)
    if ROWS > 2:
        q2 = tl.load(q_ptr + 2 * stride_qt + q_off, mask=row_ok[:, None], other=0.0)
        lo2, hi2 = _row_bounds(start + 2, split, NUM_SPLITS, BLOCK_N)
        hi_all = tl.maximum(hi_all, hi2)
    if ROWS > 3:
        q3 = tl.load(q_ptr + 3 * stride_qt + q_off, mask=row_ok[:, None], other=0.0)
        lo3, hi3 = _row_bounds(start + 3, split, NUM_SPLITS, BLOCK_N)
        hi_all = tl.maximum(hi_all, hi3)
    if ROWS > 4:
        q4 = tl.load(q_ptr + 4 * stride_qt + q_off, mask=row_ok[:, None], other=0.0)
        lo4, hi4 = _row_bounds(start + 4, split, NUM_SPLITS, BLOCK_N)
        hi_all = tl.maximum(hi_all, hi4)
    # lo_r = split * chunk_r and chunk_r never shrinks as the row's length grows: row 0's lo is the smallest
    for n0 in range(lo0, hi_all, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        in_any = cols < hi_all
        k = tl.load(k_ptr + cols[None, :] * stride_ks + hkv * stride_kh + dims[:, None],
                    mask=in_any[None, :], other=0.0)  # [D, BLOCK_N]
        v = tl.load(v_ptr + cols[:, None] * stride_vs + hkv * stride_vh + dims[None, :],
                    mask=in_any[:, None], other=0.0)  # [BLOCK_N, D]
        if n0 < hi0:
            m0, l0, a0 = _row_tile(q0, k, v, m0, l0, a0, cols, hi0, start, scale, IEEE)
        if ROWS > 1:
            if (n0 >= lo1) & (n0 < hi1):
                m1, l1, a1 = _row_tile(q1, k, v, m1, l1, a1, cols, hi1, start + 1, scale, IEEE)
        if ROWS > 2:
            if (n0 >= lo2) & (n0 < hi2):
                m2, l2, a2 = _row_tile(q2, k, v, m2, l2, a2, cols, hi2, start + 2, scale, IEEE)
        if ROWS > 3:
            if (n0 >= lo3) & (n0 < hi3):
                m3, l3, a3 = _row_tile(q3, k, v, m3, l3, a3, cols, hi3, start + 3, scale, IEEE)
        if ROWS > 4:
            if (n0 >= lo4) & (n0 < hi4):
                m4, l4, a4 = _row_tile(q4, k, v, m4, l4, a4, cols, hi4, start + 4, scale, IEEE)
    num_kv = tl.num_programs(0)
    _store_partial(acc_ptr, ml_ptr, 0, hkv, num_kv, split, m0, l0, a0, rows, dims, NUM_SPLITS, BLOCK_M, D)
    if ROWS > 1:
        _store_partial(acc_ptr, ml_ptr, 1, hkv, num_kv, split, m1, l1, a1, rows, dims, NUM_SPLITS, BLOCK_M, D)
    if ROWS > 2:
        _store_partial(acc_ptr, ml_ptr, 2, hkv, num_kv, split, m2, l2, a2, rows, dims, NUM_SPLITS, BLOCK_M, D)
    if ROWS > 3:
        _store_partial(acc_ptr, ml_ptr, 3, hkv, num_kv, split, m3, l3, a3, rows, dims, NUM_SPLITS, BLOCK_M, D)
    if ROWS > 4:
        _store_partial(acc_ptr, ml_ptr, 4, hkv, num_kv, split, m4, l4, a4, rows, dims, NUM_SPLITS, BLOCK_M, D)


#: The most rows `split_kv_attention_rows(..., shared=True)` takes in one program (a verify of 4 drafts).
SHARED_MAX_ROWS = 5


def num_splits_for(num_kv_heads: int, device: torch.device) -> int:
    """Enough programs to fill the GPU twice over: a power of two in [1, 64]."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = max(1, (2 * sms) // num_kv_heads)
    return min(64, 1 << (want.bit_length() - 1))


def _split_kv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start_pos: torch.Tensor,
              scale: float, t: int, steps: int, shared: bool = False, per_row: int = 0) -> torch.Tensor:
    """q [t * steps, H, D]: `steps` launches' worth of T = t query rows (steps > 1 only with t = 1). shared:
    the steps in one program per (KV head, split) (_split_kv_partial_shared) instead of one each. per_row > 0:
    start_pos holds each step's position, then from index per_row its cache row (split_kv_attention_seats)."""
    h, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    g = h // hkv
    q = q.contiguous()
    splits = num_splits_for(hkv, q.device)
    block_m = max(16, triton.next_power_of_2(g * t))
    acc = torch.empty(steps * hkv * splits * block_m, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(steps * hkv * splits * block_m, 2, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    ieee = q.dtype == torch.float32
    pdl, pdl_merge = use_pdl(q.device, "attn_partial"), use_pdl(q.device, "attn_merge")
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))
    if shared and steps > 1:
        # num_warps as the per-row kernel's: the row max and sums are reduced across the same warps (bits)
        _split_kv_partial_shared[(hkv, splits)](
            q, k_cache, v_cache, start_pos, acc, ml, scale, *strides,
            ROWS=steps, G=g, D=d, NUM_SPLITS=splits, BLOCK_M=block_m, BLOCK_N=32 if ieee else 64, IEEE=ieee,
            PDL=pdl, num_warps=4, launch_pdl=pdl)
    else:
        _split_kv_partial[(steps, hkv, splits)](
            q, k_cache, v_cache, start_pos, acc, ml, scale, *strides,
            T=t, G=g, D=d, NUM_SPLITS=splits, BLOCK_M=block_m, BLOCK_N=32 if ieee else 64, IEEE=ieee, PDL=pdl,
            PER_ROW=per_row, num_warps=4, launch_pdl=pdl)
    _split_kv_merge[(hkv, g * t, steps)](acc, ml, out, out.stride(0), out.stride(1), T=t, G=g, D=d,
                                         NUM_SPLITS=splits, BLOCK_M=block_m, PDL=pdl_merge, num_warps=1,
                                         launch_pdl=pdl_merge)
    return out


@torch.library.custom_op("expresslane::split_kv_attention", mutates_args=())
def split_kv_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start_pos: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """q [T, H, D] (rows at start_pos .. start_pos+T-1), caches [S, Hkv, D], start_pos [1] long on q's device."""
    return _split_kv(q, k_cache, v_cache, start_pos, scale, q.shape[0], 1)


def split_kv_attention_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start_pos: torch.Tensor,
                            scale: float, shared: bool = False) -> torch.Tensor:
    """q [R, H, D]: R one-row steps in one launch, row r a T = 1 step at start_pos + r (its keys: rows
    0 .. start_pos + r), each bit-identical to `split_kv_attention(q[r:r+1], ..., start_pos + r)`.
    shared (R <= SHARED_MAX_ROWS): one program per (KV head, split) reads each cache tile once for all R rows
    instead of R programs reading it through L2 (the long-context verify's cost; not yet measured on a GPU,
    so not the lean step's choice: docs/bench/2026-12-05-gpu-check/probe_verify_attention.py times and compares the two)."""
    r = q.shape[0]
    if shared and r > SHARED_MAX_ROWS:
        raise ValueError(f"the shared rows kernel takes at most {SHARED_MAX_ROWS} rows, got {r}")
    return _split_kv(q, k_cache, v_cache, start_pos, scale, 1, r, shared=shared)


def split_kv_attention_seats(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """q [R, H, D]: R one-row steps of several sequences in one launch (a step over several users' rows, decode/
    batch.py). rows: [2 * P] long on q's device, P >= R: row r's position at rows[r], its cache row at rows[P + r]
    (its seat's first row plus the position). Row r attends over its own seat's rows up to its position, exactly
    as `split_kv_attention_rows` runs a one-row step there (the same splits of its own length): its bits are
    that step's whatever the other rows are."""
    if rows.dim() != 1 or rows.numel() % 2 or rows.numel() // 2 < q.shape[0]:
        raise ValueError(f"rows: [2 * P] positions then cache rows for {q.shape[0]} rows, got {tuple(rows.shape)}")
    return _split_kv(q, k_cache, v_cache, rows, scale, 1, q.shape[0], per_row=rows.numel() // 2)


@split_kv_attention.register_fake
def _(q, k_cache, v_cache, start_pos, scale):
    return torch.empty_like(q)
