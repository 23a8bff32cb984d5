#!/usr/bin/env bash
# Production express lane: TileRT's one-time weight conversion (idempotent: a marker file skips it).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/common.sh"
TILERT_MODEL_TYPE="${TILERT_MODEL_TYPE:-glm-5}"
TILERT_WEIGHTS_DIR="${TILERT_WEIGHTS_DIR:-/weights/$(basename "$MODEL_DIR")}"
if [[ -f "$TILERT_WEIGHTS_DIR/.expresslane-converted" ]]; then
  echo "tilert weights present in $TILERT_WEIGHTS_DIR"; exit 0
fi
"$PYTHON" -m tilert.models.preprocess.weight_converter --model_type "$TILERT_MODEL_TYPE" \
  --model_dir "$MODEL_DIR" --save_dir "$TILERT_WEIGHTS_DIR"
touch "$TILERT_WEIGHTS_DIR/.expresslane-converted"
