"""Attention over the static KV cache for T query rows at consecutive positions start_pos .. start_pos+T-1.

One step of the decode engine is T = 1 (plain decode) or T = k + 1 (verification of k drafts); row i may
see cache rows [0, start_pos + i]. Three kernels, chosen per engine (`AttentionKind`):

* ``LIVE`` (CPU default): the live rows only. Eager: one query block as two batched matmuls per KV head
  (GQA: the query heads of one KV head share one matmul, the cache is never expanded); 1.13x PyTorch's CPU
  SDPA at 3800 rows. Under torch.compile: SDPA over the live rows (with a [T, L] mask when T > 1), which
  inductor fuses better than it handles an opaque op beside the in-place cache write (measured: the custom
  op compiled ran at 115 tok/s against 168 for compiled SDPA at 3800 rows); a symbolic `kv_len` serves every
  length.
* ``MASKED`` (fixed shapes): PyTorch SDPA over the whole static cache with a [T, max_seq_len] mask built on
  the device from `start_pos`: CUDA-graph friendly, reads every cache row (the reference path).
* ``SPLIT_KV`` (CUDA default): the flash-decoding Triton kernel in `triton_decode.py`: the length is read on
  the device, the grid is fixed, only live rows are read; CUDA-graph friendly.

Prefill (T rows from position 0) always uses SDPA with `is_causal` (top-left alignment is right when T == L).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    `prefill` marks a causal forward from position 0."""

    kind: AttentionKind
    start_pos: torch.Tensor
    kv_len: int | None = None
    mask: torch.Tensor | None = None
    prefill: bool = False


def live_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: int,
                   scale: float) -> torch.Tensor:
    """q [T, H, D] at positions kv_len-T .. kv_len-1; caches [S, Hkv, D]. Returns [T, H, D]."""
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


def causal_mask(arange: torch.Tensor, start_pos: torch.Tensor, t: int) -> torch.Tensor:
    """[T, S] bool: row i may see cache rows <= start_pos + i (built on the device, fixed shape)."""
    positions = start_pos + arange[:t]
    return arange[None, :] <= positions[:, None]


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext,
           scale: float) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D] (the new K/V rows are already in the cache)."""
    if ctx.prefill:
        return _sdpa(q, k_cache[: q.shape[0]], v_cache[: q.shape[0]], None, True, scale)
    if ctx.kind is AttentionKind.LIVE:
        if not torch.compiler.is_compiling():
            return live_attention(q, k_cache, v_cache, ctx.kv_len, scale)
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
