"""The attention kernels that read only the live rows give the masked whole-cache SDPA's result: the CPU
live-rows kernel and the split-KV Triton kernel (on CPU through Triton's interpreter, on a GPU for real),
for T = 1 (decode) and T = k + 1 (verify) rows, GQA groups, every split boundary, float32 and bf16; and an
engine on each kernel decodes exactly like transformers. Garbage past the live length must not leak in."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from expresslane.engine.decode import DecodeEngine, SamplingParams
from expresslane.engine.models import attention as attention_mod
from expresslane.engine.models.attention import (_bmm_live_attention, _native_live_attention, _sdpa, causal_mask,
                                                 live_attention, native_kernel)

from .test_engine_vs_transformers import N_NEW, PROMPT, hf_greedy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


if DEVICE == "cpu":
    # Off a GPU the Triton kernel runs in Triton's interpreter (numpy). The variable is read when the jit
    # functions are decorated and when they run, so it stays set for this process (nothing else here uses
    # Triton on CPU: inductor's CPU backend is C++).
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    from expresslane.engine.models.triton_decode import split_kv_attention
except ImportError:  # no triton on this host
    split_kv_attention = None
needs_triton = pytest.mark.skipif(split_kv_attention is None, reason="needs triton")
HAS_CC = any(shutil.which(c) for c in ("cc", "gcc", "g++")) or bool(os.environ.get("CC"))
needs_cc = pytest.mark.skipif(DEVICE != "cpu" or not HAS_CC, reason="the native kernel is CPU-only and needs a C compiler")
LIVE_KERNELS = {"live": live_attention, "native": _native_live_attention, "bmm": _bmm_live_attention}


def _ran_in_fresh_process(request) -> bool:
    """Triton's interpreter cannot run here once vLLM was imported in this process (an earlier test module
    imports it: the jit'd helpers then refuse to run interpreted). Run this test alone in a fresh interpreter
    instead and report its result; True means it was run (and passed) there."""
    if DEVICE != "cpu" or "vllm" not in sys.modules or os.environ.get("_EXPRESSLANE_FRESH_ATTENTION"):
        return False
    env = dict(os.environ, TRITON_INTERPRET="1", _EXPRESSLANE_FRESH_ATTENTION="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", request.node.nodeid, "-q", "-p", "no:cacheprovider"],
                          cwd=request.config.rootpath, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return True


def _case(seed, s, hkv, g, d, dtype):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(s, hkv, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(s, hkv, d, generator=gen).to(DEVICE, dtype)
    return k, v, gen


def _reference(q, k, v, start, t):
    ar = torch.arange(k.shape[0], device=k.device)
    mask = causal_mask(ar, torch.tensor([start], device=k.device), t)
    return _sdpa(q.double(), k.double(), v.double(), mask, False, q.shape[-1] ** -0.5)


CASES = [(1, 0), (1, 1), (1, 31), (1, 32), (1, 257), (1, 498), (2, 5), (3, 64), (5, 0), (5, 200), (5, 494)]


@pytest.mark.parametrize("kernel", ["live", pytest.param("native", marks=needs_cc), "bmm",
                                    pytest.param("split", marks=needs_triton)])
@pytest.mark.parametrize("hkv,g,d", [(2, 2, 32), (1, 4, 64), (4, 1, 16)])
def test_kernel_matches_masked_sdpa(kernel, hkv, g, d, request):
    if kernel == "split" and DEVICE == "cpu" and (hkv, g, d) != (1, 4, 64):
        pytest.skip("the interpreted kernel is slow: one GQA shape on CPU (every shape on a GPU)")
    if kernel == "split" and _ran_in_fresh_process(request):
        return
    s = 500
    k, v, gen = _case(hkv * 100 + g, s, hkv, g, d, torch.float32)
    for t, start in CASES:
        q = torch.randn(t, hkv * g, d, generator=gen).to(DEVICE)
        if kernel in LIVE_KERNELS:  # as the model makes it: a slice of the fused q/k/v projection (strided)
            q = torch.cat([q, torch.randn(t, 2 * hkv, d, generator=gen).to(DEVICE)], dim=1)[:, : hkv * g]
        # Poison every row past the live length: a kernel that reads them returns NaN.
        kp, vp = k.clone(), v.clone()
        kp[start + t:] = float("nan")
        vp[start + t:] = float("nan")
        ref = _reference(q, k, v, start, t)
        if kernel in LIVE_KERNELS:
            got = LIVE_KERNELS[kernel](q, kp, vp, start + t, d ** -0.5)
        else:
            got = split_kv_attention(q, kp, vp, torch.tensor([start], device=DEVICE), d ** -0.5)
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (kernel, t, start, err)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="Triton's interpreter computes bf16 dots wrongly (numpy has no bf16)"))])
def test_split_kv_half_precision(dtype, request):
    if _ran_in_fresh_process(request):
        return
    hkv, g, d, s = 2, 4, 64, 700
    k, v, gen = _case(5, s, hkv, g, d, dtype)
    for t, start in [(1, 650), (5, 333), (1, 3)]:
        q = torch.randn(t, hkv * g, d, generator=gen).to(DEVICE, dtype)
        ref = _reference(q, k, v, start, t)
        got = split_kv_attention(q, k, v, torch.tensor([start], device=DEVICE), d ** -0.5)
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (t, start, err)


# (rows, start): row r is a one-row step at start + r. On CPU (8 splits, BLOCK_N 32 in float32) a split's chunk
# grows from 32 to 64 rows as the length passes 256, and from 64 to 96 past 512: verifies across both, near the
# start (most splits empty) and inside one chunk size. On a GPU (64 splits at hkv 2 on an H200, BLOCK_N 64 in
# bf16) the boundaries are at multiples of 4,096.
SHARED_CASES = ([(2, 0), (5, 1), (3, 40), (5, 253), (4, 510), (5, 600)] if DEVICE == "cpu" else
                [(r, s) for r in (2, 3, 4, 5) for s in (0, 37, 4093, 8190, 20000)])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_the_shared_rows_kernel_is_each_rows_own_launch_bit_for_bit(dtype, request):
    """split_kv_attention_rows(shared=True) reads each cache tile once for every row of a verify; each row's
    output must still be the bits of that row's own one-row launch (and of the one-program-per-row kernel),
    with a row's splits those of its own length, across chunk-size boundaries. Rows past the longest row's
    length are poisoned: reading them shows as NaN."""
    if _ran_in_fresh_process(request):
        return
    from expresslane.engine.models.triton_decode import SHARED_MAX_ROWS, split_kv_attention_rows

    hkv, g, d = 2, 4, 64
    s = 700 if DEVICE == "cpu" else 20100
    k, v, gen = _case(17, s, hkv, g, d, dtype)
    for rows, start in SHARED_CASES:
        q = torch.randn(rows, hkv * g, d, generator=gen).to(DEVICE, dtype)
        kp, vp = k.clone(), v.clone()
        kp[start + rows:] = float("nan")
        vp[start + rows:] = float("nan")
        pos = torch.tensor([start], device=DEVICE)
        shared = split_kv_attention_rows(q, kp, vp, pos, d ** -0.5, shared=True)
        per_row = split_kv_attention_rows(q, kp, vp, pos, d ** -0.5)
        assert not shared.isnan().any(), (rows, start)
        assert torch.equal(shared, per_row), (rows, start)
        for r in range(rows):
            one = split_kv_attention(q[r:r + 1], kp, vp, torch.tensor([start + r], device=DEVICE), d ** -0.5)
            assert torch.equal(shared[r], one[0]), (rows, start, r)
    with pytest.raises(ValueError, match="at most"):
        split_kv_attention_rows(torch.zeros(SHARED_MAX_ROWS + 1, hkv * g, d, device=DEVICE, dtype=dtype), k, v,
                                torch.tensor([0], device=DEVICE), 1.0, shared=True)


@pytest.mark.parametrize("kernel", ["bmm", pytest.param("native", marks=needs_cc)])
def test_a_wrong_kernel_is_caught(kernel):
    """The bound is tight enough: reading one row too few changes the result far past it."""
    hkv, g, d = 2, 2, 32
    k, v, gen = _case(9, 100, hkv, g, d, torch.float32)
    q = torch.randn(1, hkv * g, d, generator=gen).to(DEVICE)
    ref = _reference(q, k, v, 40, 1)
    short = LIVE_KERNELS[kernel](q, k, v, 40, d ** -0.5)  # sees rows [0, 40) instead of [0, 41)
    assert ((short.double() - ref).norm() / ref.norm()).item() > 1e-3


@needs_cc
@pytest.mark.parametrize("hkv,g,d", [(8, 4, 128), (4, 2, 80), (1, 1, 256)])
def test_native_kernel_long_context_and_wide_verify(hkv, g, d):
    """Head sizes of real checkpoints, 3,800 live rows, up to 17 verify rows (k = 16)."""
    k, v, gen = _case(hkv + g + d, 4096, hkv, g, d, torch.float32)
    for t, start in [(1, 3799), (17, 3783), (9, 2000)]:
        q = torch.randn(t, hkv * g, d, generator=gen)
        kp, vp = k.clone(), v.clone()
        kp[start + t:] = float("nan")
        vp[start + t:] = float("nan")
        ref = _reference(q, k, v, start, t)
        got = _native_live_attention(q, kp, vp, start + t, d ** -0.5)
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (t, start, err)


@needs_cc
def test_the_cpu_engine_decodes_on_the_native_kernel():
    """The engine tests run one torch thread (conftest), float32, head sizes the kernel is built for: the
    live path there is the native kernel, so every CPU exactness test (engine vs transformers, speculation,
    compiled step) covers it. A build failure must not pass unnoticed as the bmm fallback."""
    assert torch.get_num_threads() == 1
    assert native_kernel() is not None
    q = torch.zeros(1, 4, 16)
    cache = torch.zeros(8, 2, 16)
    assert attention_mod._native_fits(q, cache, cache)
    assert not attention_mod._native_fits(q.double(), cache.double(), cache.double())
    assert not attention_mod._native_fits(torch.zeros(1, 4, 24), torch.zeros(8, 2, 24), torch.zeros(8, 2, 24))
    # the kernel dereferences every pointer on the host: a cache off the CPU (on a GPU: CUDA; here: meta) is
    # refused even with q on the CPU (the H200 host's process died on a CUDA cache)
    off = cache.to("meta")
    assert not attention_mod._native_fits(q, off, off)


@needs_cc
def test_loading_the_native_kernel_keeps_subnormals():
    """Loading the kernel must not change the process's floating point: a library linked with -ffast-math
    carries crtfastmath.o, which sets flush-to-zero / denormals-are-zero for every thread's later float ops
    (torch's, numpy's, Python's own). Checked in a fresh interpreter, so what loaded it is this kernel alone."""
    code = ("import torch; from expresslane.engine.models.attention import native_kernel; "
            "assert native_kernel() is not None; x = float('5e-324'); "
            "t = torch.tensor([1e-40], dtype=torch.float32); "
            "print(x * 1.0 > 0, (t * 1.0).item() != 0.0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "True"], proc.stdout


@pytest.mark.parametrize("attention", ["live", "masked", pytest.param("split", marks=needs_triton)])
def test_engine_on_each_kernel_matches_transformers(hf_model, attention, request):
    kind, path, model = hf_model
    if attention == "split" and DEVICE == "cpu" and kind != "qwen3":
        pytest.skip("the interpreted kernel is slow: one architecture on CPU (all of them on a GPU)")
    if attention == "split" and _ran_in_fresh_process(request):
        return
    engine = DecodeEngine.from_pretrained(path, device=DEVICE, max_seq_len=128, attention=attention,
                                          cuda_graph=False)
    expected, _ = hf_greedy(model, PROMPT, N_NEW)
    first = int(engine.prefill(PROMPT).argmax())
    lookup = PROMPT + expected  # drafts mostly right: verify rows (T > 1) run through the kernel too
    gen = engine.generate(first, len(PROMPT), SamplingParams(max_tokens=N_NEW, ignore_eos=True,
                                                             prompt_token_ids=lookup))
    assert list(gen) == expected
    assert gen.spec.accepted_tokens > 0


@pytest.mark.parametrize("t", [1, 3])
def test_live_attention_compiles_without_a_graph_break(t):
    """The compiled step traces attend() in one graph: whether the native kernel runs is decided at trace
    time (a graph break there cost about 1 ms a step in dynamo's guards, measured)."""
    from expresslane.engine.models.attention import AttentionKind, StepContext, attend

    hkv, g, d, n = 2, 2, 16, 40
    k, v, gen = _case(3, 64, hkv, g, d, torch.float32)
    q = torch.randn(t, hkv * g, d, generator=gen).to(DEVICE)  # q on the caches' device (on a GPU: CUDA)
    ctx = StepContext(AttentionKind.LIVE, torch.tensor([n - t], device=DEVICE), kv_len=n)
    torch._dynamo.reset()
    got = torch.compile(lambda q, k, v: attend(q, k, v, ctx, d ** -0.5), backend="eager", fullgraph=True)(q, k, v)
    ref = _reference(q, k, v, n - t, t)
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5
