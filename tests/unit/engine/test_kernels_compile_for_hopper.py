"""The tensor-core family's kernels (models/fused_dot.py) compile for an H100/H200 (sm_90a) on any host.

Triton's interpreter (the CPU tests) runs a kernel's Python, not the compiler: a kernel it runs may still fail to
lower for the GPU (a layout the tensor cores cannot take, a reduction of an odd shape, a type the PTX backend
refuses), or compile into one that spills. Here each kernel is compiled ahead of time for sm_90a, through
Triton's own ptxas, with the 8B shape's arguments and the block shapes the H200 picked
(docs/bench/2026-12-04-tensor-core-verify/), and ptxas's report must show no spill. No GPU is needed; on an
H100 / H200 the driver loads the cubin Triton built and reports its spills instead (Triton 3.6 there writes PTX
that its own bundled ptxas binaries refuse). The GPU check (scripts/gpu_check.py) still runs and times them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
from triton.compiler import ASTSource  # noqa: E402

from expresslane.engine.models import fused, fused_dot  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from bench_lib.hopper import HOPPER, signature  # noqa: E402



def _tritons_ptxas_for_hopper() -> str:
    """The ptxas Triton itself assembles sm_90 with: the PTX it writes carries the .version that ptxas accepts
    (Triton 3.9 uses ptxas-blackwell for sm_90 and up; Triton 3.6 uses ptxas there, and its ptxas-blackwell is
    older and refuses the PTX: measured on the H200, 2026-12-04)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        get_ptxas = None
    if get_ptxas is None:
        return triton.knobs.nvidia.ptxas.path
    try:
        return get_ptxas(90).path
    except TypeError:  # a Triton whose get_ptxas takes no architecture: one ptxas for all
        return get_ptxas().path


PTXAS = _tritons_ptxas_for_hopper()
pytestmark = pytest.mark.skipif(not (PTXAS and os.access(PTXAS, os.X_OK)), reason="this Triton wheel ships no ptxas")

# 8B shape: hidden 4096, 32 / 8 heads of 128. L2_LINES > 0: the first tiles' weights prefetched into the L2
# before the PDL wait (fused_dot._weights_to_l2; the lines of 4 tiles of 256 or 128 columns).
CASES = {
    "rms_rows": (fused_dot._rms_rows_kernel, 4, dict(K_POW2=4096)),
    "qkv_rope": (fused_dot._qkv_rope_kernel, 4, dict(NH=32, NKV=8, D=128, HAS_BIAS=False, BJ=32, BLOCK_K=256,
                                                     STAGES=5, L2_LINES=0, PER_ROW=False)),
    "qkv_rope with bias": (fused_dot._qkv_rope_kernel, 4, dict(NH=32, NKV=8, D=128, HAS_BIAS=True, BJ=32,
                                                              BLOCK_K=256, STAGES=5, L2_LINES=0, PER_ROW=False)),
    "qkv_rope + L2 prefetch": (fused_dot._qkv_rope_kernel, 4, dict(NH=32, NKV=8, D=128, HAS_BIAS=False, BJ=32,
                                                                  BLOCK_K=256, STAGES=5, L2_LINES=16, PER_ROW=False)),
    # several users' rows (LeanStep.forward_seats): each row's position and cache row read from the device
    "qkv_rope over several users' rows": (fused_dot._qkv_rope_kernel, 4, dict(
        NH=32, NKV=8, D=128, HAS_BIAS=False, BJ=32, BLOCK_K=256, STAGES=5, L2_LINES=0, PER_ROW=True)),
    "gemv_residual": (fused_dot._gemv_residual_kernel, 4, dict(HAS_BIAS=False, BLOCK_N=32, BLOCK_K=256, STAGES=5,
                                                               NORM=False, N_POW2=4096, L2_LINES=0)),
    "gemv_residual + norm tail": (fused_dot._gemv_residual_kernel, 4, dict(HAS_BIAS=False, BLOCK_N=32, BLOCK_K=256,
                                                                           STAGES=5, NORM=True, N_POW2=4096,
                                                                           L2_LINES=0)),
    "gemv_residual + norm tail, 8 warps, L2 prefetch": (fused_dot._gemv_residual_kernel, 8, dict(
        HAS_BIAS=False, BLOCK_N=64, BLOCK_K=128, STAGES=5, NORM=True, N_POW2=4096, L2_LINES=8)),
    "gate_up_silu": (fused_dot._gate_up_silu_kernel, 4, dict(HAS_BIAS=False, BJ=32, BLOCK_K=128, STAGES=5,
                                                             L2_LINES=0)),
    "gate_up_silu + L2 prefetch": (fused_dot._gate_up_silu_kernel, 4, dict(HAS_BIAS=False, BJ=32, BLOCK_K=128,
                                                                          STAGES=5, L2_LINES=8)),
    "lm_head + argmax": (fused_dot._gemv_kernel, 4, dict(BLOCK_N=64, BLOCK_K=128, STAGES=5, ARGMAX=True,
                                                         L2_LINES=0)),
    "lm_head + argmax + L2 prefetch": (fused_dot._gemv_kernel, 4, dict(BLOCK_N=64, BLOCK_K=128, STAGES=5,
                                                                       ARGMAX=True, L2_LINES=8)),
}


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels(request):
    """Where Triton's interpreter is on in this process (test_fused_kernels.py turns it on for CPU hosts), the
    kernels were decorated as interpreted functions and cannot be compiled: then this module runs once in a fresh
    process without the interpreter, and its result is asserted here."""
    if isinstance(fused_dot._gemv_kernel, triton.runtime.jit.JITFunction):
        yield
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "pytest", str(request.path), "-q", "-p", "no:cacheprovider"],
                          cwd=request.config.rootpath, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    pytest.skip("ran (and passed) in a fresh process: Triton's interpreter is on in this one")


def _signature(kernel) -> dict[str, str]:
    return signature(kernel, float32_out=kernel is fused_dot._gemv_kernel)  # the logits GEMV writes float32


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_sm90_without_spilling(case, tmp_path):
    kernel, warps, constexprs = CASES[case]
    constexprs = dict(constexprs, PDL=True)
    if "RP" in {p.name for p in kernel.params}:
        constexprs.update(RP=fused_dot.RP, IEEE=False)
    missing = {p.name for p in kernel.params if p.is_constexpr} - set(constexprs)
    assert not missing, f"the case names no value for {missing}"
    compiled = triton.compile(ASTSource(fn=kernel, signature=_signature(kernel), constexprs=constexprs),
                              target=HOPPER, options={"num_warps": warps})
    ptx_text = compiled.asm["ptx"]
    prefetches = ptx_text.count("prefetch.global.L2")
    if constexprs.get("L2_LINES"):
        # every prefetch is issued before the PDL wait (the weights are constant; nothing else is touched there)
        assert prefetches and ptx_text.rindex("prefetch.global.L2") < ptx_text.index("griddepcontrol.wait"), case
    else:
        assert prefetches == 0, case
    if _on_hopper():
        # Triton built the cubin with the toolchain it runs with; the driver loads it and says what it spills
        # (what the engine's block-shape picker reads). A standalone ptxas need not accept that PTX's .version
        # (Triton 3.6 on the H200 writes 9.0; its bundled ptxas binaries take 8.7 and 8.8).
        spills = fused.spilled_bytes(compiled)
        print(f"{case}: {compiled.n_regs} registers, {spills} bytes spilled (driver)")
        assert spills == 0, f"{case} spills {spills} bytes a thread"
        return
    ptx = tmp_path / "kernel.ptx"
    ptx.write_text(compiled.asm["ptx"])
    out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", str(ptx), "-o", str(tmp_path / "kernel.cubin")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", out.stderr)]
    regs = re.findall(r"Used (\d+) registers", out.stderr)
    print(f"{case}: {regs} registers, {spills} bytes of spill stores")
    assert spills and not any(spills), out.stderr[-2000:]


def _on_hopper() -> bool:
    """A CUDA device of compute capability 9.0 (H100 / H200) is this process's current device."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# The lean step's warm-up compiles a pick's candidate block shapes on a thread pool (models/precompile.py):
# Triton's compile releases the GIL. That is only sound if compiling on threads builds the very kernels compiling
# one after another does.
PARALLEL_CASES = [
    (fused._gemv_residual_kernel, dict(HAS_BIAS=False, BLOCK_N=c[0], BLOCK_K=c[1], PREFETCH=c[2],
                                       PACK=fused._pack(c)), fused._warps(c))
    for c in fused.GEMV_CONFIGS[:3] + fused.GEMV_CONFIGS[7:8]
] + [
    (fused._norm_gate_up_silu_kernel, dict(HAS_BIAS=False, BJ=c[0], BLOCK_K=c[1], PREFETCH=c[2], K_POW2=4096,
                                           PACK=fused._pack(c)), fused._warps(c))
    for c in fused.PAIR_CONFIGS[4:6]
]


def _compile_case(kernel, constexprs, warps, rows):
    constexprs = dict(constexprs, PDL=True, ROWS=rows)
    return triton.compile(ASTSource(fn=kernel, signature=_signature(kernel), constexprs=constexprs),
                          target=HOPPER, options={"num_warps": warps})


def test_compiling_on_threads_builds_the_same_kernels(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(kernel, cx, warps, rows) for kernel, cx, warps in PARALLEL_CASES for rows in (1, 5)]
    built = {}
    for mode in ("one after another", "on threads"):
        # a cache of its own: each mode compiles every kernel
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / mode.replace(" ", "-")))
        if mode == "on threads":
            with ThreadPoolExecutor(4) as pool:
                built[mode] = list(pool.map(lambda job: _compile_case(*job), jobs))
        else:
            built[mode] = [_compile_case(*job) for job in jobs]
    assert len(os.listdir(tmp_path / "on-threads")) >= len(jobs), "the threads' run compiled nothing"
    for job, a, b in zip(jobs, built["one after another"], built["on threads"]):
        assert a.asm["cubin"] == b.asm["cubin"], f"{job[0].fn.__name__} {job[1]} rows={job[3]}: other binary"
