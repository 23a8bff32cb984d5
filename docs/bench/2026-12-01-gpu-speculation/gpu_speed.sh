#!/usr/bin/env bash
# The express engine on one CUDA GPU, in one run: exactness tests, copy bandwidth, tok/s and % of the bound
# (weights + live KV) for Llama-1B- and 8B-shaped bf16 at contexts 1k / 8k / 32k, plain and with an oracle
# draft at k = 1..4 (acceptance sweep), and transformers' static-cache + compile generate as the reference.
#
#   bash docs/bench/2026-12-01-gpu-speculation/gpu_speed.sh [OUTDIR] [PART]     # PART: all (default) | tests | engine | hf | lean
#
# PART lean runs docs/bench/2026-12-01-gpu-lean-step/gpu_lean.py alone (the lean step against the PyTorch step, no checkpoint written;
# LEAN_ARGS adds its flags, e.g. "--pytest --compiled"); it is not part of "all".
#
# Environment: SHAPES (llama-1b llama-8b), STEPS (bench step flags, one word per run, default --compile; e.g.
# "--compile --compile-mode=max-autotune-no-cudagraphs"), CONTEXTS, TOKENS, ORACLE_K, STEP_TIMEOUT (s per run).
#
# Needs torch with CUDA, triton, safetensors, transformers, pytest (no vLLM, no network). Logs in OUTDIR
# (default var/gpu-speed): speed.log (the whole output), results.jsonl (one JSON line per engine result).
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the repository root (this lab note: docs/bench/<date>-<topic>/)
OUTDIR=${1:-var/gpu-speed}
PART=${2:-all}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/engine/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
MODELS=${MODELS_DIR:-var/models}
mkdir -p "$OUTDIR" "$MODELS"
LOG="$OUTDIR/speed.log"
exec > >(tee -a "$LOG") 2>&1
echo "== $(date -u +%FT%TZ) docs/bench/2026-12-01-gpu-speculation/gpu_speed.sh $* (commit $(cat GIT_HEAD 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown))"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

if [[ $PART == all || $PART == tests ]]; then
  echo "== GPU exactness tests"
  "$PY" -m pytest -q -p no:cacheprovider tests/unit/engine/test_attention.py tests/unit/engine/test_cuda_graph.py \
    tests/unit/engine/test_gpu_speculative.py tests/unit/engine/test_fused_kernels.py 2>&1 | grep -v "^[0-9.]*s \(call\|setup\|teardown\)" || true
fi

if [[ $PART == all || $PART == engine || $PART == hf ]]; then
  for shape in ${SHAPES:-llama-1b llama-8b}; do "$PY" scripts/gpu_make_shape_model.py $shape "$MODELS/$shape"; done
fi

if [[ $PART == all || $PART == engine ]]; then
  for shape in ${SHAPES:-llama-1b llama-8b}; do
    for step in ${STEPS:---compile}; do
      echo "== engine $shape $step"
      # shellcheck disable=SC2086
      # STEP_TIMEOUT (s, 0 = none) bounds one bench run, so a slow max-autotune compile cannot eat the call.
      timeout "${STEP_TIMEOUT:-0}" "$PY" -m expresslane.engine.decode.bench --model "$MODELS/$shape" --device cuda \
        --dtype bfloat16 --contexts ${CONTEXTS:-1024,8192,32768} --tokens ${TOKENS:-256} --repeats 2 \
        --oracle-k ${ORACLE_K:-1,2,3,4} $step --json "$OUTDIR/results.jsonl" || echo "engine $shape $step: rc $?"
    done
  done
fi

if [[ $PART == all || $PART == hf ]]; then
  for shape in ${SHAPES:-llama-1b llama-8b}; do
    echo "== transformers reference $shape"
    timeout ${HF_TIMEOUT:-240} "$PY" docs/bench/2026-12-01-gpu-speculation/gpu_hf_reference.py "$MODELS/$shape" --contexts ${HF_CONTEXTS:-1024} \
      --tokens ${TOKENS:-256} || echo "transformers reference $shape: failed or timed out (rc $?)"
  done
fi
if [[ $PART == lean ]]; then
  echo "== lean step vs PyTorch step"
  # shellcheck disable=SC2086
  "$PY" docs/bench/2026-12-01-gpu-lean-step/gpu_lean.py --out "$OUTDIR" ${LEAN_ARGS:-} || echo "gpu_lean.py: rc $?"
fi
echo "== done $(date -u +%FT%TZ)"
