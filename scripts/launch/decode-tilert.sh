#!/usr/bin/env bash
# Production express lane: the real TileRT decode server (same /pd/* HTTP contract as our engine server;
# the router's `kind: tilert` pool drives it). ONE request in flight per node.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/common.sh"
TILERT_MODEL="${TILERT_MODEL:-glm5}"
TILERT_WEIGHTS_DIR="${TILERT_WEIGHTS_DIR:-/weights/$(basename "$MODEL_DIR")}"
TILERT_KV_CACHE_DTYPE="${TILERT_KV_CACHE_DTYPE:-fp8}"
EXPRESS_HTTP_PORT="${EXPRESS_HTTP_PORT:-5557}"
EXPRESS_CTRL_PORT="${EXPRESS_CTRL_PORT:-5556}"
# Extra flags, e.g. --with-mtp (word-split on purpose).
TILERT_EXTRA_ARGS="${TILERT_EXTRA_ARGS:-}"
# shellcheck disable=SC2086
exec "$PYTHON" -m tilert.pd_vllm.decode_server --engine tilert --model "$TILERT_MODEL" \
  --model-weights-dir "$TILERT_WEIGHTS_DIR" --max-seq-len "$MAX_MODEL_LEN" \
  --kv-cache-dtype "$TILERT_KV_CACHE_DTYPE" --ctrl-port "$EXPRESS_CTRL_PORT" --http-port "$EXPRESS_HTTP_PORT" \
  $TILERT_EXTRA_ARGS "$@"
