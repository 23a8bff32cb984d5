"""Rotary position embedding tables, computed the way transformers and vLLM compute them.

inv_freq and the angle table are computed in float32, then cos/sin are cast to the model dtype (HF casts
cos/sin to the activation dtype, vLLM stores its cos_sin_cache in the model dtype). Rotation is the
non-interleaved "rotate_half" form used by Llama/Qwen checkpoints.
"""

from __future__ import annotations

import math

import torch

from .config import RopeConfig


def inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    base = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    freq = 1.0 / (rope.theta**base)
    if rope.rope_type == "linear":
        freq = freq / rope.factor
    elif rope.rope_type == "llama3":
        freq = _llama3_scale(freq, rope)
    return freq


def _llama3_scale(freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    rope: RopeConfig, head_dim: int, max_seq_len: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and SIGNED sin tables, [max_seq_len, head_dim] in `dtype` on `device`.

    The signed sin is (-sin, sin) over the two halves, so rotate_half(x) * sin == roll(x, D/2) * signed_sin
    exactly (negation is exact) with one op instead of slice/neg/cat."""
    positions = torch.arange(max_seq_len, dtype=torch.int64).to(torch.float32)
    freqs = positions[:, None] * inv_freq(rope, head_dim)[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    return (torch.cat((cos, cos), dim=-1).to(dtype=dtype, device=device),
            torch.cat((-sin, sin), dim=-1).to(dtype=dtype, device=device))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/signed_sin: [T, D] (from rope_tables)."""
    return x * cos[:, None, :] + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin[:, None, :]
