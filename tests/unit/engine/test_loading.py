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
