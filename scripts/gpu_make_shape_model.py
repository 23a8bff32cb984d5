"""Write a random-weight bf16 checkpoint with a real model's shapes (decode speed does not depend on the
values), for the servers that read one from disk (scripts/gpu_stack.py, the GPU check's `stack`: stock vLLM and
the express node). On a GPU the init takes seconds, the write ~20 s for 8B. The directory also gets a tokenizer
(write_tokenizer) so stock vLLM's OpenAI server and the router serve it; an existing checkpoint without one gets
it added. The weights are decode/shapes.py's `random_llama`: the decode bench's `--random-shape` builds the same
ones in memory.

    python scripts/gpu_make_shape_model.py {llama-1b|llama-8b|tiny} OUT_DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "src"))

from expresslane.engine.decode.shapes import SHAPES, VOCAB_SIZE, random_llama  # noqa: E402


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES), help="decode/shapes.py's shapes (tiny: seconds on a CPU)")
    ap.add_argument("out", type=Path, help="the checkpoint directory (left as it is where one exists)")
    args = ap.parse_args(argv)
    shape, out = args.shape, args.out
    if (out / "config.json").exists():
        if not (out / "tokenizer.json").exists():
            write_tokenizer(out)
            print(f"{out} exists; tokenizer added")
        else:
            print(f"{out} exists")
        return
    model = random_llama(shape, "cuda" if torch.cuda.is_available() else "cpu")
    model.save_pretrained(out)
    write_tokenizer(out, model.config.vocab_size)
    print(f"random {shape}-shaped bf16 checkpoint in {out}")


if __name__ == "__main__":
    main()
