"""The static KV cache: K and V each [num_layers, seats * max_seq_len, num_kv_heads, head_dim], written in place.

Seat s (one request of a node serving several users, decode/batch.py) owns cache rows [s * max_seq_len,
(s + 1) * max_seq_len): its positions 0 .. max_seq_len - 1. A one-seat cache is the batch-1 engine's."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVGeometry:
    """What a KV producer must match to inject into this engine."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    dtype: torch.dtype
    device: torch.device

    def seat_bytes(self) -> int:
        """Bytes of one seat's K+V (max_seq_len tokens)."""
        return self.token_bytes() * self.max_seq_len

    def token_bytes(self) -> int:
        """Bytes of K+V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


class StaticKVCache:
    def __init__(self, geometry: KVGeometry, seats: int = 1) -> None:
        g = geometry
        if seats < 1:
            raise ValueError(f"seats must be >= 1, got {seats}")
        self.geometry = g
        self.seats = seats
        shape = (g.num_layers, seats * g.max_seq_len, g.num_kv_heads, g.head_dim)
        self.k = torch.zeros(shape, dtype=g.dtype, device=g.device)
        self.v = torch.zeros(shape, dtype=g.dtype, device=g.device)
        # Per-layer views, built once so the forward never indexes the 4-D tensor per step.
        self.k_layers = list(self.k.unbind(0))
        self.v_layers = list(self.v.unbind(0))

    def seat_start(self, seat: int) -> int:
        """The first cache row of `seat`."""
        if not 0 <= seat < self.seats:
            raise ValueError(f"seat {seat} outside [0, {self.seats})")
        return seat * self.geometry.max_seq_len

    def write_prefix(self, k: torch.Tensor, v: torch.Tensor, num_tokens: int, seat: int = 0) -> None:
        """Copy dense [num_layers, >=num_tokens, num_kv_heads, head_dim] K/V into `seat`'s positions
        [0, num_tokens)."""
        g = self.geometry
        expected = (g.num_layers, g.num_kv_heads, g.head_dim)
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 4 or (t.shape[0], t.shape[2], t.shape[3]) != expected:
                raise ValueError(
                    f"injected {name} has shape {tuple(t.shape)}; expected "
                    f"[{g.num_layers}, num_tokens, {g.num_kv_heads}, {g.head_dim}]"
                )
            if t.shape[1] < num_tokens:
                raise ValueError(f"injected {name} holds {t.shape[1]} tokens, fewer than num_tokens={num_tokens}")
        if not 0 < num_tokens < g.max_seq_len:
            raise ValueError(f"num_tokens={num_tokens} must be in [1, max_seq_len={g.max_seq_len})")
        s0 = self.seat_start(seat)
        self.k[:, s0:s0 + num_tokens].copy_(k[:, :num_tokens], non_blocking=True)
        self.v[:, s0:s0 + num_tokens].copy_(v[:, :num_tokens], non_blocking=True)
