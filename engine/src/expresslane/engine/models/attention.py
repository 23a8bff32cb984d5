"""Attention over the static KV cache for T query rows at consecutive positions start_pos .. start_pos+T-1.

One step of the decode engine is T = 1 (plain decode) or T = k + 1 (verification of k drafts); row i may
see cache rows [0, start_pos + i]. Three kernels, chosen per engine (`AttentionKind`):

* ``LIVE`` (CPU default): the live rows only. In float32 with one torch thread (the express node's CPU
  setting) a native C kernel (below): one sequential sweep over the live K rows and one over the V rows for
  every head and row at once, 2.0-2.2x PyTorch's kernels in the tiny model's step at 3800 rows, eager and
  compiled (under torch.compile an opaque custom op; whether to use it is decided when the step is traced).
  Otherwise two batched matmuls per KV head eagerly (GQA: the query heads of one KV head share one matmul,
  the cache is never expanded) and SDPA over the live rows under torch.compile (a symbolic `kv_len` serves
  every length).
* ``MASKED`` (fixed shapes): PyTorch SDPA over the whole static cache with a [T, max_seq_len] mask built on
  the device from `start_pos`: CUDA-graph friendly, reads every cache row (the reference path).
* ``SPLIT_KV`` (CUDA default): the flash-decoding Triton kernel in `triton_decode.py`: the length is read on
  the device, the grid is fixed, only live rows are read; CUDA-graph friendly.

Prefill (T rows from position 0) always uses SDPA with `is_causal` (top-left alignment is right when T == L).
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .native import BASE_FLAGS, NativeKernel

logger = logging.getLogger(__name__)


class AttentionKind(str, enum.Enum):
    LIVE = "live"
    MASKED = "masked"
    SPLIT_KV = "split"


# Names accepted on command lines; "sliced" is the old name of LIVE (sliced to the live length).
ATTENTION_ALIASES = {"live": AttentionKind.LIVE, "sliced": AttentionKind.LIVE, "masked": AttentionKind.MASKED,
                     "split": AttentionKind.SPLIT_KV}


@dataclass
class StepContext:
    """What every layer's attention needs for one forward (built once per step, nano-vllm style).

    `start_pos` is a [1] long device tensor (graph-capturable); `kv_len` is the host-side live length
    start_pos + T, used by LIVE only (None for the fixed-shape kinds); `mask` is MASKED's [T, S] bool mask;
    `prefill` marks a causal forward from position 0. `groups` (LIVE only): the step's rows belong to several
    sequences, each attending over its own seat of the cache: a [G, 4] long CPU tensor, a row (first, count,
    cache_start, kv_len) per sequence (`seat_attention`); `input_pos` is then each row's cache row. `linear`: the
    step's projections (models/cpu_linear.py's row-invariant kernel on a CPU), None for the modules' own."""

    kind: AttentionKind
    start_pos: torch.Tensor
    kv_len: int | None = None
    mask: torch.Tensor | None = None
    prefill: bool = False
    groups: torch.Tensor | None = None
    linear: object | None = None


def live_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: int,
                   scale: float) -> torch.Tensor:
    """q [T, H, D] at positions kv_len-T .. kv_len-1; caches [S, Hkv, D]. Returns [T, H, D]."""
    if _native_fits(q, k_cache, v_cache):
        return _native_live_attention(q, k_cache, v_cache, kv_len, scale)
    return _bmm_live_attention(q, k_cache, v_cache, kv_len, scale)


def _bmm_live_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: int,
                        scale: float) -> torch.Tensor:
    """Two batched matmuls per KV head (any dtype, device and thread count)."""
    t, h, d = q.shape
    hkv = k_cache.shape[1]
    g = h // hkv
    # [Hkv, G*T, D]: the G query heads of each KV head, all T rows, as one matrix.
    qg = q.view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * t, d)
    k = k_cache[:kv_len].permute(1, 2, 0)  # [Hkv, D, L] (a view: no copy of the cache)
    v = v_cache[:kv_len].transpose(0, 1)  # [Hkv, L, D]
    if q.dtype != torch.float32:  # half types: scores and softmax in float32, as SDPA's CPU kernels do
        qg, k, v = qg.float(), k.float(), v.float()
    scores = torch.bmm(qg, k).mul_(scale)
    if t > 1:  # row i (position kv_len - t + i) sees keys [0, kv_len - t + i]
        rows = torch.arange(t, device=q.device).repeat(g)  # the T-row index of each of the G*T rows
        cols = torch.arange(kv_len, device=q.device)
        scores.masked_fill_((cols[None, :] > (kv_len - t + rows)[:, None]).unsqueeze(0), float("-inf"))
    out = torch.bmm(scores.softmax(dim=-1), v)
    return out.view(hkv, g, t, d).permute(2, 0, 1, 3).reshape(t, h, d).to(q.dtype)


# ---- the native CPU decode kernel (float32, one thread) ---------------------------------------------------
#
# Decode attention is a stream over the live K and V rows: with T = 1 and a few heads it does a handful of
# flops per byte. The kernel walks the cache in its own order (row j holds every KV head), once for K and once
# for V, for all H query heads and T rows at once, with scores and softmax in an [H*T, L] scratch: each live
# K/V byte is read once per step, sequentially. PyTorch's kernels read the same bytes
# per head, strided, in per-block GEMM calls (the bmm kernel above, SDPA): in the tiny model's step at 3800 rows (K/V of 4 layers plus the
# weights, about 29 MB, do not stay in this host's L3) they took 1.1-2.3 ms per layer against 0.36 ms for
# this kernel (torch.profiler, docs/bench/2026-12-01-cpu-attention-kernel/). The C source is compiled once per
# machine by the host's C compiler (-O3 -march=native, reassociating sums but not -ffast-math: _NATIVE_FLAGS; the runtime image has g++) into a per-user
# cache and called through ctypes. It reads only rows < L (rows past the length may hold anything); the
# causal limit of each verify row is applied in its softmax. Without a compiler the PyTorch kernels run and
# one warning says so.

_NATIVE_SRC = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __cplusplus
extern "C" {
#endif
/* One sweep over the live K rows and one over the live V rows, in cache order (row j holds every KV head),
   for all H query heads and T rows at once. Query row r = t * H + head; work: R * (L + 2 * D) floats. */
static inline __attribute__((always_inline)) void el_attn(
        const float *__restrict__ q, const float *__restrict__ kc, const float *__restrict__ vc,
        float *__restrict__ out, float *__restrict__ work, const int64_t T, const int64_t H,
        const int64_t Hkv, const int64_t D, const int64_t L, const float scale, const int64_t qs_t,
        const int64_t qs_h, const int64_t cs_s, const int64_t cs_h) {
    const int64_t G = H / Hkv, R = T * H;
    float *__restrict__ scores = work;      /* [R, L] */
    float *__restrict__ qv = work + R * L;  /* [R, D] scaled queries */
    float *__restrict__ acc = qv + R * D;   /* [R, D] */
    for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t d = 0; d < D; ++d) qv[(t * H + h) * D + d] = q[t * qs_t + h * qs_h + d] * scale;
    for (int64_t j = 0; j < L; ++j) {
        const float *__restrict__ krow = kc + j * cs_s;
        for (int64_t t = 0; t < T; ++t)
            for (int64_t h = 0; h < H; ++h) {
                const float *__restrict__ k = krow + (h / G) * cs_h;
                const float *__restrict__ qr = qv + (t * H + h) * D;
                float s = 0.f;
                for (int64_t d = 0; d < D; ++d) s += qr[d] * k[d];
                scores[(t * H + h) * L + j] = s;
            }
    }
    for (int64_t r = 0; r < R; ++r) { /* row t sees cache rows [0, L - T + t] */
        const int64_t lim = L - T + r / H + 1;
        float *__restrict__ sr = scores + r * L;
        float m = sr[0];
        for (int64_t j = 1; j < lim; ++j) m = sr[j] > m ? sr[j] : m;
        float sum = 0.f;
        for (int64_t j = 0; j < lim; ++j) { const float e = expf(sr[j] - m); sr[j] = e; sum += e; }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < lim; ++j) sr[j] *= inv;
        for (int64_t j = lim; j < L; ++j) sr[j] = 0.f;
    }
    memset(acc, 0, sizeof(float) * R * D);
    for (int64_t j = 0; j < L; ++j) {
        const float *__restrict__ vrow = vc + j * cs_s;
        for (int64_t t = 0; t < T; ++t)
            for (int64_t h = 0; h < H; ++h) {
                const float *__restrict__ v = vrow + (h / G) * cs_h;
                const float p = scores[(t * H + h) * L + j];
                float *__restrict__ a = acc + (t * H + h) * D;
                for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
            }
    }
    memcpy(out, acc, sizeof(float) * R * D); /* out [T, H, D] contiguous = acc's layout */
}
#define EL_CASE(DD) case DD: el_attn(q, kc, vc, out, work, T, H, Hkv, DD, L, scale, qs_t, qs_h, cs_s, cs_h); return 0;
int el_live_attention_f32(const float *q, const float *kc, const float *vc, float *out, float *work,
                          int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t L, float scale,
                          int64_t qs_t, int64_t qs_h, int64_t cs_s, int64_t cs_h) {
    switch (D) { EL_CASE(16) EL_CASE(32) EL_CASE(64) EL_CASE(80) EL_CASE(96) EL_CASE(128) EL_CASE(256) }
    return -1;
}
#ifdef __cplusplus
}
#endif
"""
# The reassociation the sweeps' sums need, without -ffast-math (models/native.py says why not):
_NATIVE_FLAGS = [*BASE_FLAGS, "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]
# EXPRESSLANE_CPU_ATTENTION=torch keeps PyTorch's kernels (the bmm's eagerly, SDPA compiled): for A/B runs.
_NATIVE_WANTED = os.environ.get("EXPRESSLANE_CPU_ATTENTION", "native") != "torch"
_NATIVE_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the switch in el_live_attention_f32
_KERNEL = NativeKernel("live_attention", _NATIVE_SRC, "el_live_attention_f32",
                       [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5 + [ctypes.c_float] + [ctypes.c_int64] * 4,
                       flags=_NATIVE_FLAGS, libs=("-lm",),
                       instead="decoding with the batched-matmul attention kernel instead")
_scratch = threading.local()


def native_kernel():
    """The compiled kernel (built on first use), or None where it cannot be built (warned once)."""
    return _KERNEL.load()


def _native_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Shapes and layouts the native kernel takes: float32 on CPU (all three: it dereferences their pointers on
    the host; a CUDA cache's pointer there is a segfault, seen on the H200 host), a head size it is built for,
    unit inner strides, K and V caches of one layout."""
    return (q.device.type == k_cache.device.type == v_cache.device.type == "cpu"
            and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and q.shape[-1] in _NATIVE_HEAD_DIMS and q.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
            and k_cache.stride(-1) == 1)


def _native_usable() -> bool:
    """The kernel is wanted and built here and torch runs one thread (with more, PyTorch's threaded kernels
    win). Under torch.compile this is decided once, when the step is traced (a constant, no graph break)."""
    return _NATIVE_WANTED and torch.get_num_threads() == 1 and native_kernel() is not None


# What torch.compiler.assume_constant_result(fn) does, without importing torch._dynamo (and with it Triton)
# when this module is imported; tests/unit/engine/test_attention.py compiles attend with fullgraph=True.
_native_usable._dynamo_marked_constant = True


def _native_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return _native_layout(q, k_cache, v_cache) and _native_usable()


def _native_live_attention(q, k_cache, v_cache, kv_len, scale):
    t, h, d = q.shape
    hkv = k_cache.shape[1]
    need = h * t * (kv_len + 2 * d)
    work = getattr(_scratch, "buf", None)
    if work is None or work.numel() < need:
        work = _scratch.buf = torch.empty(max(need, 1 << 16), dtype=torch.float32)
    out = torch.empty(t, h, d, dtype=torch.float32)
    rc = native_kernel()(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                         work.data_ptr(), t, h, hkv, d, kv_len, scale, q.stride(0), q.stride(1),
                         k_cache.stride(0), k_cache.stride(1))
    if rc != 0:  # _native_fits admits only the head sizes the kernel is built for
        raise RuntimeError(f"native live attention refused head_dim {d}")
    return out


@torch.library.custom_op("expresslane::cpu_live_attention", mutates_args=())
def cpu_live_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: int,
                       scale: float) -> torch.Tensor:
    """live_attention as one opaque op for the compiled step."""
    return live_attention(q, k_cache, v_cache, kv_len, scale)


@cpu_live_attention.register_fake
def _(q, k_cache, v_cache, kv_len, scale):
    return q.new_empty(q.shape)


def _seat_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, groups: torch.Tensor,
                    scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    for first, count, cache_start, kv_len in groups.tolist():
        out[first:first + count] = live_attention(q[first:first + count], k_cache[cache_start:],
                                                  v_cache[cache_start:], kv_len, scale)
    return out


@torch.library.custom_op("expresslane::seat_attention", mutates_args=())
def _seat_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, groups: torch.Tensor,
                       scale: float) -> torch.Tensor:
    return _seat_attention(q, k_cache, v_cache, groups, scale)


@_seat_attention_op.register_fake
def _(q, k_cache, v_cache, groups, scale):
    return torch.empty_like(q)


def seat_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, groups: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [R, H, D]: the rows of several sequences (decode/batch.py), groups [G, 4] (first, count, cache_start,
    kv_len) each: a sequence's rows [first, first + count) at positions kv_len - count .. kv_len - 1 over its cache
    rows [cache_start, cache_start + kv_len). Each sequence's attention is its own live-length call, the call a
    step of it alone makes (the same bits). Under torch.compile one opaque op (the loop over sequences is data)."""
    if torch.compiler.is_compiling():
        return _seat_attention_op(q, k_cache, v_cache, groups, scale)
    return _seat_attention(q, k_cache, v_cache, groups, scale)


def causal_mask(arange: torch.Tensor, start_pos: torch.Tensor, t: int) -> torch.Tensor:
    """[T, S] bool: row i may see cache rows <= start_pos + i (built on the device, fixed shape)."""
    positions = start_pos + arange[:t]
    return arange[None, :] <= positions[:, None]


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext,
           scale: float) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D] (the new K/V rows are already in the cache)."""
    if ctx.prefill:
        return _sdpa(q, k_cache[: q.shape[0]], v_cache[: q.shape[0]], None, True, scale)
    if ctx.groups is not None:
        return seat_attention(q, k_cache, v_cache, ctx.groups, scale)
    if ctx.kind is AttentionKind.LIVE:
        if not torch.compiler.is_compiling():
            return live_attention(q, k_cache, v_cache, ctx.kv_len, scale)
        if _native_fits(q, k_cache, v_cache):
            return cpu_live_attention(q, k_cache, v_cache, ctx.kv_len, scale)
        t, n = q.shape[0], ctx.kv_len
        mask = None
        if t > 1:  # row i sees keys [0, n - t + i]
            cols = torch.arange(n, device=q.device)
            mask = cols[None, :] <= (n - t + torch.arange(t, device=q.device))[:, None]
        return _sdpa(q, k_cache[:n], v_cache[:n], mask, False, scale)
    if ctx.kind is AttentionKind.MASKED:
        return _sdpa(q, k_cache, v_cache, ctx.mask, False, scale)
    from .triton_decode import split_kv_attention

    return split_kv_attention(q, k_cache, v_cache, ctx.start_pos, scale)


def _sdpa(q, k, v, mask, is_causal, scale):
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)
