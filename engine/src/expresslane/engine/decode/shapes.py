"""Random-weight Llama checkpoints with real models' shapes: what the engine's speed is measured on (decode speed
does not depend on the values).

`random_llama(shape, device)` builds transformers' own `LlamaForCausalLM` with its own random init (seed 0) and
the lm_head scaled up, and returns its config and tensors under their checkpoint names. The decode bench
(`--random-shape`) builds an engine from them in memory. `scripts/gpu_make_shape_model.py` writes them as a
checkpoint for the servers that read one from disk (stock vLLM, the express node). Both get the same weights
from the same device.
"""

from __future__ import annotations

import torch

VOCAB_SIZE = 128256
# Random init gives near-flat logits over 128k tokens: bf16 rounding that differs between a 1-row and a (k+1)-row
# forward then flips the argmax, and an oracle draft stops matching after the first flip. A larger lm_head gives
# real models' top-1 margins.
LM_HEAD_SCALE = 16.0

SHAPES = {
    # Llama-3.2-1B
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    # Llama-3.1-8B
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    # the same code path in seconds on a CPU (tests)
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, vocab_size=512),
}


def hf_config(shape: str):
    """transformers' LlamaConfig of a shape (bf16, Llama-3's rope theta and 128k positions)."""
    from transformers import LlamaConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
    kw = dict(vocab_size=VOCAB_SIZE, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
              torch_dtype="bfloat16")
    kw.update(SHAPES[shape])
    return LlamaConfig(**kw)


def random_llama(shape: str, device: str | torch.device = "cpu"):
    """transformers' LlamaForCausalLM of `shape` in bf16, random (seed 0) on `device`, lm_head x LM_HEAD_SCALE."""
    from transformers import LlamaForCausalLM

    cfg = hf_config(shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(LM_HEAD_SCALE)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the float32 init's memory (32 GB at 8B) back to the device
    return model.eval()


def random_checkpoint(shape: str, device: str | torch.device = "cpu") -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json's dict, {checkpoint name: tensor}) of random_llama(shape, device): what its checkpoint
    on disk would hold (a tied lm_head is not a tensor of its own there)."""
    model = random_llama(shape, device)
    tensors = {name: t.detach() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return model.config.to_dict(), tensors
