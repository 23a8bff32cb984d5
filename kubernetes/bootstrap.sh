#!/usr/bin/env bash
# What an overlay needs before `kubectl apply -k`: its namespace (with its Pod Security labels), the Secret
# expresslane-secrets (four random values, never in the repo), and, for the GPU overlays, the gateway's TLS Secret
# and the optional Hugging Face token. The model's and TileRT's PersistentVolumeClaims are objects of the overlays
# themselves (the model Job fills them). Idempotent: existing secrets and files are kept.
#
#   kubernetes/bootstrap.sh OVERLAY [--secrets-dir DIR] [--tls-cert F --tls-key F] [--hf-token-file F]
#
#   cpu-demo   writes the four files into kubernetes/overlays/cpu-demo/secrets (git-ignored): the overlay's
#              secretGenerator reads them; needs no cluster access
#   gpu|tilert creates namespace `expresslane` and, from DIR (default ~/.expresslane/secrets, made by
#              make-secrets.sh if missing), the Secret expresslane-secrets; with --tls-cert/--tls-key the Secret
#              expresslane-gateway-tls (or let cert-manager issue it); with --hf-token-file expresslane-hf-token
set -euo pipefail
usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }
[[ $# -ge 1 && "$1" != -h && "$1" != --help ]] || { usage; exit 0; }
here="$(cd "$(dirname "$0")" && pwd)"
overlay="$1"; shift
dir="$HOME/.expresslane/secrets"; cert=""; key=""; hf=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --secrets-dir) dir="$2"; shift 2 ;;
    --tls-cert) cert="$2"; shift 2 ;;
    --tls-key) key="$2"; shift 2 ;;
    --hf-token-file) hf="$2"; shift 2 ;;
    *) echo "bootstrap: unknown argument $1" >&2; exit 2 ;;
  esac
done
KUBECTL="${KUBECTL:-kubectl}"
case "$overlay" in
  cpu-demo)
    bash "$here/make-secrets.sh" "$here/overlays/cpu-demo/secrets"
    echo "next: kubectl apply -k $here/overlays/cpu-demo" ;;
  gpu|tilert)
    ns=expresslane
    bash "$here/make-secrets.sh" "$dir"
    "$KUBECTL" apply -f "$here/overlays/$overlay/app/namespace.yaml"
    "$KUBECTL" -n "$ns" get secret expresslane-secrets >/dev/null 2>&1 \
      || "$KUBECTL" -n "$ns" create secret generic expresslane-secrets --from-file="$dir"
    if [[ -n "$cert" ]]; then
      "$KUBECTL" -n "$ns" get secret expresslane-gateway-tls >/dev/null 2>&1 \
        || "$KUBECTL" -n "$ns" create secret tls expresslane-gateway-tls --cert="$cert" --key="$key"
    fi
    if [[ -n "$hf" ]]; then
      "$KUBECTL" -n "$ns" get secret expresslane-hf-token >/dev/null 2>&1 \
        || "$KUBECTL" -n "$ns" create secret generic expresslane-hf-token --from-file=token="$hf"
    fi
    echo "next: edit $here/overlays/$overlay/app/settings.yaml, then kubectl apply -k $here/overlays/$overlay" ;;
  *) echo "bootstrap: unknown overlay $overlay (cpu-demo, gpu, tilert)" >&2; exit 2 ;;
esac
