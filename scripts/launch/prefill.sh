#!/usr/bin/env bash
# The prefill server: STOCK vLLM. Our connector is loaded only through kv_connector_module_path as a
# MultiConnector child beside vLLM's own NixlConnector (EXPRESS_CONNECTOR=0 leaves it out, for baselines).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/common.sh"
PREFILL_PORT="${PREFILL_PORT:-8000}"
KV_BUFFER_DEVICE="${KV_BUFFER_DEVICE:-cpu}"
EXPRESS_CONNECTOR="${EXPRESS_CONNECTOR:-1}"
CONNECTOR_METRICS_PORT="${CONNECTOR_METRICS_PORT:-9400}"
# Where the connector's metrics endpoint listens (default: where vLLM listens, BIND_HOST).
CONNECTOR_METRICS_HOST="${CONNECTOR_METRICS_HOST:-$BIND_HOST}"
# CPU cores for vLLM's OpenMP threads ("auto", "nobind", a list like "0-3", or "split": the first half of the
# CPUs, common.sh cpu_bind); on a small host give prefill and native decode disjoint cores so their spinning OpenMP
# threads do not fight.
export VLLM_CPU_OMP_THREADS_BIND="$(cpu_bind "${PREFILL_CPU_BIND:-auto}" first)"
# 1: our connector puts the forward thread back on its OpenMP core after NixlConnector moved it to the
# last core of the NUMA node (connector/cpu_affinity.py); 0: leave vLLM's placement as it is.
PREFILL_RESTORE_OMP_AFFINITY="${PREFILL_RESTORE_OMP_AFFINITY:-1}"
[[ "$PREFILL_RESTORE_OMP_AFFINITY" == "0" ]] && restore=false || restore=true
export VLLM_NIXL_SIDE_CHANNEL_PORT="${PREFILL_NIXL_PORT:-5600}"
export VLLM_NIXL_SIDE_CHANNEL_HOST="${PREFILL_NIXL_HOST:-127.0.0.1}"

# Where our connector stages a request's KV before the send: empty = the connector's default (cpu: pinned host
# memory when the KV cache is on CUDA), device = VRAM (VRAM -> VRAM to the express node's receive buffer).
EXPRESS_STAGING_DEVICE="${EXPRESS_STAGING_DEVICE:-}"
staging=""
[[ -n "$EXPRESS_STAGING_DEVICE" ]] && staging=',"staging_device":"'"$EXPRESS_STAGING_DEVICE"'"'
# Requests our connector may hold staged at once (its staging_slots): at least the express seats it feeds. The
# router admits an express request whenever a seat is free, so as many prefills as there are free seats can finish
# in one step and each needs a slot; one short, and that request fails with a 503 `no_staging_slot` after its
# prefill (one H100 at 8B, a 4-seat node beside the connector's default of 2: 2 of 10 requests at 4 users,
# docs/bench/2026-12-07-seats/). Default: EXPRESS_SEATS where this stack sets it (one express node beside this
# prefill), else 4 where the KV cache is on the CPU (the node's --seats auto there; ~190 MB of host memory a slot
# for SmolLM2 at 4,096 tokens), else the connector's own (2). A pool of nodes: the sum of their seats.
if [[ -z "${EXPRESS_STAGING_SLOTS:-}" && "${EXPRESS_SEATS:-}" =~ ^[1-9][0-9]*$ ]]; then
  EXPRESS_STAGING_SLOTS="$EXPRESS_SEATS"
fi
if [[ -z "${EXPRESS_STAGING_SLOTS:-}" && "$KV_BUFFER_DEVICE" == cpu ]]; then EXPRESS_STAGING_SLOTS=4; fi
EXPRESS_STAGING_SLOTS="${EXPRESS_STAGING_SLOTS:-}"
[[ -n "$EXPRESS_STAGING_SLOTS" ]] && staging="$staging"',"staging_slots":'"$EXPRESS_STAGING_SLOTS"
# More vLLM flags for this server (word-split), e.g. the GPU memory split of a one-GPU stack:
# "--gpu-memory-utilization 0.25 --kv-cache-memory-bytes 10G" (scripts/gpu_stack.py).
PREFILL_EXTRA_ARGS="${PREFILL_EXTRA_ARGS:-}"

nixl='{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"'"$KV_BUFFER_DEVICE"'"}'
express='{"kv_connector":"ExpressLaneConnector","kv_connector_module_path":"expresslane.engine.connector","kv_role":"kv_producer","kv_connector_extra_config":{"metrics_port":'"$CONNECTOR_METRICS_PORT"',"metrics_host":"'"$CONNECTOR_METRICS_HOST"'","restore_omp_affinity":'"$restore$staging"'}}'
if [[ "$EXPRESS_CONNECTOR" == "1" ]]; then children="$nixl,$express"; else children="$nixl"; fi
# More MultiConnector children (comma-separated JSON objects), e.g. TileRT's connector in production.
EXTRA_KV_CONNECTORS="${EXTRA_KV_CONNECTORS:-}"
[[ -n "$EXTRA_KV_CONNECTORS" ]] && children="$children,$EXTRA_KV_CONNECTORS"
kv_config='{"kv_connector":"MultiConnector","kv_role":"kv_producer","kv_connector_extra_config":{"connectors":['"$children"']}}'

# shellcheck disable=SC2086
vllm_serve "$PREFILL_PORT" "$kv_config" $PREFILL_EXTRA_ARGS "$@"
