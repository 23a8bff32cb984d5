"""The row-invariant verify at the real shapes, on a GPU in bf16: Llama-3.2-1B (hidden 2048, 16 layers, head dim
64) and Llama-3.1-8B (hidden 4096, 32 layers, head dim 128), random weights. Each row of a verify of R rows has
the one-row step's logits bit for bit at its position, at positions on both sides of the split-KV attention's
chunk boundaries (a row's splits are those of its own length: chunk = ceil(ceil(len / splits) / 64) * 64, so the
chunk grows at every multiple of splits * 64, 2,048 at 8 KV heads on an H200), for both GEMV families and both
verify attentions, and the tensor-core family with its norms as the residual kernels' tails, with and without its
weights' L2 prefetch (models/lean.py).

The block shapes are each kernel's first fitting candidate (and, for the CUDA-core family, its first
packed one: fused._fma), not the engine's timed picks (timing them would take
a minute a shape and family); bit-identity holds for any one shape that the one-row step and the verify share,
which is what the small-shape tests check with the timed picks (test_fused_kernels.py), and the GPU check's
oracle runs at these shapes check end to end (every draft kept, every token the plain run's)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the real shapes run on a GPU")


def random_model(shape: str, device: torch.device):
    """decode/shapes.py's random bf16 checkpoint of `shape` (the weights the decode bench measures: lm_head x16
    for real models' top-1 margins) as the engine's Transformer on `device`."""
    from expresslane.engine.decode.shapes import random_checkpoint
    from expresslane.engine.models.config import ModelConfig
    from expresslane.engine.models.loader import model_from_tensors

    config, tensors = random_checkpoint(shape, device)
    return model_from_tensors(ModelConfig.from_dict(config), tensors, torch.bfloat16, device)


@pytest.fixture
def first_fitting_picks(monkeypatch):
    """Each kernel's first fitting candidate, of the packed block shapes (fused._fma) or of the others as
    `packed(on)` says (the picks made so far forgotten)."""
    from expresslane.engine.models import fused, fused_dot

    real = fused.pick_config
    state = {"packed": False}

    def first(name, n, k, candidates, launch, max_block_rows=None, restore=None, device=None, config=None, rows=1,
              spills=None, compile=None, dtype=None, many=None):
        cands = [c for c in candidates if bool(fused._pack(c)) == state["packed"]] or list(candidates)
        return real(name, n, k, cands, launch, max_block_rows=max_block_rows, config=config, rows=rows,
                    dtype=dtype)

    monkeypatch.setattr(fused, "pick_config", first)
    monkeypatch.setattr(fused_dot, "pick_config", first)
    monkeypatch.setattr(fused, "_PICKED", {})

    def packed(on: bool) -> None:
        state["packed"] = on
        fused._PICKED.clear()
    return packed


@pytest.mark.parametrize("shape", ["llama-1b", "llama-8b"])
def test_each_verify_row_is_the_one_row_step_at_the_real_shapes(shape, first_fitting_picks):
    from expresslane.engine.models.lean import LeanStep
    from expresslane.engine.models.rope import rope_tables
    from expresslane.engine.models.triton_decode import num_splits_for

    dev = torch.device("cuda")
    model = random_model(shape, dev)
    cfg = model.config
    boundary = num_splits_for(cfg.num_kv_heads, dev) * 64  # where a row's chunk grows
    s = boundary + 80
    cos, sin = rope_tables(cfg.rope, cfg.head_dim, s, torch.bfloat16, dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    shape_kv = (cfg.num_layers, s, cfg.num_kv_heads, cfg.head_dim)
    k = torch.randn(shape_kv, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(shape_kv, device=dev, dtype=torch.bfloat16, generator=gen)
    k1, v1 = k.clone(), v.clone()
    tokens = torch.tensor([11, 3, 90, 42, 7], device=dev)
    cases = [("cuda-core", "kernel", "per-row", False, False), ("cuda-core", "kernel", "shared", False, False),
             ("cuda-core", "kernel", "per-row", False, True),
             ("tensor-core", "kernel", "per-row", False, False), ("tensor-core", "kernel", "shared", False, False),
             ("tensor-core", "tail", "per-row", False, False), ("tensor-core", "tail", "per-row", True, False)]
    for gemv, norm, attn, l2, packed in cases:
        first_fitting_picks(packed)
        verify = LeanStep(model, cos, sin, list(k.unbind(0)), list(v.unbind(0)), max_rows=5, gemv=gemv)
        one = LeanStep(model, cos, sin, list(k1.unbind(0)), list(v1.unbind(0)), max_rows=5, gemv=gemv)
        for step in (verify, one):
            step.set_norm(norm)
            step.set_l2_prefetch(l2)
        verify.set_verify_attention(attn)
        for rows, pos in [(5, boundary - 3), (2, boundary - 1), (3, boundary), (5, boundary + 60), (4, 37)]:
            with torch.no_grad():
                got = verify.forward(tokens[:rows], torch.tensor([pos], device=dev)).clone()
                want = [one.forward(tokens[r:r + 1], torch.tensor([pos + r], device=dev)).clone()
                        for r in range(rows)]
            torch.cuda.synchronize()
            for r in range(rows):
                assert torch.equal(got[r], want[r][0]), (shape, gemv, norm, attn, l2, packed, rows, pos, r)
        assert torch.equal(k, k1) and torch.equal(v, v1), (shape, gemv, attn)  # the same K/V rows written
