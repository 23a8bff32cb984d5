#!/usr/bin/env bash
# One-shot (compose service `secrets-init`): the default stack's internal secrets, generated on its first start.
# Writes each missing secret (a random URL-safe token) into SECRETS_DIR (the `internal-secrets` volume, mounted
# read-only into exactly the services that read it: prefill, decode-native, decode-express, router), owned by the
# services' user and readable by it alone; an existing one is kept, so later starts and restarts agree. Prints file
# names, never values. docs/security.md ("What the default stack generates").
#   express_node_token        EXPRESS_NODE_TOKEN: /pd/*, /decode_status, /capabilities of the express node
#   expresslane_peer_secret   EXPRESSLANE_PEER_SECRET: the prefill <-> express node control plane (HMAC)
#   vllm_api_key              VLLM_API_KEY: the prefill and native decode vLLM servers' /v1/*
set -euo pipefail
dir="${SECRETS_DIR:-/run/expresslane/secrets}"
owner="${SECRETS_OWNER:-10001:10001}"  # the `expresslane` user of the runtime and router images
umask 077
mkdir -p "$dir"
for name in express_node_token expresslane_peer_secret vllm_api_key; do
  file="$dir/$name"
  if [[ -s "$file" ]]; then
    echo "secrets-init: $file exists, kept"
  else
    python3 -c 'import secrets; print(secrets.token_urlsafe(32), end="")' > "$file.new"
    mv "$file.new" "$file"
    echo "secrets-init: generated $file"
  fi
  chown "$owner" "$file"
  chmod 0400 "$file"
done
chown "$owner" "$dir"
chmod 0500 "$dir"
