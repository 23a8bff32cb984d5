#!/usr/bin/env bash
# The express engine's batch-1 decode speed on a CUDA GPU, against the GPU's own copy bandwidth.
#
#   bash docs/bench/2026-12-01-gpu-cuda-graph/gpu_decode_bench.sh [OUTDIR]       # default var/gpu-bench; needs torch with CUDA,
#                                                   # safetensors, tokenizers, transformers (no vLLM, no network)
#
# Two checkpoints, both made here: the tiny test model (scripts/make_tiny_model.py, the CI model) and a
# checkpoint with Llama-3.2-1B's shapes and random bf16 weights (speed does not depend on the values).
# Each runs eager (one launch per kernel), as one CUDA graph per step (the engine's default on CUDA) and as a
# CUDA graph of the torch.compile'd step, through `python -m expresslane.engine.decode.bench`, which prints
# tok/s, the weight bandwidth achieved and the copy-bandwidth bound. The log lands in OUTDIR/gpu-decode.log.
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the repository root (this lab note: docs/bench/<date>-<topic>/)
OUTDIR=${1:-var/gpu-bench}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/engine/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUTDIR" var/models
LOG="$OUTDIR/gpu-decode.log"
: >"$LOG"

"$PY" scripts/make_tiny_model.py var/models/tiny-llama >>"$LOG" 2>&1
"$PY" - var/models/llama-1b-shape-random <<'EOF' >>"$LOG" 2>&1
import sys, torch
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM

out = Path(sys.argv[1])
if not (out / "config.json").exists():
    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=500000.0, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
print(f"random Llama-3.2-1B-shaped checkpoint in {out}")
EOF

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
run() { echo "== $*" | tee -a "$LOG"; "$PY" -m expresslane.engine.decode.bench --device cuda "$@" 2>&1 | tee -a "$LOG"; }
for model in "var/models/tiny-llama --dtype float32" "var/models/llama-1b-shape-random --dtype bfloat16"; do
  for prompt in 128 4096; do
    for mode in "--cuda-graph off" "--cuda-graph on" "--cuda-graph on --compile"; do
      # shellcheck disable=SC2086
      run --model $model --prompt-len $prompt --max-seq-len 8192 --tokens 256 $mode
    done
  done
done
