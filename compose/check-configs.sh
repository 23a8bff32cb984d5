#!/usr/bin/env bash
# Validate every compose combination expresslane ships with `docker compose config` (interpolation, merge tags,
# schema, dependency graph). Run from anywhere; exit code = number of failing combinations (0 = all pass).
#
#   compose/check-configs.sh            # quiet; prints one line per combination
#   VERBOSE=1 compose/check-configs.sh  # also prints each failure's full error
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
cd "$repo"
# The combinations below name their files; a COMPOSE_FILE from the caller (.ci/compose-e2e.sh) must not leak in.
unset COMPOSE_FILE COMPOSE_PROFILES

base=compose/compose.yaml
prod=compose/overlays/production.yaml
# name | compose args | expected services (space separated, sorted)
combos=(
  "default (root .env)|||decode-express decode-native grafana model-init prefill prometheus router secrets-init"
  "default + tools (smoke)||--profile tools|decode-express decode-native grafana model-init prefill prometheus router secrets-init smoke"
  "default + host metrics||--profile host-metrics|cadvisor decode-express decode-native grafana model-init node-exporter prefill prometheus router secrets-init"
  "base file explicitly|-f $base||decode-express decode-native grafana model-init prefill prometheus router secrets-init"
  "offline (no registry)|-f $base -f compose/overlays/offline.yaml||decode-express decode-native model-init prefill prometheus router secrets-init"
  "pools (2 prefills, 2 native decodes)|-f $base -f compose/overlays/pools.yaml||decode-express decode-native decode-native-2 grafana model-init prefill prefill-2 prometheus router secrets-init"
  "development (source mounted)|-f $base -f compose/overlays/dev.yaml||decode-express decode-native grafana model-init prefill prometheus router secrets-init"
  "one GPU (host checkpoint)|-f $base -f compose/overlays/gpu-single.yaml||dcgm-exporter decode-express decode-native grafana prefill prometheus router secrets-init"
  "production, one host|-f $base -f $prod||dcgm-exporter decode-express decode-native grafana prefill prometheus router tilert-convert"
  "production, prefill node|-f $base -f $prod -f compose/roles/prefill-node.yaml||dcgm-exporter grafana prefill prometheus router"
  "production, native decode node|-f $base -f $prod -f compose/roles/decode-node.yaml||dcgm-exporter decode-native"
  "production, express node|-f $base -f $prod -f compose/roles/express-node.yaml||dcgm-exporter decode-express tilert-convert"
)

failed=0
for combo in "${combos[@]}"; do
  IFS='|' read -r name files profiles want <<<"$combo"
  # shellcheck disable=SC2086  # word splitting of the file/profile lists is intended
  if out="$(docker compose $files $profiles config 2>&1 >/dev/null)" \
     && got="$(docker compose $files $profiles config --services 2>/dev/null | sort | tr '\n' ' ' | sed 's/ $//')" \
     && [[ "$got" == "$want" ]]; then
    printf 'ok    %s\n' "$name"
  else
    failed=$((failed + 1))
    printf 'FAIL  %s  (docker compose %s %s config)\n' "$name" "$files" "$profiles"
    [[ -n "${got:-}" && "${got:-}" != "$want" ]] && printf '      services: got [%s], want [%s]\n' "$got" "$want"
    [[ -n "$out" ]] && printf '%s\n' "$out" | sed 's/^/      /' | { [[ -n "${VERBOSE:-}" ]] && cat || head -3; }
  fi
  got=""
done
echo "$(( ${#combos[@]} - failed ))/${#combos[@]} compose combinations valid"
exit "$failed"
