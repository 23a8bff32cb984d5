#!/usr/bin/env bash
# A native-lane decode server: STOCK vLLM with NixlConnector as kv_consumer. Every instance needs its own
# NIXL side-channel port (and host, when instances are not on one host).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/common.sh"
DECODE_NATIVE_PORT="${DECODE_NATIVE_PORT:-8100}"
KV_BUFFER_DEVICE="${KV_BUFFER_DEVICE:-cpu}"
# CPU cores for vLLM's OpenMP threads: as PREFILL_CPU_BIND ("split": the second half of the CPUs).
export VLLM_CPU_OMP_THREADS_BIND="$(cpu_bind "${DECODE_NATIVE_CPU_BIND:-auto}" second)"
export VLLM_NIXL_SIDE_CHANNEL_PORT="${DECODE_NATIVE_NIXL_PORT:-5601}"
export VLLM_NIXL_SIDE_CHANNEL_HOST="${DECODE_NATIVE_NIXL_HOST:-127.0.0.1}"
# A KV the decode cannot load (its prefill died mid-handoff, a NIXL failure): `recompute` computes the missing blocks
# here and the request still succeeds, exactly; `fail` (vLLM's default) ends it with an error. With a prefill pool, a
# prefill member killed under load otherwise costs every request whose KV was in flight from it.
KV_LOAD_FAILURE_POLICY="${KV_LOAD_FAILURE_POLICY:-recompute}"
kv_config='{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_device":"'"$KV_BUFFER_DEVICE"'","kv_load_failure_policy":"'"$KV_LOAD_FAILURE_POLICY"'"}'
# More vLLM flags for this server (word-split), e.g. "--gpu-memory-utilization 0.25 --kv-cache-memory-bytes 10G".
DECODE_NATIVE_EXTRA_ARGS="${DECODE_NATIVE_EXTRA_ARGS:-}"

# shellcheck disable=SC2086
vllm_serve "$DECODE_NATIVE_PORT" "$kv_config" $DECODE_NATIVE_EXTRA_ARGS "$@"
