#!/usr/bin/env bash
# Write the four secrets an overlay's secretGenerator reads (random, mode 600) into DIR; an existing file is kept.
#   kubernetes/make-secrets.sh kubernetes/overlays/cpu-demo/secrets
# For a production namespace create the Secret from such files yourself (never from literals on a command line):
#   kubectl -n NS create secret generic expresslane-secrets --from-file=DIR
set -euo pipefail
dir="${1:?usage: make-secrets.sh DIR}"
mkdir -p "$dir"
umask 077
token() { python3 -c 'import secrets; print(secrets.token_urlsafe(32))'; }
for name in vllm-api-key express-node-token peer-secret; do
  [[ -s "$dir/$name" ]] || token > "$dir/$name"
done
# The router's client keys: one per line, `KEY name=NAME [lanes=...] [rps=...]` (docs/security.md).
[[ -s "$dir/router-api-keys" ]] || echo "sk-$(token) name=demo" > "$dir/router-api-keys"
echo "secrets in $dir: vllm-api-key express-node-token peer-secret router-api-keys"
