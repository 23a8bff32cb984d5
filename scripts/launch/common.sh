# Shared defaults for every service launcher. Sourced, never executed.
# Every value comes from the environment (compose `environment:` / `.env`, or scripts/dev_stack.py)
# with the documented default written inline; nothing else reads these variables.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
MODEL_DIR="${MODEL_DIR:-/models/tiny-llama}"
SERVED_MODEL_NAME="${SERVED_MODEL_NAME:-tiny-llama}"
DTYPE="${DTYPE:-float32}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-4096}"
MAX_NUM_BATCHED_TOKENS="${MAX_NUM_BATCHED_TOKENS:-512}"
BIND_HOST="${BIND_HOST:-0.0.0.0}"
SEED="${SEED:-0}"
# vLLM on CPU: KV cache size in GiB (1 is plenty for the tiny model).
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"

# Stock vLLM's OpenAI server with the flags every vLLM service of the stack shares.
# Usage: vllm_serve PORT KV_TRANSFER_CONFIG [extra vLLM flags...]
vllm_serve() {
  local port="$1" kv_config="$2"
  shift 2
  exec "$PYTHON" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --served-model-name "$SERVED_MODEL_NAME" \
    --host "$BIND_HOST" --port "$port" \
    --dtype "$DTYPE" --max-model-len "$MAX_MODEL_LEN" \
    --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS" --seed "$SEED" \
    --kv-transfer-config "$kv_config" "$@"
}
