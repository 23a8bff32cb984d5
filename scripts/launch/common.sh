# Shared defaults for every service launcher. Sourced, never executed.
# Every value comes from the environment (compose `environment:` / `.env`, or scripts/dev_stack.py)
# with the documented default written inline; nothing else reads these variables.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
MODEL_DIR="${MODEL_DIR:-/models/smollm2-135m-instruct}"
# The name clients and the router use: the checkpoint directory's own name unless set (compose sets it from
# MODEL_NAME). The router's aliases derive from it (compose/config/router.yaml: NAME and NAME-express).
SERVED_MODEL_NAME="${SERVED_MODEL_NAME:-$(basename "$MODEL_DIR")}"
export MODEL_DIR SERVED_MODEL_NAME
DTYPE="${DTYPE:-float32}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-4096}"
MAX_NUM_BATCHED_TOKENS="${MAX_NUM_BATCHED_TOKENS:-512}"
BIND_HOST="${BIND_HOST:-0.0.0.0}"
SEED="${SEED:-0}"
# vLLM on CPU: KV cache size in GiB (vLLM's default is 4). 1 GiB holds ~23k tokens of SmolLM2-135M in float32
# (30 layers x 3 KV heads x 64 x 2 x 4 B = 46 KB a token) and far more of the tiny model.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"

# CPU cores of a vLLM server's OpenMP threads (vLLM's VLLM_CPU_OMP_THREADS_BIND): `auto` (vLLM's choice: every CPU
# of the NUMA node, so two servers on one host both spin on every core: native decode ran at 0.35 tok/s that way
# on 2 CPUs), `nobind`, a list like `0-3`, or `split`: the stack's one-host placement (scripts/dev_stack.py
# cpu_split; docs/deployment.md "CPU placement"): the prefill the first half of the CPUs this process may use,
# native decode the second half.
# Usage: cpu_bind VALUE first|second -> the value for VLLM_CPU_OMP_THREADS_BIND
cpu_bind() {
  if [[ "$1" != split ]]; then printf '%s' "$1"; return 0; fi
  "$PYTHON" -c '
import os, sys
cpus = sorted(os.sched_getaffinity(0))
half = len(cpus) // 2
part = (cpus[:half] if sys.argv[1] == "first" else cpus[half:]) if half else cpus
print(",".join(map(str, part)))' "$2"
}

# A secret: NAME_FILE (a file, e.g. a compose secret under /run/secrets; trailing newline dropped) wins over NAME.
# Usage: read_secret NAME -> prints the value (empty when neither is set); fails loudly on an unreadable file.
read_secret() {
  local name="$1" file_var="${1}_FILE"
  local file="${!file_var:-}"
  if [[ -n "$file" ]]; then
    [[ -r "$file" ]] || { echo "launch: $file_var=$file is not readable" >&2; return 1; }
    local value
    value="$(<"$file")"
    printf '%s' "${value%$'\n'}"
  else
    printf '%s' "${!name:-}"
  fi
}

# vLLM's API key (VLLM_API_KEY or VLLM_API_KEY_FILE): the router sends it upstream, so the router stays the only
# open door. It reaches vLLM as the VLLM_API_KEY environment variable, vLLM's own equivalent of --api-key (one
# key), not on the command line, where every local user could read it in the process list. Empty = no auth.
VLLM_API_KEY="$(read_secret VLLM_API_KEY)"
unset VLLM_API_KEY_FILE
if [[ -n "$VLLM_API_KEY" ]]; then export VLLM_API_KEY; else unset VLLM_API_KEY; fi
# Tool calling on every vLLM server: VLLM_TOOL_CALL_PARSER (default hermes; empty = off) ->
# --enable-auto-tool-choice --tool-call-parser NAME.
VLLM_TOOL_CALL_PARSER="${VLLM_TOOL_CALL_PARSER-hermes}"
VLLM_TOOL_ARGS=()
[[ -n "$VLLM_TOOL_CALL_PARSER" ]] && VLLM_TOOL_ARGS=(--enable-auto-tool-choice --tool-call-parser "$VLLM_TOOL_CALL_PARSER")

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
    --kv-transfer-config "$kv_config" "${VLLM_TOOL_ARGS[@]}" "$@"
}
