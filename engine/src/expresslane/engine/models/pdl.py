"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (Hopper and later).

A batch-1 decode step is a chain of ~100 short kernels, each of which depends on the one before it. Launched the
ordinary way, kernel n + 1 starts only once kernel n has ended: every boundary costs the launch and the ramp of
the next kernel's first memory loads (on the H200 the Llama-1B step spent 869 us in kernels for 593 us of
bytes: docs/bench/2026-12-01-gpu-greedy-chain/). With PDL (`launch_pdl=True`, Triton's `griddepcontrol`
instructions) kernel n + 1 may start while kernel n's last programs still run: its programs load what does not
depend on kernel n (their first tile of constant weights) and then wait (`gdc_wait`) until kernel n has
finished and its writes are visible; only then do they read the activations. Each kernel lets the next one launch
(`gdc_launch_dependents`) right after its own wait, so at most the next kernel is in flight early, and what it
does before its wait touches only weights.

The rule every kernel launched with PDL keeps: nothing before `pdl_wait` reads or writes memory another kernel
of the step writes. Inside a CUDA graph the launches become programmatic edges (CUDA 12.3+); a kernel launched
without PDL (PyTorch's) still waits for the whole previous kernel, so mixing is safe.

Which kernels launch with PDL is chosen per kind (`KINDS`): the fused GEMVs (`gemv`), the split-KV
attention's partial kernel (`attn_partial`) and its merge (`attn_merge`). `EXPRESSLANE_PDL` is `1` (the
default kinds, `DEFAULT_KINDS`), `0` (none), or a comma-separated list of kinds; `set_pdl` sets the same
in-process, before the graphs are captured (A/B runs). Off a CUDA device of compute capability 9+, under Triton's interpreter, or with a Triton that has
no `launch_pdl`, the kernels run without it (the same code, the wait compiled out).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: PDL is never used (use_pdl says so)
    gdc_launch_dependents = gdc_wait = None

__all__ = ["KINDS", "pdl_wait", "use_pdl", "set_pdl", "pdl_kinds", "parse_kinds", "pdl_unsupported_reason"]

KINDS = ("gemv", "attn_partial", "attn_merge")
# Not the attention's partial kernel: launched early, its programs (one wave, two a multiprocessor) are placed
# while the QKV kernel still holds the multiprocessors, unevenly, and the long-context step got slower with it
# (H200, Llama-1B shape at 32k: 1.334 ms a step with it, 1.096 without, 1.173 with no PDL at all;
# docs/bench/2026-12-02-gpu-pdl-argmax/run2-pdl-variants.jsonl).
DEFAULT_KINDS = frozenset({"gemv", "attn_merge"})


def parse_kinds(value: str) -> frozenset[str]:
    """`EXPRESSLANE_PDL`'s value: "1" (the defaults), "0" / "" (none), or kinds separated by commas."""
    value = value.strip()
    if value == "1":
        return DEFAULT_KINDS
    if value in ("0", ""):
        return frozenset()
    kinds = frozenset(k.strip() for k in value.split(",") if k.strip())
    unknown = kinds - set(KINDS)
    if unknown:
        raise ValueError(f"EXPRESSLANE_PDL: unknown kernel kinds {sorted(unknown)} (known: {', '.join(KINDS)})")
    return kinds


_kinds = parse_kinds(os.environ.get("EXPRESSLANE_PDL", "1"))
_supported: dict[tuple[str, int | None], bool] = {}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With PDL: wait until the kernel this one depends on has finished (its writes visible), then let the
    next kernel launch. Without: nothing (compiled out)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def _triton_has_launch_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_unsupported_reason(device: torch.device) -> str | None:
    """Why the kernels cannot use PDL on `device` (None: they can)."""
    if device.type != "cuda":
        return f"PDL needs a CUDA device, not {device.type}"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "Triton's interpreter has no grid dependency control"
    if gdc_wait is None or not _triton_has_launch_pdl():
        return f"Triton {triton.__version__} has no launch_pdl"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"PDL needs compute capability 9.0+, the device has {major}.{minor}"
    return None


def use_pdl(device: torch.device, kind: str = "gemv") -> bool:
    """Whether kernels of `kind` launched for `device` use PDL now (the device check is cached)."""
    if kind not in _kinds:
        return False
    key = (device.type, device.index)
    if key not in _supported:
        _supported[key] = pdl_unsupported_reason(device) is None
    return _supported[key]


def pdl_kinds() -> frozenset[str]:
    return _kinds


def set_pdl(kinds: bool | str | frozenset[str] | set[str]) -> None:
    """The kernel kinds that launch with PDL from now on: True (the defaults), False (none), a set of kinds or
    `EXPRESSLANE_PDL`'s syntax. Capture the CUDA graphs again after it."""
    global _kinds
    if kinds is True:
        _kinds = DEFAULT_KINDS
    elif kinds is False:
        _kinds = frozenset()
    elif isinstance(kinds, str):
        _kinds = parse_kinds(kinds)
    else:
        _kinds = parse_kinds(",".join(kinds)) if kinds else frozenset()
