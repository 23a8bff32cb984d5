"""Write a random-weight bf16 checkpoint with a real model's shapes (decode speed does not depend on the
values). Used by scripts/gpu_speed.sh and scripts/gpu_stack.py; on a GPU the init takes seconds, the write ~20 s
for 8B. The directory also gets a tokenizer (write_tokenizer) so stock vLLM's OpenAI server and the router serve
it; an existing checkpoint without one gets it added.

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
VOCAB_SIZE = 128256


def write_tokenizer(out: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """A word-level tokenizer over the whole vocabulary: id i is the word ``t<i>`` (ids 1 and 2 are bos / eos, as
    LlamaConfig's defaults say). Prompts are sent as token ids (scripts/bench.py), so it only has to decode: every
    id decodes to its own word, and a stream's every token carries text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                                   model_max_length=131072, clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out))


def main() -> None:
    shape, out = sys.argv[1], Path(sys.argv[2])
    if (out / "config.json").exists():
        if not (out / "tokenizer.json").exists():
            write_tokenizer(out)
            print(f"{out} exists; tokenizer added")
        else:
            print(f"{out} exists")
        return
    cfg = LlamaConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
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
    write_tokenizer(out)
    print(f"random {shape}-shaped bf16 checkpoint in {out}")


if __name__ == "__main__":
    main()
