"""Fused batch-1 kernels of the lean decode step (models/lean.py), in Triton.

Each kernel is a GEMV (one activation row times a [N, K] row-major weight, float32 accumulation) with the
work around it folded in, so a decoder layer is six launches (this file's four, the split-KV attention's two):

* `norm_qkv_rope`: RMSNorm of the residual, the QKV projection (+ bias), RoPE of q and k, and the write of
  k and v into the cache at the position read from the device. A program owns BJ row pairs (j, j + D/2) of
  one head, so the rotation needs nothing from another program.
* `gemv_residual`: o_proj / down_proj (+ bias) added into the residual stream in place.
* `norm_gate_up_silu`: RMSNorm, the gate and up rows of gate_up_proj, silu(gate) * up.
* `norm_gemv`: the final RMSNorm and the lm_head, float32 logits out.

Rounding follows the PyTorch step (models/transformer.py) at every point it rounds: the norm in float32 cast
to the model dtype then scaled by the weight in the model dtype, each projection's output rounded to the
model dtype, RoPE's two products and their sum rounded, silu(gate) rounded before the product with up, the
residual sum rounded. What differs is the GEMV's summation order (as between any two GEMV kernels).

The RMSNorm statistic is recomputed by every program from the whole input row (a few KB from L2): that is what
lets the norm live inside the projection's kernel. Block shapes are picked per (kernel, N, K) by timing each
candidate once on the device (`pick_config`); off a GPU (Triton's interpreter, the unit tests) the first
candidate that fits is used. Two loops: the plain one (each iteration loads its tile, then multiplies; the norm
statistic is a loop of its own first), measured on the H200 (docs/bench/2026-12-01-gpu-lean-step/),
and a prefetching one (the next tile is loaded before this one's products; the first tile's load is issued
before the norm statistic, which is one load of the row), added after that run and picked only where the
device's timing finds it faster. Both compute the same sums in the same order.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch
import triton
import triton.language as tl
import triton.testing
from triton.runtime.errors import OutOfResources

from .pdl import pdl_wait, use_pdl
from .precompile import precompile

# (rows per program, K per iteration, prefetch): 8,192 weights (16 KB of bf16) a program and iteration; with
# prefetch (1) the next iteration's tile is loaded before this one's products, so two tiles of half the size
# are in flight, and the RMSNorm statistic is one load of the whole row issued after the first tile's load.
# Prefetch 0 is the loop measured on the H200 in docs/bench/2026-12-01-gpu-lean-step; the prefetch candidates
# were added after that run (not measured yet): the device's timing picks whichever is faster.
# A fourth element is the program's warps (4 when absent): the 8-warp candidates keep twice the loads in
# flight per program (docs/bench/2026-12-01-gpu-greedy-chain/: added after the lean step's first profile found the
# 8B's QKV GEMV at 66 % and its gate/up at 86 % of copy speed; the first run with them picked 8x256pw8 for the QKV
# of both shapes, 33 -> 24 us for the 8B's; the last row of each list adds the neighbours of the picks of that run).
# A fifth element packs (PACK columns a group, one accumulator: _fma): the packed candidates, last, are the shapes
# whose five-row kernels need the fewest registers in sm_90 ptxas (80-160 a thread where the unpacked shapes that
# do not spill need up to 241, at a few warps an SM); a verifying step's pick weighs them by their verify
# (verify_pick). On the H200 they take 20-50 % off the five-row time of the normalising kernels, and are the
# fastest one-row shape of some (docs/bench/2026-12-05-h200-hint-packed/probe_packed_gemv.py).
GEMV_CONFIGS = ((4, 2048, 0), (8, 1024, 0), (16, 512, 0), (32, 256, 0), (8, 512, 1), (16, 256, 1), (32, 128, 1),
                (16, 512, 0, 8), (32, 256, 0, 8), (16, 256, 1, 8),
                (4, 1024, 1), (8, 1024, 1), (4, 512, 1), (8, 512, 1, 8), (4, 1024, 1, 8),
                (4, 1024, 1, 4, 8), (4, 512, 1, 4, 8), (8, 512, 1, 4, 8), (4, 2048, 0, 8, 8), (8, 1024, 1, 8, 8),
                (4, 1024, 1, 8, 8), (8, 2048, 0, 8, 8))
# (row pairs per program, K per iteration, prefetch[, warps[, pack]]) for the kernels that own two row sets.
PAIR_CONFIGS = ((2, 2048, 0), (4, 1024, 0), (8, 512, 0), (16, 256, 0), (4, 512, 1), (8, 256, 1), (16, 128, 1),
                (8, 512, 0, 8), (16, 256, 0, 8), (8, 256, 1, 8),
                (16, 128, 1, 8), (4, 256, 1, 8), (8, 128, 1, 8), (4, 512, 1, 8), (4, 256, 1),
                (4, 512, 1, 8, 8), (8, 256, 1, 8, 8), (8, 512, 1, 8, 8), (4, 256, 1, 4, 8), (16, 256, 1, 8, 8),
                (2, 1024, 1, 4, 8), (4, 1024, 1, 8, 8))


@triton.jit
def _rstd(x_ptr, K, eps, BLOCK_K: tl.constexpr):
    acc = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc += xv * xv
    return 1.0 / tl.sqrt(tl.sum(acc, axis=0) / K + eps)


@triton.jit
def _rstd_once(x_ptr, K, eps, K_POW2: tl.constexpr):
    """The same statistic from one load of the whole row (one memory latency instead of K / BLOCK_K)."""
    cols = tl.arange(0, K_POW2)
    xv = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(xv * xv, axis=0) / K + eps)


@triton.jit
def _input_chunk(x_ptr, nw_ptr, cols, K, rstd, HAS_NORM: tl.constexpr):
    """x[cols] as the projection sees it: the model-dtype RMSNorm output, or x itself (float32 values)."""
    kmask = cols < K
    xv = tl.load(x_ptr + cols, mask=kmask, other=0.0)
    if HAS_NORM:
        dt = xv.dtype
        xn = (xv.to(tl.float32) * rstd).to(dt)
        nw = tl.load(nw_ptr + cols, mask=kmask, other=0.0)
        xv = (xn.to(tl.float32) * nw.to(tl.float32)).to(dt)
    return xv.to(tl.float32)


@triton.jit
def _rounded(x, dt: tl.constexpr):
    """float32 x rounded to dt (nearest even), as a float32 value. For bf16 the rounding is done on the bits:
    written as `x.to(bf16)`, the compiler turns "round(a*c) + round(b*s)" into one bf16 FMA (seen in the
    PTX: fma.rn.bf16x2), which skips the product's rounding the PyTorch step (and vLLM's rotary kernel) does.
    Inf stays inf; NaN is not expected here."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dt).to(tl.float32)


#: The most rows one launch of these kernels takes: a T = 1 step is 1, a verify of k drafts k + 1 (k <= 4).
MAX_ROWS = 5


@triton.jit
def _cols(k0, BLOCK_K: tl.constexpr, PACK: tl.constexpr):
    """The K indices of one iteration's tile: [BLOCK_K], or with PACK [BLOCK_K // PACK, PACK] (PACK consecutive
    columns a group, summed inside one thread: see _fma_rows)."""
    if PACK > 0:
        return k0 + tl.arange(0, BLOCK_K // PACK)[:, None] * PACK + tl.arange(0, PACK)[None, :]
    else:
        return k0 + tl.arange(0, BLOCK_K)


@triton.jit
def _load_rows(w_ptr, rows, rmask, cols, K, PACK: tl.constexpr):
    if PACK > 0:
        return tl.load(w_ptr + rows[:, None, None] * K + cols[None, :, :],
                       mask=rmask[:, None, None] & (cols[None, :, :] < K), other=0.0)
    else:
        return tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=rmask[:, None] & (cols[None, :] < K),
                       other=0.0)


@triton.jit
def _zeros(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PACK: tl.constexpr):
    """One row's accumulators: [BLOCK_N, BLOCK_K], or with PACK one per group [BLOCK_N, BLOCK_K // PACK]."""
    if PACK > 0:
        return tl.zeros([BLOCK_N, BLOCK_K // PACK], tl.float32)
    else:
        return tl.zeros([BLOCK_N, BLOCK_K], tl.float32)


@triton.jit
def _rstd_rows(x_ptr, sx, K, eps, BLOCK_K: tl.constexpr, K_POW2: tl.constexpr, ONCE: tl.constexpr,
               ROWS: tl.constexpr, HAS_NORM: tl.constexpr):
    """The RMSNorm statistic of each of the ROWS input rows (row r at x_ptr + r * sx), each computed as a
    one-row kernel computes it (_rstd_once or _rstd): one row's statistic never depends on another row.
    Without HAS_NORM: 1.0 each (unused)."""
    r0 = 1.0
    r1 = 1.0
    r2 = 1.0
    r3 = 1.0
    r4 = 1.0
    if not HAS_NORM:
        pass
    elif ONCE:
        r0 = _rstd_once(x_ptr, K, eps, K_POW2)
        if ROWS > 1:
            r1 = _rstd_once(x_ptr + sx, K, eps, K_POW2)
        if ROWS > 2:
            r2 = _rstd_once(x_ptr + 2 * sx, K, eps, K_POW2)
        if ROWS > 3:
            r3 = _rstd_once(x_ptr + 3 * sx, K, eps, K_POW2)
        if ROWS > 4:
            r4 = _rstd_once(x_ptr + 4 * sx, K, eps, K_POW2)
    else:
        r0 = _rstd(x_ptr, K, eps, BLOCK_K)
        if ROWS > 1:
            r1 = _rstd(x_ptr + sx, K, eps, BLOCK_K)
        if ROWS > 2:
            r2 = _rstd(x_ptr + 2 * sx, K, eps, BLOCK_K)
        if ROWS > 3:
            r3 = _rstd(x_ptr + 3 * sx, K, eps, BLOCK_K)
        if ROWS > 4:
            r4 = _rstd(x_ptr + 4 * sx, K, eps, BLOCK_K)
    return r0, r1, r2, r3, r4


@triton.jit
def _halves(t):
    """[a, b, 2m] -> its even and odd elements of the last axis, [a, b, m] each (in one thread: free)."""
    if t.shape[2] == 2:
        return tl.split(t)
    else:
        return tl.split(tl.reshape(t, [t.shape[0], t.shape[1], t.shape[2] // 2, 2]))


@triton.jit
def _fma2(acc, w, x):
    """acc + w[..., 0] * x[..., 0] + w[..., 1] * x[..., 1], in that order (two FMAs)."""
    a, b = _halves(w)
    c, d = _halves(x)
    acc += a * c
    acc += b * d
    return acc


@triton.jit
def _fma4(acc, w, x):
    w0, w1 = _halves(w)
    x0, x1 = _halves(x)
    return _fma2(_fma2(acc, w0, x0), w1, x1)


@triton.jit
def _fma8(acc, w, x):
    w0, w1 = _halves(w)
    x0, x1 = _halves(x)
    return _fma4(_fma4(acc, w0, x0), w1, x1)


@triton.jit
def _fma(acc, wf, xc, PACK: tl.constexpr):
    """acc + one row's products of a tile: w * x elementwise, or with PACK (2, 4, 8) each group's PACK products
    added to the group's one accumulator as a chain of FMAs in a fixed order (its columns are one vector load, in
    one thread), so the accumulator a row keeps is PACK times smaller."""
    if PACK == 0:
        return acc + wf * xc[None, :]
    else:
        x = tl.broadcast_to(xc[None, :, :], wf.shape)
        if PACK == 8:
            return _fma8(acc, wf, x)
        elif PACK == 4:
            return _fma4(acc, wf, x)
        else:
            tl.static_assert(PACK == 2, "PACK is 0, 2, 4 or 8")
            return _fma2(acc, wf, x)


@triton.jit
def _fma_rows(w, a0, a1, a2, a3, a4, x_ptr, sx, nw_ptr, cols, K, r0, r1, r2, r3, r4, HAS_NORM: tl.constexpr,
              ROWS: tl.constexpr, PACK: tl.constexpr):
    """a_r += w * in_r[cols] for each of the ROWS rows: the tile w, loaded once, serves every row, and each
    row's accumulator sees exactly the operations a one-row kernel's accumulator sees, in the same order."""
    wf = w.to(tl.float32)
    a0 = _fma(a0, wf, _input_chunk(x_ptr, nw_ptr, cols, K, r0, HAS_NORM), PACK)
    if ROWS > 1:
        a1 = _fma(a1, wf, _input_chunk(x_ptr + sx, nw_ptr, cols, K, r1, HAS_NORM), PACK)
    if ROWS > 2:
        a2 = _fma(a2, wf, _input_chunk(x_ptr + 2 * sx, nw_ptr, cols, K, r2, HAS_NORM), PACK)
    if ROWS > 3:
        a3 = _fma(a3, wf, _input_chunk(x_ptr + 3 * sx, nw_ptr, cols, K, r3, HAS_NORM), PACK)
    if ROWS > 4:
        a4 = _fma(a4, wf, _input_chunk(x_ptr + 4 * sx, nw_ptr, cols, K, r4, HAS_NORM), PACK)
    return a0, a1, a2, a3, a4


@triton.jit
def _sum_rows(a0, a1, a2, a3, a4, ROWS: tl.constexpr):
    y0 = tl.sum(a0, axis=1)
    y1 = y0
    y2 = y0
    y3 = y0
    y4 = y0
    if ROWS > 1:
        y1 = tl.sum(a1, axis=1)
    if ROWS > 2:
        y2 = tl.sum(a2, axis=1)
    if ROWS > 3:
        y3 = tl.sum(a3, axis=1)
    if ROWS > 4:
        y4 = tl.sum(a4, axis=1)
    return y0, y1, y2, y3, y4


@triton.jit
def _gemv1(w_ptr, rows, rmask, x_ptr, nw_ptr, K, eps, sx, HAS_NORM: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, K_POW2: tl.constexpr, PDL: tl.constexpr,
           ROWS: tl.constexpr, PACK: tl.constexpr):
    """sum_k w[rows, k] * in_r[k] in float32 for each of the ROWS input rows (row r at x_ptr + r * sx),
    in_r = RMSNorm(x_r) (HAS_NORM) or x_r. Each weight tile is loaded once for all rows. Row r's sums are
    bit-identical to a one-row launch's over x_r: the same tile shapes, the same accumulation order, the same
    final reduction (the row-invariant verify, models/lean.py). PDL: the first weight tile (the weights are
    constant) is loaded before the wait for the kernel this one depends on (models/pdl.py). PACK: each group
    of PACK columns is summed in its thread before it joins the row's accumulator (_fma)."""
    a0 = _zeros(BLOCK_N, BLOCK_K, PACK)
    a1 = a0
    a2 = a0
    a3 = a0
    a4 = a0
    if PREFETCH:
        w_cur = _load_rows(w_ptr, rows, rmask, _cols(0, BLOCK_K, PACK), K, PACK)
        pdl_wait(PDL)
        r0, r1, r2, r3, r4 = _rstd_rows(x_ptr, sx, K, eps, BLOCK_K, K_POW2, True, ROWS, HAS_NORM)
        for k0 in range(0, K, BLOCK_K):
            cols = _cols(k0, BLOCK_K, PACK)
            w_next = _load_rows(w_ptr, rows, rmask, cols + BLOCK_K, K, PACK)
            a0, a1, a2, a3, a4 = _fma_rows(w_cur, a0, a1, a2, a3, a4, x_ptr, sx, nw_ptr, cols, K,
                                           r0, r1, r2, r3, r4, HAS_NORM, ROWS, PACK)
            w_cur = w_next
    else:
        pdl_wait(PDL)
        r0, r1, r2, r3, r4 = _rstd_rows(x_ptr, sx, K, eps, BLOCK_K, K_POW2, False, ROWS, HAS_NORM)
        for k0 in range(0, K, BLOCK_K):
            cols = _cols(k0, BLOCK_K, PACK)
            w = _load_rows(w_ptr, rows, rmask, cols, K, PACK)
            a0, a1, a2, a3, a4 = _fma_rows(w, a0, a1, a2, a3, a4, x_ptr, sx, nw_ptr, cols, K,
                                           r0, r1, r2, r3, r4, HAS_NORM, ROWS, PACK)
    y0, y1, y2, y3, y4 = _sum_rows(a0, a1, a2, a3, a4, ROWS)
    return y0, y1, y2, y3, y4


@triton.jit
def _gemv2(w_ptr, rows_a, rows_b, rmask, x_ptr, nw_ptr, K, eps, sx, BJ: tl.constexpr, BLOCK_K: tl.constexpr,
           PREFETCH: tl.constexpr, K_POW2: tl.constexpr, PDL: tl.constexpr, ROWS: tl.constexpr,
           PACK: tl.constexpr):
    """_gemv1 over RMSNorm(x_r) for two row sets that share the input (RoPE pairs, gate and up rows)."""
    a0 = _zeros(BJ, BLOCK_K, PACK)
    a1 = a0
    a2 = a0
    a3 = a0
    a4 = a0
    b0 = a0
    b1 = a0
    b2 = a0
    b3 = a0
    b4 = a0
    if PREFETCH:
        first = _cols(0, BLOCK_K, PACK)
        wa = _load_rows(w_ptr, rows_a, rmask, first, K, PACK)
        wb = _load_rows(w_ptr, rows_b, rmask, first, K, PACK)
        pdl_wait(PDL)
        r0, r1, r2, r3, r4 = _rstd_rows(x_ptr, sx, K, eps, BLOCK_K, K_POW2, True, ROWS, True)
        for k0 in range(0, K, BLOCK_K):
            cols = _cols(k0, BLOCK_K, PACK)
            wa_next = _load_rows(w_ptr, rows_a, rmask, cols + BLOCK_K, K, PACK)
            wb_next = _load_rows(w_ptr, rows_b, rmask, cols + BLOCK_K, K, PACK)
            a0, a1, a2, a3, a4 = _fma_rows(wa, a0, a1, a2, a3, a4, x_ptr, sx, nw_ptr, cols, K,
                                           r0, r1, r2, r3, r4, True, ROWS, PACK)
            b0, b1, b2, b3, b4 = _fma_rows(wb, b0, b1, b2, b3, b4, x_ptr, sx, nw_ptr, cols, K,
                                           r0, r1, r2, r3, r4, True, ROWS, PACK)
            wa = wa_next
            wb = wb_next
    else:
        pdl_wait(PDL)
        r0, r1, r2, r3, r4 = _rstd_rows(x_ptr, sx, K, eps, BLOCK_K, K_POW2, False, ROWS, True)
        for k0 in range(0, K, BLOCK_K):
            cols = _cols(k0, BLOCK_K, PACK)
            wa = _load_rows(w_ptr, rows_a, rmask, cols, K, PACK)
            wb = _load_rows(w_ptr, rows_b, rmask, cols, K, PACK)
            a0, a1, a2, a3, a4 = _fma_rows(wa, a0, a1, a2, a3, a4, x_ptr, sx, nw_ptr, cols, K,
                                           r0, r1, r2, r3, r4, True, ROWS, PACK)
            b0, b1, b2, b3, b4 = _fma_rows(wb, b0, b1, b2, b3, b4, x_ptr, sx, nw_ptr, cols, K,
                                           r0, r1, r2, r3, r4, True, ROWS, PACK)
    ya0, ya1, ya2, ya3, ya4 = _sum_rows(a0, a1, a2, a3, a4, ROWS)
    yb0, yb1, yb2, yb3, yb4 = _sum_rows(b0, b1, b2, b3, b4, ROWS)
    return ya0, ya1, ya2, ya3, ya4, yb0, yb1, yb2, yb3, yb4


@triton.jit
def _qkv_rope_store(a, b, j, rows_a, rows_b, head, pos, b_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr,
                    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, NH: tl.constexpr, NKV: tl.constexpr,
                    D: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One row's epilogue of norm_qkv_rope: bias, rounding, RoPE at `pos`, q out or the cache row `pos`."""
    HALF: tl.constexpr = D // 2
    if HAS_BIAS:
        a += tl.load(b_ptr + rows_a).to(tl.float32)
        b += tl.load(b_ptr + rows_b).to(tl.float32)
    dt = q_ptr.dtype.element_ty
    a = a.to(dt)
    b = b.to(dt)
    if head < NH + NKV:  # q or k: rotate. cos/sin rows are the signed tables of rope.py: sin = (-s, s)
        cos_a = tl.load(cos_ptr + pos * D + j).to(tl.float32)
        cos_b = tl.load(cos_ptr + pos * D + HALF + j).to(tl.float32)
        sin_a = tl.load(sin_ptr + pos * D + j).to(tl.float32)
        sin_b = tl.load(sin_ptr + pos * D + HALF + j).to(tl.float32)
        af = a.to(tl.float32)
        bf = b.to(tl.float32)
        ra = (_rounded(af * cos_a, dt) + _rounded(bf * sin_a, dt)).to(dt)
        rb = (_rounded(bf * cos_b, dt) + _rounded(af * sin_b, dt)).to(dt)
        if head < NH:
            tl.store(q_ptr + rows_a, ra)
            tl.store(q_ptr + rows_b, rb)
        else:
            kp = kc_ptr + pos * stride_kc_s + (head - NH) * stride_kc_h + j
            tl.store(kp, ra)
            tl.store(kp + HALF, rb)
    else:
        vp = vc_ptr + pos * stride_vc_s + (head - NH - NKV) * stride_vc_h + j
        tl.store(vp, a)
        tl.store(vp + HALF, b)


@triton.jit
def _norm_qkv_rope_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, start_ptr, q_ptr, kc_ptr, vc_ptr,
                          K, eps, sx, sq, stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h,
                          NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BJ: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
                          K_POW2: tl.constexpr, PDL: tl.constexpr, ROWS: tl.constexpr, PACK: tl.constexpr):
    HALF: tl.constexpr = D // 2
    NBLK: tl.constexpr = HALF // BJ
    pid = tl.program_id(0)
    head = pid // NBLK
    j = (pid % NBLK) * BJ + tl.arange(0, BJ)
    rows_a = head * D + j
    rows_b = rows_a + HALF
    ok = j < HALF
    ya0, ya1, ya2, ya3, ya4, yb0, yb1, yb2, yb3, yb4 = _gemv2(w_ptr, rows_a, rows_b, ok, x_ptr, nw_ptr, K, eps, sx,
                                                              BJ, BLOCK_K, PREFETCH, K_POW2, PDL, ROWS, PACK)
    pos = tl.load(start_ptr)  # row r is the token at pos + r
    _qkv_rope_store(ya0, yb0, j, rows_a, rows_b, head, pos, b_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr,
                    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, NH, NKV, D, HAS_BIAS)
    if ROWS > 1:
        _qkv_rope_store(ya1, yb1, j, rows_a, rows_b, head, pos + 1, b_ptr, cos_ptr, sin_ptr, q_ptr + sq,
                        kc_ptr, vc_ptr, stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, NH, NKV, D, HAS_BIAS)
    if ROWS > 2:
        _qkv_rope_store(ya2, yb2, j, rows_a, rows_b, head, pos + 2, b_ptr, cos_ptr, sin_ptr, q_ptr + 2 * sq,
                        kc_ptr, vc_ptr, stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, NH, NKV, D, HAS_BIAS)
    if ROWS > 3:
        _qkv_rope_store(ya3, yb3, j, rows_a, rows_b, head, pos + 3, b_ptr, cos_ptr, sin_ptr, q_ptr + 3 * sq,
                        kc_ptr, vc_ptr, stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, NH, NKV, D, HAS_BIAS)
    if ROWS > 4:
        _qkv_rope_store(ya4, yb4, j, rows_a, rows_b, head, pos + 4, b_ptr, cos_ptr, sin_ptr, q_ptr + 4 * sq,
                        kc_ptr, vc_ptr, stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, NH, NKV, D, HAS_BIAS)


@triton.jit
def _residual_store(y, rows, rmask, b_ptr, res_ptr, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + rows, mask=rmask, other=0.0)
    dt = res.dtype
    out = (res.to(tl.float32) + y.to(dt).to(tl.float32)).to(dt)
    tl.store(res_ptr + rows, out, mask=rmask)


@triton.jit
def _gemv_residual_kernel(a_ptr, w_ptr, b_ptr, res_ptr, N, K, sa, sres, HAS_BIAS: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
                          PDL: tl.constexpr, ROWS: tl.constexpr, PACK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    y0, y1, y2, y3, y4 = _gemv1(w_ptr, rows, rmask, a_ptr, a_ptr, K, 0.0, sa, False, BLOCK_N, BLOCK_K, PREFETCH, 16,
                                PDL, ROWS, PACK)
    _residual_store(y0, rows, rmask, b_ptr, res_ptr, HAS_BIAS)
    if ROWS > 1:
        _residual_store(y1, rows, rmask, b_ptr, res_ptr + sres, HAS_BIAS)
    if ROWS > 2:
        _residual_store(y2, rows, rmask, b_ptr, res_ptr + 2 * sres, HAS_BIAS)
    if ROWS > 3:
        _residual_store(y3, rows, rmask, b_ptr, res_ptr + 3 * sres, HAS_BIAS)
    if ROWS > 4:
        _residual_store(y4, rows, rmask, b_ptr, res_ptr + 4 * sres, HAS_BIAS)


@triton.jit
def _silu_store(g, u, rows_g, rows_u, ok, b_ptr, out_ptr, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        g += tl.load(b_ptr + rows_g, mask=ok, other=0.0).to(tl.float32)
        u += tl.load(b_ptr + rows_u, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    gf = g.to(dt).to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(dt)
    out = (s.to(tl.float32) * u.to(dt).to(tl.float32)).to(dt)
    tl.store(out_ptr + rows_g, out, mask=ok)


@triton.jit
def _norm_gate_up_silu_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, I, K, eps, sx, so, HAS_BIAS: tl.constexpr,
                              BJ: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
                              K_POW2: tl.constexpr, PDL: tl.constexpr, ROWS: tl.constexpr,
                              PACK: tl.constexpr):
    rows_g = tl.program_id(0) * BJ + tl.arange(0, BJ)
    rows_u = rows_g + I
    ok = rows_g < I
    g0, g1, g2, g3, g4, u0, u1, u2, u3, u4 = _gemv2(w_ptr, rows_g, rows_u, ok, x_ptr, nw_ptr, K, eps, sx, BJ,
                                                    BLOCK_K, PREFETCH, K_POW2, PDL, ROWS, PACK)
    _silu_store(g0, u0, rows_g, rows_u, ok, b_ptr, out_ptr, HAS_BIAS)
    if ROWS > 1:
        _silu_store(g1, u1, rows_g, rows_u, ok, b_ptr, out_ptr + so, HAS_BIAS)
    if ROWS > 2:
        _silu_store(g2, u2, rows_g, rows_u, ok, b_ptr, out_ptr + 2 * so, HAS_BIAS)
    if ROWS > 3:
        _silu_store(g3, u3, rows_g, rows_u, ok, b_ptr, out_ptr + 3 * so, HAS_BIAS)
    if ROWS > 4:
        _silu_store(g4, u4, rows_g, rows_u, ok, b_ptr, out_ptr + 4 * so, HAS_BIAS)


@triton.jit
def _norm_gemv_kernel(x_ptr, nw_ptr, w_ptr, out_ptr, key_ptr, N, K, eps, sx, so, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, K_POW2: tl.constexpr, PDL: tl.constexpr,
                      ARGMAX: tl.constexpr, ROWS: tl.constexpr, PACK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    y0, y1, y2, y3, y4 = _gemv1(w_ptr, rows, rmask, x_ptr, nw_ptr, K, eps, sx, True, BLOCK_N, BLOCK_K, PREFETCH,
                                K_POW2, PDL, ROWS, PACK)
    dt = x_ptr.dtype.element_ty
    logits = y0.to(dt).to(tl.float32)
    tl.store(out_ptr + rows, logits, mask=rmask)
    if ROWS > 1:
        tl.store(out_ptr + so + rows, y1.to(dt).to(tl.float32), mask=rmask)
    if ROWS > 2:
        tl.store(out_ptr + 2 * so + rows, y2.to(dt).to(tl.float32), mask=rmask)
    if ROWS > 3:
        tl.store(out_ptr + 3 * so + rows, y3.to(dt).to(tl.float32), mask=rmask)
    if ROWS > 4:
        tl.store(out_ptr + 4 * so + rows, y4.to(dt).to(tl.float32), mask=rmask)
    if ARGMAX:  # this program's best (value, first row) as one key (greedy_advance takes the largest); ROWS = 1
        v = tl.where(rmask, logits, float("-inf"))
        best = tl.max(v, axis=0)
        row = tl.min(tl.where(v == best, rows, N), axis=0)  # the first row holding the maximum
        tl.store(key_ptr + tl.program_id(0), _argmax_key(best, row))


@triton.jit
def _argmax_key(value, row):
    """An int64 that orders (value, -row) as a signed integer: the float's bits made monotonic (negative floats
    inverted, positive ones with the sign bit set) in the high 32 bits, 2^32 - 1 - row in the low ones. The
    largest key is the largest value at its first row: torch.argmax's answer for finite values."""
    bits = value.to(tl.uint32, bitcast=True)
    ordered = tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)
    high = ordered.to(tl.int64) - 2147483648
    return high * 4294967296 + (4294967295 - row.to(tl.int64))


@triton.jit
def _greedy_advance_kernel(key_ptr, num_keys, token_ptr, start_ptr, seq_ptr, ring_ptr, empty,
                           PDL: tl.constexpr, RING: tl.constexpr, KEYS_POW2: tl.constexpr):
    pdl_wait(PDL)
    slots = tl.arange(0, KEYS_POW2)
    key = tl.max(tl.load(key_ptr + slots, mask=slots < num_keys, other=empty), axis=0)
    row = 4294967295 - (key & 4294967295)
    tl.store(token_ptr, row.to(tl.int64))
    tl.store(start_ptr, tl.load(start_ptr) + 1)
    if RING > 0:  # (step number mod 2^31, token) in one 8-byte store: a reader never sees half of it
        seq = tl.load(seq_ptr) + 1
        tl.store(seq_ptr, seq)
        tl.store(ring_ptr + seq % RING, (seq & 2147483647) * 4294967296 + row, cache_modifier=".wt")


# ---------------------------------------------------------------------------------------------- launchers

_PICKED: dict[tuple, tuple[int, ...]] = {}
TUNING_LOG: list[dict] = []  # what pick_config measured (the GPU bench writes it out)


@dataclasses.dataclass
class TimedPick:
    """A pick pick_config timed: each candidate's one-row time alone (`one_row`, ms), its TUNING_LOG entry, and
    `compile(cfg, r)` where the launcher gave one. models/step_tune.py re-decides it by timing the whole step
    (`repick`)."""

    key: tuple
    rows: int
    one_row: dict
    log: dict
    compile: object = None
    step_timed: bool = False  # models/step_tune.py has re-decided it

    @property
    def picked(self) -> tuple[int, ...]:
        return _PICKED[self.key]


#: The picks timed in this process, in the order the step asked for them (models/step_tune.py reads them).
TIMED_PICKS: dict[tuple, TimedPick] = {}


def repick(pick: TimedPick, cfg: tuple[int, ...], compile: bool = True) -> None:
    """Make `cfg` (one of the pick's timed candidates) the block shape of its kernel from now on; with
    `compile`, the kernels of every row count a verify runs are compiled first where the launcher says how
    (the one-row and the `rows`-row kernels of a timed candidate are compiled already). A CUDA graph captured
    before keeps the shape it was captured with."""
    if cfg not in pick.one_row:
        raise ValueError(f"{_label(cfg)} was not a timed candidate of {pick.log['kernel']}")
    if compile and pick.compile is not None and pick.rows > 2:
        precompile([functools.partial(pick.compile, cfg, r) for r in range(2, pick.rows)])
    _PICKED[pick.key] = cfg
    pick.log["best"] = list(cfg)


class PickStats:
    """The timed picks of this process: how many, and the seconds their timing took (compiles not included:
    precompile.STATS counts those)."""

    def __init__(self) -> None:
        self.picks = 0
        self.timing_s = 0.0

    def as_dict(self) -> dict:
        return {"picks": self.picks, "timing_s": round(self.timing_s, 3)}


PICK_STATS = PickStats()


def _warps(cfg: tuple[int, ...]) -> int:
    return cfg[3] if len(cfg) > 3 else 4


def _pack(cfg: tuple[int, ...]) -> int:
    return cfg[4] if len(cfg) > 4 else 0


def _label(cfg: tuple[int, ...]) -> str:
    return (f"{cfg[0]}x{cfg[1]}" + ("p" if cfg[2] else "") + (f"w{_warps(cfg)}" if _warps(cfg) != 4 else "")
            + (f"s{_pack(cfg)}" if _pack(cfg) else ""))


def _fits(cfg: tuple[int, ...], k: int, max_block_rows: int | None) -> bool:
    rows, block_k = cfg[0], cfg[1]
    return (max_block_rows is None or rows <= max_block_rows) and block_k <= max(16, triton.next_power_of_2(k))


def _launch(kernel, grid, compile_only: bool, *args, **kwargs):
    """kernel[grid](*args, **kwargs), or with compile_only its compiled kernel for those arguments, not run."""
    if compile_only:
        return kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid](*args, **kwargs)


def spilled_bytes(compiled) -> int:
    """Bytes a thread of a compiled Triton kernel keeps in local memory (its spills; the module is loaded to
    read it); a kernel this device cannot run at all (too much shared memory, too many threads) counts as
    spilling everything."""
    try:
        compiled._init_handles()
    except OutOfResources:
        return 1 << 30
    return int(compiled.n_spills)


def least_spilling(candidates, spills) -> tuple[list, dict]:
    """(the candidates that spill the fewest bytes: those that spill none wherever one does not, the bytes each
    candidate spills); spills(cfg) -> bytes."""
    spilled = {c: spills(c) for c in candidates}
    fewest = min(spilled.values())
    return [c for c in candidates if spilled[c] == fewest], spilled


def _pick_key(name: str, n: int, k: int, rows: int, device: torch.device | None,
              dtype: torch.dtype | None) -> tuple:
    # dtype: the weights' (a block shape's shared memory for its stages scales with the element size, so a
    # float32 kernel with the bf16 pick's stages may not fit the device: OutOfResources on the H100, 2026-12-05)
    return (name, n, k, rows, str(device), use_pdl(device) if device is not None else False, dtype)


def picked_config(name: str, n: int, k: int, rows: int, device: torch.device | None,
                  dtype: torch.dtype | None = None) -> tuple[int, ...] | None:
    """The block shape pick_config already picked for (name, n, k, rows) and dtype on this device, None if none
    yet."""
    return _PICKED.get(_pick_key(name, n, k, rows, device, dtype))


#: A verifying step's pick: among the block shapes whose one-row time is within this fraction of the fastest one-row
#: time, the one fastest at the step's most rows (a plain step stays within 2 % of the fastest shape that does not
#: spill; the verify gets the shape that suits it).
ONE_ROW_SLACK = 0.02


def verify_pick(one_row: dict, time_rows) -> tuple[tuple[int, ...], dict]:
    """(the pick of a verifying step, the `rows`-row times it measured): of the block shapes whose one-row time
    (`one_row`: shape -> time) is within ONE_ROW_SLACK of the fastest, the fastest by `time_rows(shape)` (each
    timed twice, the better kept); the fastest one-row shape where no other is that close."""
    fastest = min(one_row, key=one_row.get)
    close = [c for c in one_row if one_row[c] <= one_row[fastest] * (1 + ONE_ROW_SLACK)]
    if len(close) == 1:
        return fastest, {}
    times: dict[tuple[int, ...], float] = {}
    for _ in range(2):
        for cfg in close:
            t = time_rows(cfg)
            times[cfg] = min(t, times.get(cfg, t))
    return min(times, key=times.get), times


def pick_config(name: str, n: int, k: int, candidates, launch, max_block_rows: int | None = None,
                restore: torch.Tensor | None = None, device: torch.device | None = None,
                config: tuple[int, ...] | None = None, rows: int = 1, spills=None,
                compile=None, dtype: torch.dtype | None = None, many=None) -> tuple[int, ...]:
    """The fastest candidate for (name, n, k) and the weights' dtype on this device, timed once (`launch(cfg)`
    runs the kernel);
    `restore`: a tensor the kernel updates in place, put back after the timing runs; `config`: use this one.

    rows: the most rows the step that asks runs (a lean step that also verifies: 1 + the drafts). Its T = 1
    launches and its verify must run one block shape (that is what makes a verify row the T = 1 step's bits),
    so with rows > 1 on a GPU only the candidates whose `rows`-row kernel does not spill are timed
    (`spills(cfg)`: the bytes that kernel spills). Each row keeps its own accumulators, so a large tile times
    five rows no longer fits the registers: on the H200 the 8B's verify of five rows took 2.96x the one-row
    step with the one-row picks, whose five-row kernels spilled 2.5-4.6 KB a thread
    (docs/bench/2026-12-04-row-invariant-verify). The fastest of the rest is then picked by one-row timing, or,
    given `many(cfg)` (the `rows`-row kernel run on scratch buffers), by its `rows`-row timing among those within
    ONE_ROW_SLACK of the fastest one-row time.

    The pick is kept in TIMED_PICKS with every candidate's time: the engine's warm-up re-decides it among the
    close candidates by timing the whole step (models/step_tune.py), which this timing of one kernel alone
    cannot stand in for.

    compile(cfg, r): compile (not run) cfg's kernel of r rows. Given, the kernels the pick reads are compiled in
    parallel first (models/precompile.py): the `rows`-row kernels the spill check loads, then the one-row
    kernels it times, then the picked shape's kernels of the row counts in between (the verify's graphs)."""
    if config is not None:
        return config
    key = _pick_key(name, n, k, rows, device, dtype)
    if key in _PICKED:
        return _PICKED[key]
    fitting = [c for c in candidates if _fits(c, k, max_block_rows)] or [min(candidates)]
    if device is None or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        _PICKED[key] = fitting[0]
        return fitting[0]
    spilled = {}
    if rows > 1 and spills is not None:
        if compile is not None:
            precompile([functools.partial(compile, c, rows) for c in fitting])
        fitting, spilled = least_spilling(fitting, spills)
    if compile is not None:
        precompile([functools.partial(compile, c, 1) for c in fitting])
    t0 = time.perf_counter()
    saved = restore.clone() if restore is not None else None
    times: dict[tuple[int, ...], float] = {}
    # Two rounds over the candidates, each one's best: one round once timed every candidate of the 8B's
    # o_proj 60 % slow and picked a worse shape (docs/bench/2026-12-02-gpu-pdl-argmax/, run 7).
    for _ in range(2):
        for cfg in fitting:
            t = triton.testing.do_bench(lambda: launch(cfg), warmup=5, rep=20, return_mode="median")
            times[cfg] = min(t, times.get(cfg, t))
    if saved is not None:
        restore.copy_(saved)
    best = min(times, key=times.get)
    times_many: dict[tuple[int, ...], float] = {}
    if rows > 1 and many is not None:
        best, times_many = verify_pick(
            times, lambda cfg: triton.testing.do_bench(lambda: many(cfg), warmup=5, rep=20, return_mode="median"))
    PICK_STATS.picks += 1
    PICK_STATS.timing_s += time.perf_counter() - t0
    TUNING_LOG.append({"kernel": name, "n": n, "k": k, "rows": rows, "best": list(best),
                       "us": {_label(c): round(1e3 * t, 2) for c, t in times.items()},
                       "us_rows": {_label(c): round(1e3 * t, 2) for c, t in times_many.items()},
                       "spilled": {_label(c): b for c, b in spilled.items()}})
    _PICKED[key] = best
    TIMED_PICKS[key] = TimedPick(key, rows, times, TUNING_LOG[-1], compile)
    if compile is not None:  # the verify's row counts, before their graphs are captured one by one
        precompile([functools.partial(compile, best, r) for r in range(2, rows)])
    return best


def _spills(launch, rows: int):
    """pick_config's `spills` for a launcher's `launch(cfg, rows=..., compile_only=...)`: the bytes the kernel of
    `rows` rows spills with a block shape (compiled, not run; the inputs' types are the call's)."""
    if rows <= 1:
        return None
    return lambda cfg: spilled_bytes(launch(cfg, rows=rows, compile_only=True))


def _compiles(launch, one):
    """pick_config's `compile` for a launcher: cfg's kernel of r rows compiled, not run (one row: the launch the
    pick times, `one`; more: the launcher's own arguments, as `_spills` compiles them)."""
    return lambda cfg, r: one(cfg, compile_only=True) if r == 1 else launch(cfg, rows=r, compile_only=True)


def _rows(x: torch.Tensor) -> tuple[int, int]:
    """(rows, row stride) of a kernel input: [K] is one row, [R, K] (contiguous rows) R <= MAX_ROWS rows."""
    if x.dim() == 1:
        return 1, 0
    if not 1 <= x.shape[0] <= MAX_ROWS or x.stride(-1) != 1:
        raise ValueError(f"the fused kernels take 1..{MAX_ROWS} contiguous rows, got shape {tuple(x.shape)}")
    return x.shape[0], x.stride(0)


def _first(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 1 else x[0]


def _stride(x: torch.Tensor) -> int:
    return x.stride(0) if x.dim() > 1 else 0


def _many(launch, rows: int, make):
    """pick_config's `many` for a launcher: its `rows`-row kernel run over scratch buffers, `make()` -> the
    launch's tensor arguments, made at the first timing (a verify's buffers need not exist when a step's first
    one-row launch picks; the step's own are never written)."""
    if rows <= 1:
        return None
    bufs: dict = {}

    def many(cfg):
        if not bufs:
            bufs.update(make())
        return launch(cfg, rows=rows, **bufs)
    return many


def _rows_of(t: torch.Tensor, rows: int, dtype=None) -> torch.Tensor:
    """A scratch [rows, ...] tensor: row 0 of `t` in every row."""
    one = _first(t)
    return one.expand(rows, *one.shape).contiguous().to(dtype or one.dtype)


def norm_qkv_rope(x, norm_w, eps, w, b, cos, sin, start, q_out, k_cache, v_cache, num_heads, num_kv_heads,
                  head_dim, config=None, max_rows=None, compile_only=False):
    """x [K] residual (or [R, K]: R rows, row r the token at start + r); w [(NH + 2 NKV) * D, K]; writes q_out
    [NH * D] (or [R, NH * D]) and k_cache/v_cache[start + r] (caches [S, NKV, D]); cos/sin: rope.py's tables
    [S, D]; start: [1] long on the device. Row r's results are bit-identical to a one-row launch at start + r.
    max_rows (every launcher): the most rows the calling step runs (pick_config's `rows`; default: x's);
    compile_only (every launcher): compile the kernel these arguments launch and return it, do not run it (a
    probe's parallel compile)."""
    k = x.shape[-1]
    half = head_dim // 2
    heads = num_heads + 2 * num_kv_heads
    rows, _ = _rows(x)
    pdl = use_pdl(x.device)

    def launch(cfg, x=x, q_out=q_out, rows=rows, compile_only=False, k_cache=k_cache, v_cache=v_cache, start=start):
        bj, bk, pre = cfg[:3]
        return _launch(
            _norm_qkv_rope_kernel, (heads * (half // bj),), compile_only, x, norm_w, w, b if b is not None else w,
            cos, sin, start, q_out, k_cache, v_cache, k, eps, _stride(x), _stride(q_out),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            NH=num_heads, NKV=num_kv_heads, D=head_dim, HAS_BIAS=b is not None, BJ=bj, BLOCK_K=bk, PREFETCH=pre,
            K_POW2=triton.next_power_of_2(k), PDL=pdl, ROWS=rows, PACK=_pack(cfg), num_warps=_warps(cfg),
            launch_pdl=pdl)

    cands = [c for c in PAIR_CONFIGS if half % c[0] == 0] or [(1, 2048, 0)]
    # The block shape is the one-row step's (timed one row at a time): the rows of a verify must run the T = 1
    # step's shapes to give its bits.
    one = lambda cfg, compile_only=False: launch(cfg, _first(x), _first(q_out), 1, compile_only)  # noqa: E731
    most = max_rows or rows
    scratch = lambda: dict(x=_rows_of(x, most), q_out=_rows_of(q_out, most),  # noqa: E731
                           k_cache=k_cache.new_empty((most,) + tuple(k_cache.shape[1:])),
                           v_cache=v_cache.new_empty((most,) + tuple(v_cache.shape[1:])), start=start.new_zeros(1))
    return launch(pick_config("norm_qkv_rope", w.shape[0], k, cands, one, max_block_rows=half, device=x.device,
                              config=config, rows=most, spills=_spills(launch, most),
                              compile=_compiles(launch, one), dtype=w.dtype, many=_many(launch, most, scratch)),
                  compile_only=compile_only)


def gemv_residual(a, w, b, residual, config=None, max_rows=None, compile_only=False):
    """residual [N] += (w [N, K] @ a [K] + b), rounded as the PyTorch step rounds, in place; a [R, K] and
    residual [R, N]: each row so, row r bit-identical to a one-row launch."""
    n, k = w.shape
    rows, _ = _rows(a)
    pdl = use_pdl(a.device)

    def launch(cfg, a=a, residual=residual, rows=rows, compile_only=False):
        bn, bk, pre = cfg[:3]
        return _launch(_gemv_residual_kernel, (triton.cdiv(n, bn),), compile_only, a, w,
                       b if b is not None else w, residual, n, k, _stride(a), _stride(residual),
                       HAS_BIAS=b is not None, BLOCK_N=bn,
                       BLOCK_K=bk, PREFETCH=pre, PDL=pdl, ROWS=rows, PACK=_pack(cfg), num_warps=_warps(cfg),
                       launch_pdl=pdl)

    one = lambda cfg, compile_only=False: launch(cfg, _first(a), _first(residual), 1, compile_only)  # noqa: E731
    most = max_rows or rows
    scratch = lambda: dict(a=_rows_of(a, most), residual=_rows_of(residual, most))  # noqa: E731
    return launch(pick_config("gemv_residual", n, k, GEMV_CONFIGS, one, restore=_first(residual), device=a.device,
                              config=config, rows=most, spills=_spills(launch, most),
                              compile=_compiles(launch, one), dtype=w.dtype, many=_many(launch, most, scratch)),
                  compile_only=compile_only)


def norm_gate_up_silu(x, norm_w, eps, w, b, out, config=None, max_rows=None, compile_only=False):
    """out [I] = silu(gate) * up of gate_up_proj (w [2I, K], gate rows first) over RMSNorm(x); x [R, K] and
    out [R, I]: each row so, row r bit-identical to a one-row launch."""
    i2, k = w.shape
    i = i2 // 2
    rows, _ = _rows(x)
    pdl = use_pdl(x.device)

    def launch(cfg, x=x, out=out, rows=rows, compile_only=False):
        bj, bk, pre = cfg[:3]
        return _launch(_norm_gate_up_silu_kernel, (triton.cdiv(i, bj),), compile_only, x, norm_w, w,
                       b if b is not None else w, out, i, k, eps, _stride(x), _stride(out), HAS_BIAS=b is not None,
                       BJ=bj,
                       BLOCK_K=bk, PREFETCH=pre, K_POW2=triton.next_power_of_2(k), PDL=pdl, ROWS=rows,
                       PACK=_pack(cfg), num_warps=_warps(cfg), launch_pdl=pdl)

    one = lambda cfg, compile_only=False: launch(cfg, _first(x), _first(out), 1, compile_only)  # noqa: E731
    most = max_rows or rows
    scratch = lambda: dict(x=_rows_of(x, most), out=_rows_of(out, most))  # noqa: E731
    return launch(pick_config("norm_gate_up_silu", i2, k, PAIR_CONFIGS, one, device=x.device, config=config,
                              rows=most, spills=_spills(launch, most), compile=_compiles(launch, one),
                              dtype=w.dtype, many=_many(launch, most, scratch)), compile_only=compile_only)


#: Below every key _argmax_key makes (the masked lanes of greedy_advance's maximum).
ARGMAX_KEY_EMPTY = -(2**63)


def new_argmax_keys(n: int, device) -> torch.Tensor:
    """The int64 keys a greedy step's lm_head of n rows writes, one a program (norm_gemv(argmax_keys=...)):
    room for the most programs any block shape launches. Atomics on one key instead made the H200's lm_head
    43 us slower (16k programs; docs/bench/2026-12-02-gpu-pdl-argmax/run6-greedy-profile.jsonl)."""
    fewest_rows = min(c[0] for c in GEMV_CONFIGS)
    return torch.full((triton.cdiv(n, fewest_rows),), ARGMAX_KEY_EMPTY, dtype=torch.int64, device=device)


def norm_gemv(x, norm_w, eps, w, out, config=None, argmax_keys=None, max_rows=None, compile_only=False) -> int:
    """out [N] float32 = (w [N, K] @ RMSNorm(x)) rounded to the model dtype (the lm_head); x [R, K] and out
    [R, N]: each row so, row r bit-identical to a one-row launch. argmax_keys (one row only): each program also
    writes its best (value, first row) as one key (new_argmax_keys; greedy_advance takes the largest). Returns
    the number of programs launched (the keys written)."""
    n, k = w.shape
    rows, _ = _rows(x)
    if argmax_keys is not None and rows != 1:
        raise ValueError("the folded argmax takes one row")
    pdl = use_pdl(x.device)

    def launch(cfg, keys=None, x=x, out=out, rows=rows, compile_only=False):
        bn, bk, pre = cfg[:3]
        return _launch(_norm_gemv_kernel, (triton.cdiv(n, bn),), compile_only, x, norm_w, w, out,
                       keys if keys is not None else out, n, k, eps, _stride(x), _stride(out), BLOCK_N=bn,
                       BLOCK_K=bk, PREFETCH=pre,
                       K_POW2=triton.next_power_of_2(k), PDL=pdl, ARGMAX=keys is not None, ROWS=rows,
                       PACK=_pack(cfg), num_warps=_warps(cfg), launch_pdl=pdl)

    # The block shape is timed on one row without the argmax (one pick for all: the epilogue is a few
    # instructions, and a verify's rows must run the T = 1 step's shapes to give its bits).
    one = lambda cfg, compile_only=False: launch(cfg, None, _first(x), _first(out), 1, compile_only)  # noqa: E731
    most = max_rows or rows
    scratch = lambda: dict(x=_rows_of(x, most), out=_rows_of(out, most))  # noqa: E731
    cfg = pick_config("norm_gemv", n, k, GEMV_CONFIGS, one, device=x.device, config=config, rows=most,
                      spills=_spills(launch, most), compile=_compiles(launch, one), dtype=w.dtype,
                      many=_many(launch, most, scratch))
    launched = launch(cfg, argmax_keys, compile_only=compile_only)
    return launched if compile_only else triton.cdiv(n, cfg[0])


def greedy_advance(argmax_keys, num_keys, token, start, ring=None, seq=None):
    """token [1] long = the row of the largest of the first num_keys keys norm_gemv wrote, start [1] += 1: the
    greedy step's argmax and position advance as one kernel (decode/chain.py's greedy graph). ring, seq: also
    count the step (seq [1] int64 on the device, += 1) and write `(seq mod 2^31) * 2^32 + token` into
    ring[seq % len(ring)] (int64; pinned host memory on a GPU: the kernel's store crosses the bus, so the host
    reads the token with no copy in the stream; the step number tells a fresh slot from a stale one)."""
    pdl = use_pdl(token.device)
    _greedy_advance_kernel[(1,)](argmax_keys, num_keys, token, start, seq if seq is not None else token,
                                 ring if ring is not None else token, ARGMAX_KEY_EMPTY, PDL=pdl,
                                 RING=ring.numel() if ring is not None else 0,
                                 KEYS_POW2=triton.next_power_of_2(num_keys),
                                 num_warps=16 if num_keys > 4096 else 4, launch_pdl=pdl)


def ring_entry(value: int) -> tuple[int, int]:
    """A ring slot's (step number mod 2^31, token); (-1, -1) for a slot never written."""
    if value < 0:
        return -1, -1
    return value >> 32, value & 0xFFFFFFFF
