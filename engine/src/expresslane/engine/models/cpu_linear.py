"""The CPU step's linear layers, row-invariant: row r of `linear(x, w, b)` is the same bits whatever the other rows.

An express node serves several users in one forward (decode/batch.py): the rows of a step are every active
user's token (and its drafts), and each user's logits must be `torch.equal` to its solo run's. PyTorch's CPU
linear does not give that: its one-row product (a GEMV) and its R-row product (a GEMM, blocked by R) sum in other
orders, and R = 2, 3 differ again from R >= 4 (measured on an AMD EPYC host, torch 2.13 / MKL: every row count
1..16 differed from one row in the last bits, at the tiny model's and SmolLM2-135M's shapes). It is also no
faster for a few rows: the lm_head of SmolLM2-135M (49,152 x 576, float32) took 10.2 ms for one row and 19.8 /
21.1 / 23.5 ms for 2 / 4 / 8 rows on one thread, where the weights' read alone is the cost of one row.

This kernel computes each output element as one fixed sequence of operations: eight float32 partial sums over
K in steps of eight (fused multiply-adds where the CPU has them, a multiply then an add elsewhere), a masked tail,
one fixed tree over the eight lanes, then the bias. The row loop only decides which accumulators are in
registers together: four weight rows and two input rows a tile, each weight tile loaded once for every row of
the step (R rows cost one read of the weights plus R times the multiply-adds). Threads (OpenMP, the same runtime
torch runs: torch's bundled libgomp is already loaded when this library is) split the weight rows, never a sum.
So a row's result depends on its own input and the weights alone: the one-row step of a user alone and its row
in a step of eight users are the same bits, and so are a verify's rows and the plain steps at those positions.

Float32 only (the CPU node's dtype). `linear` falls back to one F.linear per row where the kernel does not apply
(another dtype, a non-CPU tensor, no C compiler): the same bits as a solo one-row step, at a weight read per row.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from .native import BASE_FLAGS, NativeKernel

_SRC = r"""
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(acc, a, b) _mm256_fmadd_ps(a, b, acc)
static inline vec vload_tail(const float *p, int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), idx);
    return _mm256_maskload_ps(p, mask);
}
static inline float hsum(vec v) { /* ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#else
typedef float vec __attribute__((vector_size(32)));
#define VZERO() ((vec){0, 0, 0, 0, 0, 0, 0, 0})
static inline vec VLOAD(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }
#define VFMA(acc, a, b) ((acc) + (a) * (b))  /* built with -ffp-contract=off: a multiply, then an add */
static inline vec vload_tail(const float *p, int64_t n) {
    vec v = VZERO();
    for (int64_t i = 0; i < n; ++i) v[i] = p[i];
    return v;
}
static inline float hsum(vec v) {
    float a = (v[0] + v[4]) + (v[2] + v[6]), b = (v[1] + v[5]) + (v[3] + v[7]);
    return a + b;
}
#endif

/* Rows r0, r0 + 1 (when two) against weight rows n0 .. n0 + nn - 1 (nn <= 4). Each (row, weight row) pair has
   its own accumulator and sees the same operations in the same order whatever else shares the tile. */
static inline void tile(const float *x, const float *w, const float *b, float *y, int64_t r0, int two,
                        int64_t n0, int nn, int64_t K, int64_t xs, int64_t ys) {
    vec a[2][4];
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 4; ++j) a[i][j] = VZERO();
    const float *x0 = x + r0 * xs, *x1 = x0 + xs;
    const int64_t kv = K & ~(int64_t)7;
    for (int64_t k = 0; k < kv; k += 8) {
        const vec v0 = VLOAD(x0 + k);
        const vec v1 = two ? VLOAD(x1 + k) : VZERO();
        for (int j = 0; j < nn; ++j) {
            const vec wv = VLOAD(w + (n0 + j) * K + k);
            a[0][j] = VFMA(a[0][j], wv, v0);
            if (two) a[1][j] = VFMA(a[1][j], wv, v1);
        }
    }
    if (kv < K) {
        const vec v0 = vload_tail(x0 + kv, K - kv);
        const vec v1 = two ? vload_tail(x1 + kv, K - kv) : VZERO();
        for (int j = 0; j < nn; ++j) {
            const vec wv = vload_tail(w + (n0 + j) * K + kv, K - kv);
            a[0][j] = VFMA(a[0][j], wv, v0);
            if (two) a[1][j] = VFMA(a[1][j], wv, v1);
        }
    }
    for (int i = 0; i < 1 + two; ++i)
        for (int j = 0; j < nn; ++j) {
            float s = hsum(a[i][j]);
            if (b) s += b[n0 + j];
            y[(r0 + i) * ys + n0 + j] = s;
        }
}

int el_row_linear_f32(const float *x, const float *w, const float *b, float *y, int64_t R, int64_t N, int64_t K,
                      int64_t xs, int64_t ys, int64_t threads) {
    const int64_t blocks = (N + 3) / 4;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads((int)threads) if (threads > 1 && blocks > 64)
#endif
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t n0 = blk * 4;
        const int nn = (int)(N - n0 < 4 ? N - n0 : 4);
        for (int64_t r = 0; r < R; r += 2) tile(x, w, b, y, r, r + 1 < R, n0, nn, K, xs, ys);
    }
    return 0;
}
"""

_ARGS = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6
_KERNEL = NativeKernel("row_linear", _SRC, "el_row_linear_f32", _ARGS,
                       flags=(*BASE_FLAGS, "-ffp-contract=off", "-fopenmp"),
                       instead="the CPU step runs one F.linear a row (the same bits, a weight read per row)")


def kernel():
    """The compiled kernel (built on first use), or None where it cannot be built (warned once)."""
    return _KERNEL.load()


def _fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (x.device.type == weight.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, K] @ weight[N, K]^T (+ bias) -> [R, N], each row's bits independent of the other rows."""
    fn = kernel() if _fits(x, weight, bias) else None
    if fn is None:
        return torch.cat([F.linear(x[r:r + 1], weight, bias) for r in range(x.shape[0])])
    r, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"linear: x has {k} columns, the weight {weight.shape[1]}")
    y = torch.empty(r, n, dtype=torch.float32)
    fn(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), r, n, k,
       x.stride(0), n, torch.get_num_threads())
    return y


@torch.library.custom_op("expresslane::row_linear", mutates_args=())
def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear` as one opaque op for the compiled step."""
    return linear(x, weight, bias)


@row_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])
