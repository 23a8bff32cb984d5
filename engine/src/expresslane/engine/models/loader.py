"""Load HF safetensors checkpoints (single file or sharded index) into the fused Transformer.

Loading is strict: every tensor the model needs must be present and every checkpoint tensor must be used
(except known-unused buffers), so a wrong architecture mapping fails at start-up instead of decoding garbage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig, UnsupportedModelError, check_checkpoint
from .transformer import Transformer

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointLayoutError(UnsupportedModelError, KeyError):
    """A tensor the architecture needs is missing: the checkpoint is not laid out as the engine's mapping expects."""

    def __str__(self) -> str:  # KeyError's str() would quote the message
        return str(self.args[0]) if self.args else ""


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir} (pytorch .bin checkpoints are not supported)")
    return files


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _hf_to_fused(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map HF names (model.layers.N.self_attn.q_proj.weight, ...) to this module's fused parameters."""
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        try:
            return tensors.pop(name)
        except KeyError:
            raise CheckpointLayoutError(f"checkpoint is missing {name!r}: its tensors do not follow the "
                                        f"{cfg.model_type} layout the engine implements") from None

    out["embed_tokens.weight"] = take("model.embed_tokens.weight")
    out["norm.weight"] = take("model.norm.weight")
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        out[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "post_attention_layernorm.weight"] = take(src + "post_attention_layernorm.weight")
        out[dst + "self_attn.qkv_proj.weight"] = torch.cat([take(attn + p + "_proj.weight") for p in "qkv"])
        if cfg.qkv_bias:
            out[dst + "self_attn.qkv_proj.bias"] = torch.cat([take(attn + p + "_proj.bias") for p in "qkv"])
        out[dst + "self_attn.o_proj.weight"] = take(attn + "o_proj.weight")
        if cfg.o_bias:
            out[dst + "self_attn.o_proj.bias"] = take(attn + "o_proj.bias")
        if cfg.qk_norm:
            q_norm, k_norm = take(attn + "q_norm.weight"), take(attn + "k_norm.weight")
            out[dst + "self_attn.qk_norm_weight"] = torch.cat(
                [q_norm.expand(cfg.num_heads, -1), k_norm.expand(cfg.num_kv_heads, -1)]
            )
        out[dst + "mlp.gate_up_proj.weight"] = torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")])
        if cfg.mlp_bias:
            out[dst + "mlp.gate_up_proj.bias"] = torch.cat([take(mlp + "gate_proj.bias"), take(mlp + "up_proj.bias")])
        out[dst + "mlp.down_proj.weight"] = take(mlp + "down_proj.weight")
        if cfg.mlp_bias:
            out[dst + "mlp.down_proj.bias"] = take(mlp + "down_proj.bias")
    leftover = [n for n in tensors if not n.endswith(_IGNORED_SUFFIXES)]
    if leftover:
        raise UnsupportedModelError(f"checkpoint tensors not used by the {cfg.model_type} mapping (an option the "
                                    f"engine does not implement?): {sorted(leftover)[:8]}")
    return out


def load_model(
    model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str
) -> Transformer:
    """The checkpoint's weights in the fused Transformer; UnsupportedModelError (before any tensor is read) for a
    checkpoint the engine cannot serve: its architecture, activation, RoPE type or tensor dtypes."""
    check_checkpoint(model_dir)
    return model_from_tensors(cfg, dict(iter_checkpoint(model_dir)), dtype, device)


def model_from_tensors(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str
) -> Transformer:
    """The fused Transformer over a checkpoint's tensors already in memory ({HF name: tensor}; the dict is
    emptied), as strict as a load from disk."""
    with torch.device("meta"):
        model = Transformer(cfg)
    fused = _hf_to_fused(cfg, tensors)
    state = {name: t.to(device=device, dtype=dtype) for name, t in fused.items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval()
