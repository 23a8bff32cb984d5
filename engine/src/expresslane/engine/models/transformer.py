"""Batch-1 decoder (Llama / Qwen2 / Qwen3) over a caller-owned static KV cache.

Activations are [T, hidden] (no batch dimension: the express lane serves one user). Q/K/V and gate/up are
fused into one matmul each. The KV cache is passed in per layer as [max_seq_len, num_kv_heads, head_dim]
views; the forward writes the new keys/values in place at `input_pos` and attends over the first `kv_len`
cache rows the step's `StepContext` allows (models/attention.py: live rows only, or the whole cache with a
mask / the split-KV kernel for fixed shapes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import StepContext, attend
from .config import ModelConfig
from .rope import apply_rope


def _linear(mod: nn.Linear, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """The step's projection: the module's own, or the step's row-invariant kernel (StepContext.linear)."""
    return mod(x) if ctx.linear is None else ctx.linear(x, mod.weight, mod.bias)


class RMSNorm(nn.Module):
    """HF semantics: normalize in float32, cast back, then scale by the weight in the model dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.shape = (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; same math when nothing is cast
            return F.rms_norm(x, self.shape, self.weight, eps=self.eps)
        return self.weight * F.rms_norm(x.float(), self.shape, eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_qk_heads = cfg.num_heads + cfg.num_kv_heads
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        # Qwen3: per-head RMSNorm of q and k, applied to q and k together with a per-head weight
        # [num_heads + num_kv_heads, head_dim] (rows of q_norm.weight, then rows of k_norm.weight).
        self.eps = cfg.rms_norm_eps
        self.qk_norm_weight = (
            nn.Parameter(torch.ones(self.num_qk_heads, cfg.head_dim)) if cfg.qk_norm else None
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        input_pos: torch.Tensor,
        ctx: StepContext,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = _linear(self.qkv_proj, x, ctx).view(t, self.num_qk_heads + self.num_kv_heads, self.head_dim)
        qk, v = qkv[:, : self.num_qk_heads], qkv[:, self.num_qk_heads :]
        if self.qk_norm_weight is not None:
            qk = self.qk_norm_weight * F.rms_norm(qk.float(), (self.head_dim,), eps=self.eps).to(qk.dtype)
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        k_cache.index_copy_(0, input_pos, k)
        v_cache.index_copy_(0, input_pos, v)
        out = attend(q, k_cache, v_cache, ctx, self.scale)
        return _linear(self.o_proj, out.reshape(t, -1), ctx)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        gate, up = _linear(self.gate_up_proj, x, ctx).split(self.intermediate, dim=-1)
        return _linear(self.down_proj, F.silu(gate) * up, ctx)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, k_cache, v_cache, input_pos, ctx: StepContext):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, input_pos, ctx)
        return x + self.mlp(self.post_attention_layernorm(x), ctx)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        ctx: StepContext,
        num_logits: int = 0,
    ) -> torch.Tensor:
        """tokens, input_pos: [T]; cos/sin: [T, head_dim] rows for input_pos. Returns float32 logits of the
        LAST position, shape [vocab] (num_logits=0), or of the last num_logits positions, [num_logits, vocab]."""
        x = self.embed_tokens(tokens)
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            x = layer(x, cos, sin, k_cache, v_cache, input_pos, ctx)
        h = self.norm(x[-num_logits:] if num_logits else x[-1])
        if ctx.linear is None or num_logits:
            return _linear(self.lm_head, h, ctx).float()
        return _linear(self.lm_head, h[None], ctx)[0].float()
