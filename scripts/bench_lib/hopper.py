"""Compiling the engine's Triton kernels ahead of time for an H100 / H200 (sm_90) on a host without a GPU: the
target, and each kernel's argument types as Triton's `ASTSource` takes them. Used by
tests/unit/engine/test_kernels_compile_for_hopper.py and docs/bench/2026-12-05-parallel-compile/bench_precompile.py."""

from __future__ import annotations

from triton.backends.compiler import GPUTarget

HOPPER = GPUTarget("cuda", 90, 32)
# Pointer arguments are bf16 tensors unless named here; the other non-constexpr arguments are int32 (eps float).
POINTERS = {"start_ptr": "*i64", "rows_ptr": "*i64", "key_ptr": "*i64", "ticket_ptr": "*i32"}


def signature(kernel, float32_out: bool = False) -> dict[str, str]:
    """{argument: type} for `kernel`; float32_out: its `out_ptr` is float32 (the logits GEMVs)."""
    sig = {}
    for p in kernel.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = "*fp32" if (p.name == "out_ptr" and float32_out) else POINTERS.get(p.name, "*bf16")
        else:
            sig[p.name] = "fp32" if p.name == "eps" else "i32"
    return sig
