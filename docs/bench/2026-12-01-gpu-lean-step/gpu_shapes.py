"""What the GPU scripts (gpu_lean.py, gpu_lookup_chain.py) share: the random Llama-shaped bf16 models they
measure, and their JSON-lines result log with a deadline.

Import it after the script has set its environment (gpu_lean.py --smoke-cpu sets TRITON_INTERPRET first).
"""

from __future__ import annotations

import json
import os
import time

import torch

from expresslane.engine.models.config import ModelConfig, RopeConfig
from expresslane.engine.models.transformer import Transformer

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                     head_dim=64, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                     head_dim=128, tie_word_embeddings=False),
}


def make_model(shape: str, device: torch.device) -> Transformer:
    """Random bf16 weights with Llama-3.2-1B / Llama-3.1-8B shapes (or a tiny one), built on `device`; the
    lm_head x16 gives trained models' top-1 margins (scripts/gpu_make_shape_model.py)."""
    cfg = ModelConfig(model_type="llama", vocab_size=512 if shape == "tiny" else 128256, rms_norm_eps=1e-5,
                      max_position_embeddings=131072, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                      rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=8192),
                      **SHAPES[shape])
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Transformer(cfg)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.lm_head.weight.mul_(16.0)
    return model.eval()


class ResultLog:
    """One JSON line per result in OUT/results.jsonl, written (and printed) as soon as it exists, so a timeout
    keeps what was measured; `late` says (and logs) that a part would start past the deadline."""

    def __init__(self, out: str, deadline_s: float, t0: float) -> None:
        os.makedirs(out, exist_ok=True)
        self._file = open(os.path.join(out, "results.jsonl"), "a")
        self.deadline_s, self.t0 = deadline_s, t0

    def emit(self, kind: str, **kw) -> None:
        line = json.dumps({"kind": kind, "t_s": round(time.time() - self.t0, 1), **kw})
        self._file.write(line + "\n")
        self._file.flush()
        print(line, flush=True)

    def late(self, what: str) -> bool:
        if time.time() - self.t0 > self.deadline_s:
            self.emit("skipped", what=what, reason=f"past the {self.deadline_s:.0f} s deadline")
            return True
        return False
