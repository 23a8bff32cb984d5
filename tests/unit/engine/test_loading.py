"""Checkpoint loading: sharded indexes, half precision, and loud failures."""

from __future__ import annotations

import json

import pytest
import torch

from expresslane.engine.decode import DecodeEngine, SamplingParams
from expresslane.engine.models import UnsupportedModelError

from ._models import build_model

PROMPT = [5, 9, 200, 31, 77, 4, 18]


def test_sharded_checkpoint_loads_identically(tmp_path):
    model = build_model(tmp_path / "one", "qwen3")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a = DecodeEngine.from_pretrained(tmp_path / "one", max_seq_len=64)
    b = DecodeEngine.from_pretrained(tmp_path / "sharded", max_seq_len=64)
    assert torch.equal(a.prefill(PROMPT), b.prefill(PROMPT))


def test_a_random_shape_in_memory_is_the_checkpoint_the_script_writes(tmp_path):
    """The decode bench's --random-shape builds decode/shapes.py's random checkpoint in memory; the servers read
    the same one from disk (scripts/gpu_make_shape_model.py). Same weights, same engine: equal logits and
    tokens. The in-memory load is as strict as the load from disk."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from expresslane.engine.decode.shapes import random_checkpoint

    repo = Path(__file__).resolve().parents[3]
    # the script builds on a GPU where it sees one; the weights here are the CPU's (another generator)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, str(repo / "scripts" / "gpu_make_shape_model.py"), "tiny", str(tmp_path)],
                   check=True, capture_output=True, timeout=300, env=env)
    disk = DecodeEngine.from_pretrained(tmp_path, dtype="bfloat16", max_seq_len=64, speculation=None)
    config, tensors = random_checkpoint("tiny")
    memory = DecodeEngine.from_checkpoint_tensors(config, tensors, dtype="bfloat16", max_seq_len=64,
                                                  speculation=None)
    assert not tensors  # taken over by the engine's model
    assert disk.config == memory.config
    assert torch.equal(disk.prefill(PROMPT), memory.prefill(PROMPT))
    runs = [list(e.generate(PROMPT[-1], len(PROMPT), SamplingParams(max_tokens=12, ignore_eos=True)))
            for e in (disk, memory)]
    assert runs[0] == runs[1]
    config, tensors = random_checkpoint("tiny")
    tensors.pop("model.layers.1.mlp.down_proj.weight")
    with pytest.raises(KeyError, match="down_proj"):
        DecodeEngine.from_checkpoint_tensors(config, tensors, max_seq_len=64)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(tmp_path, dtype):
    build_model(tmp_path, "llama")
    ref = DecodeEngine.from_pretrained(tmp_path, dtype="float32", max_seq_len=64)
    half = DecodeEngine.from_pretrained(tmp_path, dtype=dtype, max_seq_len=64)
    assert half.cache.k.dtype == getattr(torch, dtype)
    lr, lh = ref.prefill(PROMPT), half.prefill(PROMPT)
    assert lh.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(lr, lh, dim=0) > 0.99
    toks = list(half.generate(int(lh.argmax()), len(PROMPT), SamplingParams(max_tokens=8, ignore_eos=True)))
    assert len(toks) == 8


def test_unsupported_architecture_fails_loudly(tmp_path):
    build_model(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "mixtral"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="mixtral"):
        DecodeEngine.from_pretrained(tmp_path)


def test_missing_tensor_fails_loudly(tmp_path):
    from safetensors.torch import load_file, save_file

    build_model(tmp_path, "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match="up_proj"):
        DecodeEngine.from_pretrained(tmp_path)


def test_eos_ids_come_from_config_and_generation_config(tmp_path):
    build_model(tmp_path, "qwen2")
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen["eos_token_id"] = [7, 11]
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    engine = DecodeEngine.from_pretrained(tmp_path, max_seq_len=64)
    assert set(engine.eos_token_ids) == {7, 11}
    engine.prefill(PROMPT)
    assert list(engine.generate(11, len(PROMPT), SamplingParams(max_tokens=5))) == [11]
