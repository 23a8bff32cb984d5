#!/usr/bin/env python3
"""Write a deterministic tiny Llama-family checkpoint for tests and local stacks (no network).

    python scripts/make_tiny_model.py OUTDIR [--dtype float32|bfloat16] [--seed 0] [--force]

OUTDIR receives a directory that transformers (AutoModelForCausalLM/AutoTokenizer) and stock vLLM load:

  config.json                LlamaForCausalLM: 4 layers, hidden 256, 8 heads / 4 KV heads (head_dim 32),
                             intermediate 688, vocab 1024, 8192 positions, rope_theta 10000
  model.safetensors          the weights (see "Weights" below)
  generation_config.json     bos/eos ids
  tokenizer.json             byte-level BPE (any text tokenizes), trained on scripts/bench_lib/tiny_model_corpus.txt,
  tokenizer_config.json      vocab exactly 1024 including the special tokens; ChatML chat_template
                             that also renders `tools` (hermes <tool_call> format, as Qwen2.5)
  expresslane_tiny_model.json  marker: generator version, seed, dtype, corpus hash, file hashes

Same arguments (and the same corpus) give byte-identical model.safetensors and tokenizer.json. When OUTDIR
already holds a matching marker and files, the script exits 0 without rewriting anything (use --force to
rebuild). A non-empty OUTDIR that this script did not write is refused unless --force is given.

Weights. Random Llama weights at the usual 0.02 scale give nearly flat logits, so greedy argmax flips on
rounding differences between engines (FACTS.md). This model is built for exactness tests instead:
  * unit-norm lm_head rows scaled so the logits' spread is tens of units: the typical top-1 vs top-2 gap is
    several units, far above float32 rounding differences between engines (~1e-4 here). bfloat16 errors
    scale with the logits, so run exactness tests in float32 (the default);
  * equal row norms, so no token is a "hub" that wins for every input, and greedy output is varied;
  * attention/MLP scaled so their contribution to the residual stream is comparable to the token embedding:
    greedy continuations depend on the context (the KV cache), not only on the last token, so a corrupted or
    misplaced KV cache changes the output;
  * the lm_head rows of the special tokens (EOS included), of control characters and of byte tokens that
    are not valid UTF-8 on their own are zero: their logit is always 0 while the top logit is tens of
    units, so greedy decoding never emits them. Generations run to max_tokens and decode to clean text;
    stop-on-EOS is tested with stop_token_ids instead.

Imports only the stdlib, torch, safetensors, tokenizers and transformers (all present in the vLLM image).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

# Single-threaded tokenizer training (determinism) and modest CPU use; must precede importing tokenizers.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

GENERATOR = "expresslane-tiny-llama"
# Bump whenever the output for a given (seed, dtype, corpus) changes, so cached directories are rebuilt.
GENERATOR_VERSION = 1
MARKER = "expresslane_tiny_model.json"
DEFAULT_CORPUS = Path(__file__).resolve().parent / "bench_lib" / "tiny_model_corpus.txt"

VOCAB_SIZE = 1024
HIDDEN = 256
LAYERS = 4
HEADS = 8
KV_HEADS = 4
HEAD_DIM = HIDDEN // HEADS  # 32
INTERMEDIATE = 688  # ~ 8/3 * hidden, rounded up to a multiple of 16
MAX_POSITIONS = 8192
ROPE_THETA = 10000.0
RMS_EPS = 1e-5

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END, PAD]  # ids 0..4, in this order
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID = range(len(SPECIAL_TOKENS))

# ChatML; bos_token first because chat prompts are tokenized without add_special_tokens. With `tools`, the
# hermes format Qwen2.5's template uses (what vLLM's `--tool-call-parser hermes` parses): the tool signatures in
# a <tools></tools> system block, assistant tool calls as <tool_call>{"name", "arguments"}</tool_call>, tool results
# as <tool_response> blocks in a user turn. Without tools and tool messages the rendering is plain ChatML, as before.
_TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '" + _TOOLS_SYSTEM + "' }}"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '" + _TOOLS_FORMAT.replace("'", "\\'") + "' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\n' + message['content'] }}{% endif %}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% if tool_call['function'] is defined %}{% set tool_call = tool_call['function'] %}{% endif %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}"
    "{% if tool_call['arguments'] is string %}{{ tool_call['arguments'] }}"
    "{% else %}{{ tool_call['arguments'] | tojson }}{% endif %}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Weight scales (see module docstring). LOGIT_SCALE is the norm of each lm_head row; the final RMSNorm makes
# the last hidden state's norm sqrt(HIDDEN), and a random direction's cosine with it has std 1/sqrt(HIDDEN),
# so logits have standard deviation ~LOGIT_SCALE and the top-1 vs top-2 gap averages ~0.3 * LOGIT_SCALE.
EMBED_STD = 1.0
ATTN_QK_STD = 2.0 / HIDDEN**0.5  # peaked-ish attention so positions matter
ATTN_VO_STD = 1.0 / HIDDEN**0.5
MLP_IN_STD = 1.0 / HIDDEN**0.5
MLP_OUT_STD = 1.0 / INTERMEDIATE**0.5
LOGIT_SCALE = 32.0

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(corpus: Path):
    """Byte-level BPE with exactly VOCAB_SIZE entries (special tokens first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    # Add BOS like Llama 3 does; ByteLevel offsets handling.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A",
                pair=f"{BOS} $A {BOS} $B",
                special_tokens=[(BOS, BOS_ID)],
            ),
        ]
    )
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"tokenizer vocab is {tok.get_vocab_size()}, want {VOCAB_SIZE}: corpus {corpus} is too small"
        )
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name} got id {tok.token_to_id(name)}, want {i}")
    return tok


def save_tokenizer(tok, outdir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(outdir))
    # Keep the template in tokenizer_config.json (what older loaders read), not only chat_template.jinja.
    cfg_path = outdir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    # transformers 5 writes its new class name; the old alias loads in transformers 4 and 5 alike.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    jinja = outdir / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()


def unusable_output_ids(tok) -> list[int]:
    """Token ids greedy decoding must never produce: specials, control characters, and byte tokens that are
    not valid UTF-8 on their own (so every greedy prefix detokenizes cleanly)."""
    byte_of = _bytelevel_decoder_table()
    bad = list(range(len(SPECIAL_TOKENS)))
    for token, idx in tok.get_vocab().items():
        if idx < len(SPECIAL_TOKENS):
            continue
        try:
            text = bytes(byte_of[c] for c in token).decode("utf-8")
        except (UnicodeDecodeError, KeyError):
            bad.append(idx)
            continue
        if any(ord(c) < 32 and c not in "\n\t" or ord(c) == 127 for c in text):
            bad.append(idx)  # control characters other than newline and tab
    return sorted(bad)


def _bytelevel_decoder_table() -> dict[str, int]:
    # GPT-2's byte <-> printable unicode mapping (what ByteLevel uses).
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


# ----------------------------------------------------------------------------------------------- weights


def build_weights(seed: int, bad_ids: list[int]):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)

    def normal(shape, std):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    sd = {"model.embed_tokens.weight": normal((VOCAB_SIZE, HIDDEN), EMBED_STD)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = normal((HEADS * HEAD_DIM, HIDDEN), ATTN_QK_STD)
        sd[p + "self_attn.k_proj.weight"] = normal((KV_HEADS * HEAD_DIM, HIDDEN), ATTN_QK_STD)
        sd[p + "self_attn.v_proj.weight"] = normal((KV_HEADS * HEAD_DIM, HIDDEN), ATTN_VO_STD)
        sd[p + "self_attn.o_proj.weight"] = normal((HIDDEN, HEADS * HEAD_DIM), ATTN_VO_STD)
        sd[p + "mlp.gate_proj.weight"] = normal((INTERMEDIATE, HIDDEN), MLP_IN_STD)
        sd[p + "mlp.up_proj.weight"] = normal((INTERMEDIATE, HIDDEN), MLP_IN_STD)
        sd[p + "mlp.down_proj.weight"] = normal((HIDDEN, INTERMEDIATE), MLP_OUT_STD)
        sd[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    sd["model.norm.weight"] = torch.ones(HIDDEN)
    head = normal((VOCAB_SIZE, HIDDEN), 1.0)
    head = head / head.norm(dim=1, keepdim=True) * LOGIT_SCALE
    head[bad_ids] = 0.0
    sd["lm_head.weight"] = head
    return sd


def save_weights(sd, outdir: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file

    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    out = {k: v.to(tdtype).contiguous() for k, v in sorted(sd.items())}
    save_file(out, str(outdir / "model.safetensors"), metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------------ config


def model_config(dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POSITIONS,
        "mlp_bias": False,
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "pretraining_tp": 1,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }


def generation_config() -> dict:
    return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False}


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------------------ driver


def wanted_marker(seed: int, dtype: str, corpus: Path) -> dict:
    return {
        "generator": GENERATOR,
        "version": GENERATOR_VERSION,
        "seed": seed,
        "dtype": dtype,
        "corpus_sha256": _sha256(corpus),
        # Any edit to this script invalidates cached directories, even if GENERATOR_VERSION was not bumped.
        "script_sha256": _sha256(Path(__file__).resolve()),
    }


def read_marker(outdir: Path) -> dict | None:
    try:
        return json.loads((outdir / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_up_to_date(outdir: Path, want: dict) -> bool:
    have = read_marker(outdir)
    if not have or any(have.get(k) != v for k, v in want.items()):
        return False
    return all((outdir / f).is_file() for f in FILES)


def generate(outdir: Path, seed: int = 0, dtype: str = "float32", corpus: Path = DEFAULT_CORPUS) -> dict:
    """Write the model into outdir (created if needed; files replaced). Returns the marker written."""
    import torch

    torch.manual_seed(seed)
    outdir.mkdir(parents=True, exist_ok=True)
    want = wanted_marker(seed, dtype, corpus)
    with tempfile.TemporaryDirectory(prefix=".tiny-model-", dir=str(outdir)) as tmp_name:
        tmp = Path(tmp_name)
        tok = train_tokenizer(corpus)
        save_tokenizer(tok, tmp)
        save_weights(build_weights(seed, unusable_output_ids(tok)), tmp, dtype)
        _write_json(tmp / "config.json", model_config(dtype))
        _write_json(tmp / "generation_config.json", generation_config())
        (outdir / MARKER).unlink(missing_ok=True)  # a half-replaced dir must never look complete
        for f in sorted(tmp.iterdir()):
            f.chmod(0o644)  # readable by a container's non-root user when mounted
            os.replace(f, outdir / f.name)
    marker = dict(want)
    marker["files_sha256"] = {f: _sha256(outdir / f) for f in FILES}
    marker["note"] = "written by scripts/make_tiny_model.py; random weights shaped for exactness tests"
    _write_json(outdir / MARKER, marker)
    return marker


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if OUTDIR is up to date / not ours")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    outdir: Path = args.outdir
    want = wanted_marker(args.seed, args.dtype, args.corpus)
    if not args.force:
        if is_up_to_date(outdir, want):
            print(f"{outdir}: up to date (seed={args.seed}, dtype={args.dtype}), nothing to do")
            return 0
        if outdir.is_dir() and any(outdir.iterdir()) and (read_marker(outdir) or {}).get("generator") != GENERATOR:
            print(f"{outdir}: not empty and not written by this script; use --force to overwrite", file=sys.stderr)
            return 2
    generate(outdir, seed=args.seed, dtype=args.dtype, corpus=args.corpus)
    print(f"{outdir}: wrote tiny Llama (seed={args.seed}, dtype={args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
