"""The lean step's GEMVs on the tensor cores: the kernel family of a speculating engine (models/lean.py).

models/fused.py's kernels multiply on the CUDA cores, each weight element times each row's input in float32,
which is the fastest one-row step there is but costs about one T = 1 step's compute again for every further row
of a verify (H200, 8B shape: 4.0 ms for one row, 10.1 ms for five; docs/bench/2026-12-04-row-invariant-verify).
Here every projection is one `tl.dot`, "swap AB": acc[BLOCK_N, 16] += W[BLOCK_N, BLOCK_K] @ X^T[BLOCK_K, 16], the
R <= 16 input rows zero-padded to 16 (tl.dot's smallest N). The row count is a runtime argument (never
specialised), so a T = 1 launch and a verify's launch run one binary, and a tensor-core product's output column
depends on its own input row only: row r of a verify is the T = 1 step's bits at start + r by construction
(tests/unit/engine/test_fused_kernels.py checks it with torch.equal; docs/bench/2026-12-04-tensor-core-verify/probe_verify_kernels.py on every
block shape). Measured per 8B projection on the H200 (docs/bench/2026-12-04-tensor-core-verify/): five rows
cost 1.01-1.36x one row, against 1.97-3.20x for the CUDA-core kernels; one row costs 1.03-1.23x the CUDA-core
kernels' best. So this family is the opt-in for traffic that repeats (--lean-gemv tensor-core: an engine then
runs it for every step), and `auto` keeps models/fused.py (models/lean.py says why).

The RMSNorm is its own kernel (`rms_rows`: one program a row, each row's statistic in one fixed order), whose
model-dtype output the projections read: folded into a projection, every program first walked the whole input
row for the statistic before its first weight tile arrived, about 10 us a layer at the 8B shape; with the
statistic as per-program partials left by the kernel that writes x, the 8B one-row step took 4.66 ms instead of
4.22 (docs/bench/2026-12-04-gpu-check-folded-norm/). A second placement (`gemv_residual(norm=...)`, the lean
step's `tail`): the o_proj / down_proj kernel's last program to finish (a ticket counter) normalises the residual
the kernel wrote, so no norm kernel stands between it and the next projection; its timing against the norm
kernels is docs/bench/2026-12-05-h100-gpu-check/probe_lean_norm.py's to measure. Rounding
follows models/fused.py (and so the PyTorch step) at every point: the norm's two roundings, each projection's
output, RoPE's products and sum, silu before the product with up, the residual sum. float32 models run IEEE
dots (no TF32), as the split-KV attention does.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .fused import MAX_ROWS, _argmax_key, _launch, _rounded, pick_config, picked_config, spilled_bytes
from .pdl import pdl_wait, use_pdl
from .precompile import precompile

RP = 16  # input rows a launch computes: tl.dot's smallest N; the first R of them are real
assert MAX_ROWS <= RP


def _rows(x: torch.Tensor) -> tuple[int, int]:
    """(rows, row stride) of a kernel input: [K] is one row, [R, K] (contiguous rows) R <= RP rows (a verify's,
    or a step over several users' rows: LeanStep.forward_seats)."""
    if x.dim() == 1:
        return 1, 0
    if not 1 <= x.shape[0] <= RP or x.stride(-1) != 1:
        raise ValueError(f"the tensor-core kernels take 1..{RP} contiguous rows, got shape {tuple(x.shape)}")
    return x.shape[0], x.stride(0)

# (rows per program, K per iteration, pipeline stages, warps): the shapes the H200 probe found fastest for the
# 8B and 1B projections (docs/bench/2026-12-04-tensor-core-verify/), deeper pipelines of those (added after that
# run: its winners used the most stages offered), then small ones that fit tiny models (the tests: K = 64).
DOT_CONFIGS = ((64, 256, 5, 4), (64, 128, 5, 4), (64, 128, 5, 8), (32, 256, 5, 4), (32, 256, 3, 4),
               (64, 128, 3, 8), (64, 256, 3, 4), (32, 128, 5, 4), (16, 256, 5, 4), (128, 128, 4, 8),
               (64, 128, 7, 4), (64, 128, 7, 8), (32, 256, 6, 4),
               (16, 64, 2, 4), (16, 32, 2, 4), (16, 16, 2, 4))
# (row pairs per program, K per iteration, stages, warps) for the kernels that own two row sets (2 x the rows).
DOT_PAIR_CONFIGS = ((32, 256, 5, 4), (32, 128, 5, 8), (64, 128, 3, 8), (32, 256, 3, 4), (16, 256, 5, 4),
                    (64, 128, 5, 8), (32, 128, 5, 4), (16, 128, 5, 4), (32, 128, 7, 8), (64, 128, 4, 8),
                    (16, 64, 2, 4), (16, 32, 2, 4), (16, 16, 2, 4))


@triton.jit
def _rms_row(x_ptr, nw_ptr, out_ptr, K, eps, K_POW2: tl.constexpr, FROM_L2: tl.constexpr):
    """out = RMSNorm(x) of one row in the model dtype, rounded as models/fused.py's _input_chunk rounds.
    FROM_L2: x is read past the L1 (written by other programs of the same kernel: the norm tail)."""
    cols = tl.arange(0, K_POW2)
    kmask = cols < K
    if FROM_L2:
        xv = tl.load(x_ptr + cols, mask=kmask, other=0.0, cache_modifier=".cg")
    else:
        xv = tl.load(x_ptr + cols, mask=kmask, other=0.0)
    dt = xv.dtype
    xf = xv.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / K + eps)
    xn = (xf * rstd).to(dt)
    nw = tl.load(nw_ptr + cols, mask=kmask, other=0.0)
    tl.store(out_ptr + cols, (xn.to(tl.float32) * nw.to(tl.float32)).to(dt), mask=kmask)


@triton.jit(do_not_specialize=["R"])
def _rms_rows_kernel(x_ptr, nw_ptr, out_ptr, R, K, eps, sx, so, K_POW2: tl.constexpr, PDL: tl.constexpr):
    """out[r] = RMSNorm(x[r]); one program a row, each row's statistic in the same order whatever R is."""
    pdl_wait(PDL)
    r = tl.program_id(0)
    _rms_row(x_ptr + r * sx, nw_ptr, out_ptr + r * so, K, eps, K_POW2, False)


@triton.jit
def _norm_tail(x_ptr, nw_ptr, out_ptr, ticket_ptr, R, K, eps, sx, so, K_POW2: tl.constexpr):
    """The norm tail of a kernel whose programs each wrote a slice of x's R rows: the last program to finish
    writes out[r] = RMSNorm(x[r]) for every row (`_rms_row`, row by row: row r's bits do not depend on R) and
    puts the ticket back to 0 for the next launch. The classic last-block pattern (CUDA's threadFenceReduction,
    cooperative groups' grid sync): a barrier so every thread's stores precede the program's ticket, one
    acquire-release atomic (Triton's scalar atomic: one thread, its result shared with the program), x read
    past the L1."""
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:
        for r in range(0, R):
            _rms_row(x_ptr + r * sx, nw_ptr, out_ptr + r * so, K, eps, K_POW2, True)
        tl.store(ticket_ptr, 0)


@triton.jit
def _l2_prefetch(ptrs):
    """prefetch.global.L2 of each address (no value is read; is_pure=False keeps it in the kernel)."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _weights_to_l2(w_ptr, rows, rmask, K, L2_LINES: tl.constexpr):
    """Ask for the first L2_LINES x 64 weights of each of this program's rows to be brought into the L2 (one
    prefetch a 128-byte line of bf16; every other line of float32). Issued before the PDL wait (the weights are
    constant): while the kernel before this one finishes, the first tiles the software pipeline will load come
    from HBM into the L2, with no register or shared memory held (a tile loaded into registers before the wait
    bypassed the pipeline and made the step slower: docs/bench/2026-12-04-tensor-core-verify/). Addresses are
    clamped into the weight matrix (a masked row or column prefetches row 0 / column K - 1 again)."""
    cols = tl.minimum(tl.arange(0, L2_LINES) * 64, K - 1)
    _l2_prefetch(w_ptr + tl.where(rmask, rows, 0)[:, None] * K + cols[None, :])


@triton.jit
def _dot_rows(w_ptr, rows, rmask, x_ptr, R, K, sx, acc, BLOCK_K: tl.constexpr, RP: tl.constexpr,
              STAGES: tl.constexpr, IEEE: tl.constexpr):
    """acc[BLOCK_N, RP] += w[rows, :] @ x[:RP, :]^T (x rows >= R read as zero), K in BLOCK_K steps."""
    m = tl.arange(0, RP)
    mmask = m < R
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        w = tl.load(w_ptr + rows[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        xv = tl.load(x_ptr + m[:, None] * sx + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(w, tl.trans(xv), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(xv), acc)
    return acc


@triton.jit
def _dot_rows2(w_ptr, rows_a, rows_b, rmask, x_ptr, R, K, sx, acc_a, acc_b, BLOCK_K: tl.constexpr,
               RP: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr):
    """_dot_rows for two row sets that share the input (RoPE pairs, gate and up rows)."""
    m = tl.arange(0, RP)
    mmask = m < R
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        wmask = rmask[:, None] & kmask[None, :]
        wa = tl.load(w_ptr + rows_a[:, None] * K + kk[None, :], mask=wmask, other=0.0)
        wb = tl.load(w_ptr + rows_b[:, None] * K + kk[None, :], mask=wmask, other=0.0)
        xt = tl.trans(tl.load(x_ptr + m[:, None] * sx + kk[None, :], mask=mmask[:, None] & kmask[None, :],
                              other=0.0))
        if IEEE:
            acc_a = tl.dot(wa, xt, acc_a, input_precision="ieee")
            acc_b = tl.dot(wb, xt, acc_b, input_precision="ieee")
        else:
            acc_a = tl.dot(wa, xt, acc_a)
            acc_b = tl.dot(wb, xt, acc_b)
    return acc_a, acc_b


@triton.jit(do_not_specialize=["R"])
def _qkv_rope_kernel(x_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, start_ptr, rows_ptr, q_ptr, kc_ptr, vc_ptr, R, K, sx,
                     sq, stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, NH: tl.constexpr, NKV: tl.constexpr,
                     D: tl.constexpr, HAS_BIAS: tl.constexpr, BJ: tl.constexpr, BLOCK_K: tl.constexpr,
                     RP: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                     L2_LINES: tl.constexpr, PER_ROW: tl.constexpr):
    """BJ row pairs (j, j + D/2) of the QKV projection (pairs numbered over all heads, so a program may span
    heads), their RoPE at start + r for each input row r, q out or the K/V cache rows start + r. PER_ROW (a step
    over several users' rows): row r's position is rows_ptr[r] and its cache row rows_ptr[RP + r] (its seat's
    first row plus the position); the arithmetic is the same."""
    HALF: tl.constexpr = D // 2
    PAIRS: tl.constexpr = (NH + 2 * NKV) * HALF
    p = tl.program_id(0) * BJ + tl.arange(0, BJ)
    ok = p < PAIRS
    head = p // HALF
    j = p % HALF
    rows_a = head * D + j
    rows_b = rows_a + HALF
    if PDL and L2_LINES > 0:
        _weights_to_l2(w_ptr, rows_a, ok, K, L2_LINES)
        _weights_to_l2(w_ptr, rows_b, ok, K, L2_LINES)
    pdl_wait(PDL)
    a = tl.zeros([BJ, RP], tl.float32)
    b = tl.zeros([BJ, RP], tl.float32)
    a, b = _dot_rows2(w_ptr, rows_a, rows_b, ok, x_ptr, R, K, sx, a, b, BLOCK_K, RP, STAGES, IEEE)
    if HAS_BIAS:
        a += tl.load(b_ptr + rows_a, mask=ok, other=0.0).to(tl.float32)[:, None]
        b += tl.load(b_ptr + rows_b, mask=ok, other=0.0).to(tl.float32)[:, None]
    dt = q_ptr.dtype.element_ty
    a = a.to(dt).to(tl.float32)
    b = b.to(dt).to(tl.float32)
    m = tl.arange(0, RP)
    if PER_ROW:
        pos = tl.load(rows_ptr + m, mask=m < R, other=0)
        crow = tl.load(rows_ptr + RP + m, mask=m < R, other=0)
    else:
        pos = tl.load(start_ptr) + m  # input row r is the token at start + r
        crow = pos
    live = ok[:, None] & (m < R)[None, :]
    rot = live & (head < NH + NKV)[:, None]
    cpos = pos[None, :] * D + j[:, None]
    cos_a = tl.load(cos_ptr + cpos, mask=rot, other=0.0).to(tl.float32)
    cos_b = tl.load(cos_ptr + cpos + HALF, mask=rot, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_ptr + cpos, mask=rot, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_ptr + cpos + HALF, mask=rot, other=0.0).to(tl.float32)
    ra = (_rounded(a * cos_a, dt) + _rounded(b * sin_a, dt)).to(dt)
    rb = (_rounded(b * cos_b, dt) + _rounded(a * sin_b, dt)).to(dt)
    is_q = live & (head < NH)[:, None]
    tl.store(q_ptr + m[None, :] * sq + rows_a[:, None], ra, mask=is_q)
    tl.store(q_ptr + m[None, :] * sq + rows_b[:, None], rb, mask=is_q)
    is_k = live & ((head >= NH) & (head < NH + NKV))[:, None]
    kp = kc_ptr + crow[None, :] * stride_kc_s + (head - NH)[:, None] * stride_kc_h + j[:, None]
    tl.store(kp, ra, mask=is_k)
    tl.store(kp + HALF, rb, mask=is_k)
    is_v = live & (head >= NH + NKV)[:, None]
    vp = vc_ptr + crow[None, :] * stride_vc_s + (head - NH - NKV)[:, None] * stride_vc_h + j[:, None]
    tl.store(vp, a.to(dt), mask=is_v)
    tl.store(vp + HALF, b.to(dt), mask=is_v)


@triton.jit(do_not_specialize=["R"])
def _gemv_residual_kernel(a_ptr, w_ptr, b_ptr, res_ptr, nw_ptr, xn_ptr, ticket_ptr, R, N, K, sa, sres, sxn, eps,
                          HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RP: tl.constexpr,
                          STAGES: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr,
                          N_POW2: tl.constexpr, L2_LINES: tl.constexpr):
    """res[r] += a[r] @ W^T (+ bias), rounded as the residual sum rounds; NORM: then the next layer norm of the
    new residual into xn (`_norm_tail`: the last program to finish), so no norm kernel runs between this one
    and the projection that reads xn."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    if PDL and L2_LINES > 0:
        _weights_to_l2(w_ptr, rows, rmask, K, L2_LINES)
    pdl_wait(PDL)
    y = _dot_rows(w_ptr, rows, rmask, a_ptr, R, K, sa, tl.zeros([BLOCK_N, RP], tl.float32), BLOCK_K, RP, STAGES,
                  IEEE)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    m = tl.arange(0, RP)
    live = rmask[:, None] & (m < R)[None, :]
    ptrs = res_ptr + m[None, :] * sres + rows[:, None]
    res = tl.load(ptrs, mask=live, other=0.0)
    dt = res.dtype
    tl.store(ptrs, (res.to(tl.float32) + y.to(dt).to(tl.float32)).to(dt), mask=live)
    if NORM:
        _norm_tail(res_ptr, nw_ptr, xn_ptr, ticket_ptr, R, N, eps, sres, sxn, N_POW2)


@triton.jit(do_not_specialize=["R"])
def _gate_up_silu_kernel(x_ptr, w_ptr, b_ptr, out_ptr, R, I, K, sx, so, HAS_BIAS: tl.constexpr, BJ: tl.constexpr,
                         BLOCK_K: tl.constexpr, RP: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr,
                         PDL: tl.constexpr, L2_LINES: tl.constexpr):
    rows_g = tl.program_id(0) * BJ + tl.arange(0, BJ)
    rows_u = rows_g + I
    ok = rows_g < I
    if PDL and L2_LINES > 0:
        _weights_to_l2(w_ptr, rows_g, ok, K, L2_LINES)
        _weights_to_l2(w_ptr, rows_u, ok, K, L2_LINES)
    pdl_wait(PDL)
    g = tl.zeros([BJ, RP], tl.float32)
    u = tl.zeros([BJ, RP], tl.float32)
    g, u = _dot_rows2(w_ptr, rows_g, rows_u, ok, x_ptr, R, K, sx, g, u, BLOCK_K, RP, STAGES, IEEE)
    if HAS_BIAS:
        g += tl.load(b_ptr + rows_g, mask=ok, other=0.0).to(tl.float32)[:, None]
        u += tl.load(b_ptr + rows_u, mask=ok, other=0.0).to(tl.float32)[:, None]
    dt = out_ptr.dtype.element_ty
    gf = g.to(dt).to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(dt)
    out = (s.to(tl.float32) * u.to(dt).to(tl.float32)).to(dt)
    m = tl.arange(0, RP)
    tl.store(out_ptr + m[None, :] * so + rows_g[:, None], out, mask=ok[:, None] & (m < R)[None, :])


@triton.jit(do_not_specialize=["R"])
def _gemv_kernel(x_ptr, w_ptr, out_ptr, key_ptr, R, N, K, sx, so, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 RP: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                 ARGMAX: tl.constexpr, L2_LINES: tl.constexpr):
    """The lm_head: float32 logits (rounded to the model dtype); ARGMAX: also row 0's best (value, first row) of
    this program as one key (models/fused.py's greedy_advance takes the largest)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    if PDL and L2_LINES > 0:
        _weights_to_l2(w_ptr, rows, rmask, K, L2_LINES)
    pdl_wait(PDL)
    y = _dot_rows(w_ptr, rows, rmask, x_ptr, R, K, sx, tl.zeros([BLOCK_N, RP], tl.float32), BLOCK_K, RP, STAGES,
                  IEEE)
    dt = x_ptr.dtype.element_ty
    logits = y.to(dt).to(tl.float32)
    m = tl.arange(0, RP)
    tl.store(out_ptr + m[None, :] * so + rows[:, None], logits, mask=rmask[:, None] & (m < R)[None, :])
    if ARGMAX:  # row 0's logits of this program (a max over one real value and -inf: exact)
        v = tl.max(tl.where((m == 0)[None, :] & rmask[:, None], logits, float("-inf")), axis=1)
        best = tl.max(v, axis=0)
        row = tl.min(tl.where(v == best, rows, N), axis=0)
        tl.store(key_ptr + tl.program_id(0), _argmax_key(best, row))


# ---------------------------------------------------------------------------------------------- launchers


def _fits(cfg, k: int, max_block_rows: int | None) -> bool:
    return (max_block_rows is None or cfg[0] <= max_block_rows) and cfg[1] <= max(16, triton.next_power_of_2(k))


def _runnable(launch):
    """pick_config's filter: a block shape whose kernel this device cannot run (shared memory for its stages:
    fused.spilled_bytes counts it as spilling everything) is never timed (compiled, not run)."""
    return lambda cfg: spilled_bytes(launch(cfg, compile_only=True)) < 1 << 30


def _pick(name, n, k, cands, launch, device, config, dtype, max_block_rows=None, restore=None):
    """One block shape for every row count (the row-invariant verify), timed on one row (the steps that do not
    verify must be fast; five rows cost about what one does here). Picked once per (kernel, N, K) and device:
    the candidates are compiled in parallel first (models/precompile.py; the row count is not specialised, so
    one binary serves every row count), then loaded to drop those this device cannot run, then timed. dtype: the
    weights' (a pick is kept per dtype: fused._pick_key)."""
    if config is not None:
        return config
    picked = picked_config("dot_" + name, n, k, 1, device, dtype)
    if picked is not None:
        return picked
    fitting = [c for c in cands if _fits(c, k, max_block_rows)] or [min(cands)]
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        precompile([functools.partial(launch, c, compile_only=True) for c in fitting])
        runs = _runnable(launch)
        fitting = [c for c in fitting if runs(c)] or fitting[-1:]
    return pick_config("dot_" + name, n, k, fitting, lambda c: launch(c, rows=1), device=device, restore=restore,
                       dtype=dtype)


def _ieee(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32


def l2_lines(cfg, on: bool) -> int:
    """L2_LINES for a block shape: the lines (of 64 weights) of the first STAGES - 1 tiles a row, what the
    pipeline's prologue loads first, rounded down to a power of two (tl.arange's); 0 where `on` is False."""
    if not on:
        return 0
    lines = max(1, (cfg[2] - 1) * cfg[1] // 64)
    return 1 << (lines.bit_length() - 1)


def _name(name: str, l2: bool) -> str:
    """The picker's key for a kernel variant (a variant's picks are timed and kept apart)."""
    return name + ("_l2" if l2 else "")


def rms_rows(x, norm_w, eps, out):
    """out [R, K] = RMSNorm(x [R, K]) in the model dtype (x [K] / out [K]: one row)."""
    rows, sx = _rows(x)
    k = x.shape[-1]
    so = out.stride(0) if out.dim() > 1 else 0
    pdl = use_pdl(x.device)
    _rms_rows_kernel[(rows,)](x, norm_w, out, rows, k, eps, sx, so, K_POW2=triton.next_power_of_2(k), PDL=pdl,
                              num_warps=4 if k <= 4096 else 8, launch_pdl=pdl)


def qkv_rope(xn, w, b, cos, sin, start, q_out, k_cache, v_cache, num_heads, num_kv_heads, head_dim, config=None,
             l2=False, rows=None):
    """fused.norm_qkv_rope over an input normalised by rms_rows (xn [R, K] or [K]). l2: the first tiles'
    weights are prefetched into the L2 before the PDL wait (`_weights_to_l2`; only where PDL is on). rows: a step
    over several users' rows: a [2 * RP] long device tensor, each row's position then its cache row (`start` is
    not read)."""
    k = xn.shape[-1]
    per_row = rows
    if per_row is not None and (per_row.numel() != 2 * RP or per_row.dtype != torch.long):
        raise ValueError(f"rows: a [2 * {RP}] long tensor (positions, then cache rows), got {tuple(per_row.shape)}")
    rows, sx = _rows(xn)
    sq = q_out.stride(0) if q_out.dim() > 1 else 0
    pairs = (num_heads + 2 * num_kv_heads) * (head_dim // 2)
    pdl = use_pdl(xn.device)

    def launch(cfg, rows=rows, compile_only=False):
        bj, bk, stages, warps = cfg
        grid = (triton.cdiv(pairs, bj),)
        args = (xn, w, b if b is not None else w, cos, sin, start, start if per_row is None else per_row, q_out,
                k_cache, v_cache, rows, k, sx, sq, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
                v_cache.stride(1))
        kw = dict(NH=num_heads, NKV=num_kv_heads, D=head_dim, HAS_BIAS=b is not None, BJ=bj, BLOCK_K=bk, RP=RP,
                  STAGES=stages, IEEE=_ieee(xn), PDL=pdl, L2_LINES=l2_lines(cfg, l2), PER_ROW=per_row is not None,
                  num_warps=warps, launch_pdl=pdl)
        return _launch(_qkv_rope_kernel, grid, compile_only, *args, **kw)

    launch(_pick(_name("qkv_rope", l2), pairs * 2, k, DOT_PAIR_CONFIGS, launch, xn.device, config, w.dtype))


def new_ticket(device) -> torch.Tensor:
    """The counter a norm tail's programs take their tickets from (`gemv_residual(norm=...)`); each launch
    leaves it at 0. One serves every launch of a step: a launch's programs take tickets only after the kernel
    before it has finished (PDL's wait), and that one put the counter back."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def gemv_residual(a, w, b, residual, config=None, norm=None, l2=False):
    """fused.gemv_residual on the tensor cores. norm: (norm_w, eps, xn, ticket): also xn = RMSNorm(residual)
    with norm_w, as `rms_rows` would write it, from the last program to finish (no norm kernel after this one;
    ticket: `new_ticket`, at 0). l2: as qkv_rope's."""
    n, k = w.shape
    rows, sa = _rows(a)
    sres = residual.stride(0) if residual.dim() > 1 else 0
    pdl = use_pdl(a.device)
    if norm is not None:
        norm_w, eps, xn, ticket = norm
        if xn.shape != residual.shape or norm_w.shape != (n,):
            raise ValueError(f"the norm tail writes xn like the residual {tuple(residual.shape)} with a weight of "
                             f"{n}, got xn {tuple(xn.shape)}, weight {tuple(norm_w.shape)}")
        sxn = xn.stride(0) if xn.dim() > 1 else 0
    else:
        norm_w, eps, xn, ticket, sxn = w, 0.0, residual, residual, 0

    def launch(cfg, rows=rows, compile_only=False):
        bn, bk, stages, warps = cfg
        grid = (triton.cdiv(n, bn),)
        args = (a, w, b if b is not None else w, residual, norm_w, xn, ticket, rows, n, k, sa, sres, sxn, eps)
        kw = dict(HAS_BIAS=b is not None, BLOCK_N=bn, BLOCK_K=bk, RP=RP, STAGES=stages, IEEE=_ieee(a), PDL=pdl,
                  NORM=norm is not None, N_POW2=triton.next_power_of_2(n), L2_LINES=l2_lines(cfg, l2),
                  num_warps=warps, launch_pdl=pdl)
        return _launch(_gemv_residual_kernel, grid, compile_only, *args, **kw)

    restore = residual if residual.dim() == 1 else residual[0]
    name = _name("gemv_residual_norm" if norm is not None else "gemv_residual", l2)
    launch(_pick(name, n, k, DOT_CONFIGS, launch, a.device, config, w.dtype, restore=restore))


def gate_up_silu(xn, w, b, out, config=None, l2=False):
    """fused.norm_gate_up_silu over an input normalised by rms_rows. l2: as qkv_rope's."""
    i2, k = w.shape
    i = i2 // 2
    rows, sx = _rows(xn)
    so = out.stride(0) if out.dim() > 1 else 0
    pdl = use_pdl(xn.device)

    def launch(cfg, rows=rows, compile_only=False):
        bj, bk, stages, warps = cfg
        grid = (triton.cdiv(i, bj),)
        args = (xn, w, b if b is not None else w, out, rows, i, k, sx, so)
        kw = dict(HAS_BIAS=b is not None, BJ=bj, BLOCK_K=bk, RP=RP, STAGES=stages, IEEE=_ieee(xn), PDL=pdl,
                  L2_LINES=l2_lines(cfg, l2), num_warps=warps, launch_pdl=pdl)
        return _launch(_gate_up_silu_kernel, grid, compile_only, *args, **kw)

    launch(_pick(_name("gate_up_silu", l2), i2, k, DOT_PAIR_CONFIGS, launch, xn.device, config, w.dtype))


def gemv(xn, w, out, config=None, argmax_keys=None, l2=False) -> int:
    """fused.norm_gemv (the lm_head) over an input normalised by rms_rows; argmax_keys: row 0's per-program
    (value, first row) keys (one row only). Returns the number of programs launched (the keys written). l2: as
    qkv_rope's."""
    n, k = w.shape
    rows, sx = _rows(xn)
    so = out.stride(0) if out.dim() > 1 else 0
    if argmax_keys is not None and rows != 1:
        raise ValueError("the folded argmax takes one row")
    pdl = use_pdl(xn.device)

    def launch(cfg, keys=None, rows=rows, compile_only=False):
        bn, bk, stages, warps = cfg
        grid = (triton.cdiv(n, bn),)
        args = (xn, w, out, keys if keys is not None else out, rows, n, k, sx, so)
        kw = dict(BLOCK_N=bn, BLOCK_K=bk, RP=RP, STAGES=stages, IEEE=_ieee(xn), PDL=pdl, ARGMAX=keys is not None,
                  L2_LINES=l2_lines(cfg, l2), num_warps=warps, launch_pdl=pdl)
        return _launch(_gemv_kernel, grid, compile_only, *args, **kw)

    cfg = _pick(_name("gemv", l2), n, k, DOT_CONFIGS, lambda c, rows=rows, compile_only=False: launch(
        c, None, rows, compile_only), xn.device, config, w.dtype)
    launch(cfg, argmax_keys)
    return triton.cdiv(n, cfg[0])
