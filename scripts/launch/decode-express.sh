#!/usr/bin/env bash
# The express-lane decode node: our engine behind the TileRT decode-node HTTP contract.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/common.sh"
EXPRESS_HTTP_PORT="${EXPRESS_HTTP_PORT:-5557}"
EXPRESS_CTRL_PORT="${EXPRESS_CTRL_PORT:-5556}"
EXPRESS_DEVICE="${EXPRESS_DEVICE:-cpu}"
# The host the prefill's sender uses to reach this node's NIXL agent / control port.
EXPRESS_ADVERTISE_HOST="${EXPRESS_ADVERTISE_HOST:-127.0.0.1}"
# torch intra-op threads on CPU (empty = one per EXPRESS_CPU_BIND CPU, else torch's default).
EXPRESS_THREADS="${EXPRESS_THREADS:-}"
# CPUs the node is pinned to, taskset -c syntax (e.g. 1 or 2-3; empty or auto = inherit).
EXPRESS_CPU_BIND="${EXPRESS_CPU_BIND:-}"
# 1 = torch.compile the decode step: 1.6-2.1x decode speed in the 2-CPU stack (docs/performance.md); needs a C
# compiler (the runtime image has g++), adds about 10 s to the start, and falls back to the plain step with a
# warning if compiling fails. 0 = the plain step. On CUDA the step is replayed as one CUDA graph either way.
EXPRESS_COMPILE="${EXPRESS_COMPILE:-1}"
extra=()
[[ "$EXPRESS_COMPILE" == 1 ]] && extra+=(--compile)
[[ -n "$EXPRESS_THREADS" ]] && extra+=(--threads "$EXPRESS_THREADS")
[[ -n "$EXPRESS_CPU_BIND" ]] && extra+=(--cpu-bind "$EXPRESS_CPU_BIND")

exec "$PYTHON" -m expresslane.engine.server \
  --model "$MODEL_DIR" --dtype "$DTYPE" --device "$EXPRESS_DEVICE" \
  --max-seq-len "$MAX_MODEL_LEN" --host "$BIND_HOST" \
  --advertise-host "$EXPRESS_ADVERTISE_HOST" \
  --ctrl-port "$EXPRESS_CTRL_PORT" --http-port "$EXPRESS_HTTP_PORT" "${extra[@]}" "$@"
