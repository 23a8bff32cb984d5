#!/usr/bin/env bash
# The express-lane decode node: our engine behind the TileRT decode-node HTTP contract.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/common.sh"
EXPRESS_HTTP_PORT="${EXPRESS_HTTP_PORT:-5557}"
EXPRESS_CTRL_PORT="${EXPRESS_CTRL_PORT:-5556}"
EXPRESS_DEVICE="${EXPRESS_DEVICE:-cpu}"
# The host the prefill's sender uses to reach this node's NIXL agent / control port.
EXPRESS_ADVERTISE_HOST="${EXPRESS_ADVERTISE_HOST:-127.0.0.1}"
# torch intra-op threads on CPU (empty = one per EXPRESS_CPU_BIND CPU, else torch's default; "split": as many as
# native decode's half of the CPUs gets with DECODE_NATIVE_CPU_BIND=split, scripts/dev_stack.py cpu_split).
EXPRESS_THREADS="${EXPRESS_THREADS:-}"
if [[ "$EXPRESS_THREADS" == split ]]; then EXPRESS_THREADS="$(cpu_bind split second | tr ',' '\n' | wc -l)"; fi
# CPUs the node is pinned to, taskset -c syntax (e.g. 1 or 2-3; empty or auto = inherit).
EXPRESS_CPU_BIND="${EXPRESS_CPU_BIND:-}"
# 1 = torch.compile the decode step: 1.6-2.1x decode speed in the 2-CPU stack
# (docs/bench/2026-12-01-cpu-compiled-step/); needs a C compiler (the runtime image has g++), adds about 10 s to
# the start, and falls back to the plain step with a warning if compiling fails. 0 = the plain step. On CUDA
# the step is replayed as one CUDA graph either way.
EXPRESS_COMPILE="${EXPRESS_COMPILE:-1}"
# Attention kernel: live | split | masked (empty = the engine's default: split on cuda, live elsewhere).
EXPRESS_ATTENTION="${EXPRESS_ATTENTION:-}"
# Exact speculative decoding by prompt lookup (greedy output identical either way; a request may opt out with
# sampling.speculative=false): on | off. EXPRESS_SPEC_K: most draft tokens per verify step (1-16; empty = 4).
# On by default: the compiled step no longer compiles mid-stream (every shape a stream takes is compiled at
# warmup: tests/unit/engine/test_no_recompile.py; a 1,500-token compiled stream's largest gap was 9 ms), and the
# adaptive drafter (decode/speculative.py AdaptiveDrafter) verifies as many drafts a step as pay for their verify
# at the step costs the node measures at warm-up, and none where none pays (probes then cost at most 1 % of plain
# decoding). Numbers: docs/bench/2026-12-04-cost-aware-drafter/.
EXPRESS_SPECULATION="${EXPRESS_SPECULATION:-on}"
EXPRESS_SPEC_K="${EXPRESS_SPEC_K:-}"
# The lean CUDA step's GEMV kernels: auto | cuda-core | tensor-core (empty = auto = cuda-core: speculation never
# slower than none. tensor-core: a verify of 5 rows costs ~1.1x one row instead of 2.5x and a one-token step ~4 %
# more, for traffic that repeats its prompt, i.e. code edits and agentic tool results.
# docs/performance.md#gpu-speculation).
EXPRESS_LEAN_GEMV="${EXPRESS_LEAN_GEMV:-}"
# Users decoded at once, each in a seat of its own, every one bit-identical to alone (1-8; empty = auto: 4 on a CPU,
# on a GPU as many as 80 % of the memory left after the weights holds at --max-seq-len). Set it where the GPU is
# shared with other servers (gpu-single): auto reads the free memory at the node's start.
EXPRESS_SEATS="${EXPRESS_SEATS:-}"
# Deadlines (seconds; every failure of a request surfaces within a bound). Empty = the node's default.
EXPRESS_KV_TIMEOUT_S="${EXPRESS_KV_TIMEOUT_S:-}"              # default wait for a request's KV (120)
EXPRESS_MAX_TIMEOUT_S="${EXPRESS_MAX_TIMEOUT_S:-}"            # largest timeout_s a request may ask (300)
EXPRESS_RESERVATION_TTL_S="${EXPRESS_RESERVATION_TTL_S:-}"    # cap on /pd/reserve's ttl_s (60)
EXPRESS_REQUEST_DEADLINE_S="${EXPRESS_REQUEST_DEADLINE_S:-}"  # one /pd/decode, KV wait + decode (600)
EXPRESS_STALL_TIMEOUT_S="${EXPRESS_STALL_TIMEOUT_S:-}"        # no token for this long -> stall error (30)
EXPRESS_HEALTH_INTERVAL_S="${EXPRESS_HEALTH_INTERVAL_S:-}"    # the node's own health probe period (2)
EXPRESS_HEALTH_PROBE_TIMEOUT_S="${EXPRESS_HEALTH_PROBE_TIMEOUT_S:-}"  # engine thread must answer within (5)
EXPRESS_MAX_CONNECTIONS="${EXPRESS_MAX_CONNECTIONS:-}"        # control-plane connection cap (64)
# 1 = verify the KV checksum before inject (default); 0 = skip it (a production speed switch).
EXPRESS_VERIFY_CHECKSUM="${EXPRESS_VERIFY_CHECKSUM:-1}"
# Secrets are read by the node itself from its environment, never passed on the command line:
#   EXPRESS_NODE_TOKEN / EXPRESS_NODE_TOKEN_FILE        bearer token of /pd/*, /decode_status, /capabilities
#   EXPRESSLANE_PEER_SECRET / EXPRESSLANE_PEER_SECRET_FILE  control-plane HMAC secret shared with the prefill
extra=()
[[ "$EXPRESS_COMPILE" == 1 ]] && extra+=(--compile)
[[ -n "$EXPRESS_ATTENTION" ]] && extra+=(--attention "$EXPRESS_ATTENTION")
extra+=(--speculation "$EXPRESS_SPECULATION")
[[ -n "$EXPRESS_SPEC_K" ]] && extra+=(--spec-k "$EXPRESS_SPEC_K")
[[ -n "$EXPRESS_LEAN_GEMV" ]] && extra+=(--lean-gemv "$EXPRESS_LEAN_GEMV")
[[ -n "$EXPRESS_SEATS" ]] && extra+=(--seats "$EXPRESS_SEATS")
[[ -n "$EXPRESS_THREADS" ]] && extra+=(--threads "$EXPRESS_THREADS")
[[ -n "$EXPRESS_CPU_BIND" ]] && extra+=(--cpu-bind "$EXPRESS_CPU_BIND")
[[ -n "$EXPRESS_KV_TIMEOUT_S" ]] && extra+=(--kv-timeout-s "$EXPRESS_KV_TIMEOUT_S")
[[ -n "$EXPRESS_MAX_TIMEOUT_S" ]] && extra+=(--max-timeout-s "$EXPRESS_MAX_TIMEOUT_S")
[[ -n "$EXPRESS_RESERVATION_TTL_S" ]] && extra+=(--reservation-ttl-s "$EXPRESS_RESERVATION_TTL_S")
[[ -n "$EXPRESS_REQUEST_DEADLINE_S" ]] && extra+=(--request-deadline-s "$EXPRESS_REQUEST_DEADLINE_S")
[[ -n "$EXPRESS_STALL_TIMEOUT_S" ]] && extra+=(--stall-timeout-s "$EXPRESS_STALL_TIMEOUT_S")
[[ -n "$EXPRESS_HEALTH_INTERVAL_S" ]] && extra+=(--health-interval-s "$EXPRESS_HEALTH_INTERVAL_S")
[[ -n "$EXPRESS_HEALTH_PROBE_TIMEOUT_S" ]] && extra+=(--health-probe-timeout-s "$EXPRESS_HEALTH_PROBE_TIMEOUT_S")
[[ -n "$EXPRESS_MAX_CONNECTIONS" ]] && extra+=(--max-connections "$EXPRESS_MAX_CONNECTIONS")
[[ "$EXPRESS_VERIFY_CHECKSUM" == 0 ]] && extra+=(--no-verify-checksum)

# A checkpoint the engine cannot serve (architecture, activation, RoPE type, quantized or other tensor dtypes) stops
# here, at start, with one line naming what is unsupported (exit 2), before the weights load.
"$PYTHON" -c 'import sys; from expresslane.engine.models.config import main; sys.exit(main(sys.argv[1:]))' \
  "$MODEL_DIR" || exit 2

exec "$PYTHON" -m expresslane.engine.server \
  --model "$MODEL_DIR" --dtype "$DTYPE" --device "$EXPRESS_DEVICE" \
  --max-seq-len "$MAX_MODEL_LEN" --host "$BIND_HOST" \
  --advertise-host "$EXPRESS_ADVERTISE_HOST" \
  --ctrl-port "$EXPRESS_CTRL_PORT" --http-port "$EXPRESS_HTTP_PORT" "${extra[@]}" "$@"
