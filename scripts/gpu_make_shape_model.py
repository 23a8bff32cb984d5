"""Write a random-weight bf16 checkpoint with a real model's shapes (decode speed does not depend on the
values). Used by scripts/gpu_speed.sh; on a GPU the init takes seconds, the write ~20 s for 8B.

    python scripts/gpu_make_shape_model.py {llama-1b|llama-8b} OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    # Llama-3.2-1B
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    # Llama-3.1-8B
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}


LM_HEAD_SCALE = 16.0


def main() -> None:
    shape, out = sys.argv[1], Path(sys.argv[2])
    if (out / "config.json").exists():
        print(f"{out} exists")
        return
    cfg = LlamaConfig(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                      torch_dtype="bfloat16", **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        # Random init gives near-flat logits over 128k tokens: bf16 rounding that differs between a 1-row and
        # a (k+1)-row forward then flips the argmax, and an oracle draft stops matching after the first flip.
        # A larger lm_head gives real models' top-1 margins (speed does not depend on the values).
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(LM_HEAD_SCALE)
    model.save_pretrained(out)
    print(f"random {shape}-shaped bf16 checkpoint in {out}")


if __name__ == "__main__":
    main()
