"""vLLM's paged KV cache -> dense per-request K/V, derived from the attention backend vLLM chose.

vLLM 0.32 hands every connector one logical ``[B, H, N, C]`` view per layer (num kernel blocks, KV heads,
tokens per kernel block, C = head_size + head_size_v elements; physical strides follow the resolved
``KVCacheLayout``, so the view may be strided). Where K and V sit inside a page is the attention backend's
business, and it differs between backends:

* ``CPU_ATTN``: opaque C++ packing that depends on the CPU ISA the backend picks (``vec``: per block and
  head, K is stored dim-major ``[D, N]`` followed by V token-major ``[N, D]``; ``amx``/``vec16``/``neon``
  differ). We do not guess it: ``probe_cpu_attn`` writes tagged values through vLLM's own cache-write op
  (``ops.cpu_attn_reshape_and_cache``, exactly what the backend's ``do_kv_cache_update`` calls) into a
  one-block scratch page with the same ISA, and reads back where every (head, token, dim) of K and V landed.
* ``FLASH_ATTN`` / ``TRITON_ATTN``: their forward does ``kv_cache.transpose(1, 2).split(D, dim=-1)``: per
  token and head, C = K (first D) || V (last D).

Either way the result is a strided view per K/V, ``[B, H, N, D]`` (or ``[B, H, N, D/p, p]`` for packings
that interleave p dims), so extraction is one gather per layer. Anything else is refused loudly (a silently
wrong split would ship garbage KV). The scheduler's block size may be a multiple of the kernel block size;
manager block ``b`` is kernel blocks ``b * ratio ..`` (vllm.v1.kv_cache_interface.group_kernel_blocks).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


class UnsupportedKVLayout(NotImplementedError):
    pass


@dataclass(frozen=True)
class PageView:
    """Where one of K/V lives in a page, in elements of the logical [B, H, N, C] tensor.

    Element (h, n, d) of block b is at ``b * stride(0) + offset + h * head_stride + n * token_stride +
    sum(d_i * dim_strides[i])`` with d unravelled over ``dim_shape`` (``(D,)`` or ``(D // p, p)``).
    ``head_stride``/``token_stride``/``offset`` None mean: take the layer tensor's own H/N strides
    (``layer.stride(1)``, ``layer.stride(2)``) and ``offset`` in units of ``layer.stride(3)``.
    """

    offset: int
    token_stride: int | None
    dim_shape: tuple[int, ...]
    dim_strides: tuple[int, ...] | None  # None: (layer.stride(3),)


@dataclass(frozen=True)
class PagedKVLayout:
    backend: str
    num_kv_heads: int       # heads held by this rank
    head_dim: int
    dtype: torch.dtype      # KV cache dtype
    block_size: int         # the scheduler's (KV manager's) block size: block_ids are in these units
    kernel_block_size: int  # N of the per-layer tensor
    k: PageView
    v: PageView

    @property
    def ratio(self) -> int:
        return self.block_size // self.kernel_block_size

    def check(self, layer: torch.Tensor) -> None:
        B, H, N, C = layer.shape
        expect = (self.num_kv_heads, self.kernel_block_size, 2 * self.head_dim)
        if (H, N, C) != expect or layer.dtype != self.dtype:
            raise UnsupportedKVLayout(
                f"KV cache tensor {tuple(layer.shape)} {layer.dtype} does not match the derived layout "
                f"[B, {expect[0]}, {expect[1]}, {expect[2]}] {self.dtype} ({self.backend})"
            )

    def _view(self, layer: torch.Tensor, pv: PageView) -> torch.Tensor:
        s0, s1, s2, s3 = layer.stride()
        token_stride = s2 if pv.token_stride is None else pv.token_stride
        dim_strides = (s3,) if pv.dim_strides is None else pv.dim_strides
        offset = pv.offset * (s3 if pv.token_stride is None else 1)
        return torch.as_strided(layer, (layer.shape[0], layer.shape[1], layer.shape[2], *pv.dim_shape),
                                (s0, s1, token_stride, *dim_strides), layer.storage_offset() + offset)

    def kv_views(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as strided views ``[num_kernel_blocks, H, N, *dim_shape]`` (no copy)."""
        return self._view(layer, self.k), self._view(layer, self.v)

    def token_index(self, block_ids: Sequence[int], num_tokens: int,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel block, offset) of every token 0..num_tokens-1 of a request with these manager blocks.

        On a GPU only the block ids travel (from pinned memory, asynchronously) and the index is computed there:
        a copy from pageable memory would make the host wait for the whole forward before the gather is even
        enqueued (the connector calls this inside vLLM's step, whose host work runs ahead of the device)."""
        need = math.ceil(num_tokens / self.block_size)
        if len(block_ids) < need:
            raise ValueError(f"{num_tokens} tokens need {need} blocks of {self.block_size}, got {len(block_ids)}")
        device = torch.device(device)
        blocks = torch.as_tensor(list(block_ids[:need]), dtype=torch.long)
        if device.type == "cuda":
            blocks = blocks.pin_memory().to(device, non_blocking=True)
        kernel = (blocks[:, None] * self.ratio + torch.arange(self.ratio, device=device)).flatten()
        t = torch.arange(num_tokens, device=device)
        blk = kernel[t // self.kernel_block_size]
        off = t % self.kernel_block_size
        return blk.to(device), off.to(device)

    def gather_layer(self, layer: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
                     out_k: torch.Tensor | None = None,
                     out_v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``[T, H, D]`` K and V of one layer; written straight into ``out_*`` when given (one copy)."""
        k, v = self.kv_views(layer)
        idx = [blk, None, off]  # aten.index: None skips the head dim -> [T, H, *dim_shape]
        T, H = blk.shape[0], self.num_kv_heads
        if out_k is None:
            return k[blk, :, off].reshape(T, H, self.head_dim), v[blk, :, off].reshape(T, H, self.head_dim)
        torch.ops.aten.index.Tensor_out(k, idx, out=out_k.view(T, H, *self.k.dim_shape))
        torch.ops.aten.index.Tensor_out(v, idx, out=out_v.view(T, H, *self.v.dim_shape))
        return out_k, out_v


def _content_split(head_dim: int) -> tuple[PageView, PageView]:
    return (PageView(0, None, (head_dim,), None), PageView(head_dim, None, (head_dim,), None))


# ---------------------------------------------------------------------------------------------------
# CPU_ATTN: probe vLLM's own cache-write op.

_CODE_BASE = {4: 0x3F800000, 2: 0x3C00}  # bit patterns of normal, finite floats (no NaN/subnormal games)
_CODE_BITS = {4: 22, 2: 12}


def _fit_affine(offsets: torch.Tensor) -> tuple[int, int, int, tuple[int, ...], tuple[int, ...]] | None:
    """Fit offsets[h, n, d] = o + h*sh + n*sn + dot(unravel(d, dim_shape), dim_strides)."""
    H, N, D = offsets.shape
    o = int(offsets[0, 0, 0])
    sh = int(offsets[1, 0, 0] - o) if H > 1 else 0
    sn = int(offsets[0, 1, 0] - o) if N > 1 else 0
    h = torch.arange(H)[:, None, None]
    n = torch.arange(N)[None, :, None]
    for p in (1, 2, 4, 8, 16, 32):
        if D % p or (p > 1 and D // p < 1):
            continue
        dim_shape = (D,) if p == 1 else (D // p, p)
        d = torch.arange(D)
        if p == 1:
            sd = (int(offsets[0, 0, 1] - o) if D > 1 else 1,)
            doff = d * sd[0]
        else:
            sd = (int(offsets[0, 0, p] - o), int(offsets[0, 0, 1] - o))
            doff = (d // p) * sd[0] + (d % p) * sd[1]
        if torch.equal(offsets, o + h * sh + n * sn + doff[None, None, :]):
            return o, sh, sn, dim_shape, sd
    return None


def probe_cpu_attn(num_kv_heads: int, kernel_block_size: int, head_dim: int, dtype: torch.dtype, isa: str,
                   write: Callable[..., None] | None = None) -> tuple[PageView, PageView]:
    """Where vLLM's CPU cache-write op puts K[h, n, d] and V[h, n, d] inside one block page."""
    if write is None:
        from vllm import _custom_ops as ops

        def write(key, value, key_cache, value_cache, slots):
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa,
                                           k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    H, N, D = num_kv_heads, kernel_block_size, head_dim
    elt = torch.empty((), dtype=dtype).element_size()
    if elt not in _CODE_BASE:
        raise UnsupportedKVLayout(f"cannot probe a {dtype} KV cache (quantized KV caches are not supported)")
    int_dtype = {4: torch.int32, 2: torch.int16}[elt]
    bits = _CODE_BITS[elt]
    total = H * N * D
    codes = torch.arange(total, dtype=torch.int64).view(N, H, D)  # code of (token n, head h, dim d)
    pieces = [codes & ((1 << bits) - 1)] + ([codes >> bits] if total > (1 << bits) else [])
    if total >= 1 << (bits * len(pieces)):
        raise UnsupportedKVLayout(f"page of {total} elements too large to probe")

    def where(which: str) -> torch.Tensor:
        found = torch.zeros(H * N * 2 * D, dtype=torch.int64)
        for i, piece in enumerate(pieces):
            tagged = (piece + _CODE_BASE[elt]).to(int_dtype).view(dtype)
            zero = torch.zeros_like(tagged)
            page = torch.zeros(1, H, N, 2 * D, dtype=dtype)
            kv = page.view(1, H, 2 * N, D)  # the backend's own K/V cache views (cpu_attn.py)
            key_cache, value_cache = kv.chunk(2, dim=2)
            key, value = (tagged, zero) if which == "k" else (zero, tagged)
            write(key, value, key_cache, value_cache, torch.arange(N))
            raw = page.view(int_dtype).flatten().to(torch.int64)
            hit = raw != 0
            found[hit] += (raw[hit] - _CODE_BASE[elt]) << (bits * i)
            if i == 0:
                present = hit
        positions = present.nonzero().flatten()
        code_at = found[positions]
        if positions.numel() != total or not torch.equal(code_at.sort().values, torch.arange(total)):
            raise UnsupportedKVLayout(f"CPU_ATTN ({isa}) cache write is not a permutation of the {which.upper()} "
                                      "values; cannot derive its layout")
        offsets = torch.empty(total, dtype=torch.int64)
        offsets[code_at] = positions
        return offsets.view(N, H, D).permute(1, 0, 2)  # [H, N, D] offsets in a contiguous [H, N, 2D] page

    views = []
    for which in ("k", "v"):
        offsets = where(which)
        fit = _fit_affine(offsets)
        if fit is None or fit[1] != N * 2 * D:
            raise UnsupportedKVLayout(f"CPU_ATTN ({isa}) {which.upper()} packing is not a strided view; "
                                      "add a gather for it in expresslane.engine.kv_layout")
        o, _, sn, dim_shape, sd = fit
        views.append(PageView(o, sn, dim_shape, sd))
    return views[0], views[1]


def derive_paged_layout(backend_name: str, *, num_kv_heads: int, head_dim: int, head_dim_v: int | None,
                        dtype: torch.dtype, block_size: int, layer: torch.Tensor,
                        cpu_isa: str | None = None) -> PagedKVLayout:
    """Build the layout for ``backend_name`` and check it against a real per-layer KV tensor."""
    if head_dim_v not in (None, head_dim):
        raise UnsupportedKVLayout(f"K head size {head_dim} != V head size {head_dim_v} is not supported")
    if layer.dim() != 4:
        raise UnsupportedKVLayout(f"expected a 4D [B, H, N, C] per-layer KV view, got {tuple(layer.shape)}")
    kernel_block_size = layer.shape[2]
    if block_size % kernel_block_size:
        raise UnsupportedKVLayout(f"kernel block size {kernel_block_size} does not divide block size {block_size}")
    if backend_name == "CPU_ATTN":
        if cpu_isa is None:
            raise ValueError("CPU_ATTN needs the ISA its metadata builder picked (cpu_isa)")
        H, N, C = layer.shape[1:]
        if layer.stride()[1:] != (N * C, C, 1):
            raise UnsupportedKVLayout(f"CPU_ATTN page is not contiguous per block (strides {layer.stride()})")
        k, v = probe_cpu_attn(num_kv_heads, kernel_block_size, head_dim, dtype, cpu_isa)
    elif backend_name in ("FLASH_ATTN", "TRITON_ATTN"):
        k, v = _content_split(head_dim)
    else:
        raise UnsupportedKVLayout(
            f"expresslane does not know how attention backend {backend_name} stores K and V in a page "
            "(known: CPU_ATTN, FLASH_ATTN, TRITON_ATTN). Select one of those with --attention-backend, or "
            "teach expresslane.engine.kv_layout the backend's split, with a test."
        )
    layout = PagedKVLayout(backend_name, num_kv_heads, head_dim, dtype, block_size, kernel_block_size, k, v)
    layout.check(layer)
    return layout


def dense_from_paged(layers: Sequence[torch.Tensor], layout: PagedKVLayout, block_ids: Sequence[int],
                     num_tokens: int, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K and V ``[num_layers, num_tokens, num_kv_heads, head_dim]`` of one request.

    ``layers`` are the per-layer paged tensors in model layer order, ``block_ids`` the request's manager
    block ids (one KV cache group). With ``out`` the result is written into those tensors (same device).
    """
    device = layers[0].device
    blk, off = layout.token_index(block_ids, num_tokens, device)
    shape = (len(layers), num_tokens, layout.num_kv_heads, layout.head_dim)
    if out is None:
        out = (torch.empty(shape, dtype=layout.dtype, device=device),
               torch.empty(shape, dtype=layout.dtype, device=device))
    k_out, v_out = out
    for i, layer in enumerate(layers):
        layout.gather_layer(layer, blk, off, k_out[i], v_out[i])
    return k_out, v_out


def layer_index(layer_name: str) -> int:
    """Model layer index from a vLLM attention layer name (``model.layers.3.self_attn.attn`` -> 3)."""
    nums = [int(p) for p in layer_name.split(".") if p.isdigit()]
    if len(nums) != 1:
        raise ValueError(f"cannot find a single layer index in {layer_name!r}")
    return nums[0]
