"""Small random Llama / Qwen2 / Qwen3 checkpoints built with transformers, with large top-1 margins."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512
EOS = 7

# Each kind exercises something different: llama3 RoPE scaling + untied head; Qwen2 qkv bias + tied
# embeddings; Qwen3 per-head q/k norm + head_dim != hidden / heads.
KINDS = {
    "llama": dict(
        cls="LlamaConfig",
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "qwen2": dict(cls="Qwen2Config", tie_word_embeddings=True),
    "qwen3": dict(cls="Qwen3Config", head_dim=32),
}


def build_model(out_dir: Path, kind: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Save a random model of `kind` into out_dir and return the transformers model (eval, float32)."""
    import transformers

    spec = dict(KINDS[kind])
    cfg_cls = getattr(transformers, spec.pop("cls"))
    cfg = cfg_cls(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=EOS,
        bos_token_id=1, pad_token_id=0, initializer_range=0.2, **spec,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        # Large logits -> large top-1 margins, so argmax cannot flip on summation-order rounding.
        model.get_output_embeddings().weight.mul_(4.0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.to(dtype).save_pretrained(out_dir)
    return model


