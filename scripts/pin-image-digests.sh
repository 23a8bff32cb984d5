#!/usr/bin/env bash
# Pin an overlay's images by digest after a build and push: rewrites kubernetes/overlays/OVERLAY/[app/]images/
# kustomization.yaml (and kubernetes/dcgm-exporter/images/ with --dcgm) with `digest:` entries, and drops the
# checkov skips that only tags need (CKV_K8S_43 digest, CKV_K8S_15 pull policy).
#
#   scripts/pin-image-digests.sh OVERLAY --registry REG [--image NAME=REF@sha256:D ...] [--dcgm]
#
#   OVERLAY      cpu-demo | gpu | tilert
#   --registry   where you pushed this repo's images (e.g. registry.example.com/expresslane): each image the overlay
#                names (expresslane/NAME:TAG) is looked up as REG/NAME:TAG with `docker buildx imagetools inspect`
#   --image      an explicit digest for one image (what your CI printed), NAME as the overlay names it; wins
#   --dcgm       also pin the DCGM exporter (gpu, tilert) from its registry
# Needs docker with buildx (only for images without --image). Prints what it wrote; exit 1 if any digest is missing.
set -euo pipefail
usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; }
[[ $# -ge 1 && "$1" != -h && "$1" != --help ]] || { usage; exit 0; }
overlay="$1"; shift
registry=""; dcgm=0; declare -A explicit=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --registry) registry="${2:?--registry needs a value}"; shift 2 ;;
    --image) explicit["${2%%=*}"]="${2#*=}"; shift 2 ;;
    --dcgm) dcgm=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "pin-image-digests: unknown argument $1" >&2; exit 2 ;;
  esac
done
root="$(cd "$(dirname "$0")/.." && pwd)"
dirs=()
case "$overlay" in
  cpu-demo) dirs+=("$root/kubernetes/overlays/cpu-demo/images") ;;
  gpu|tilert) dirs+=("$root/kubernetes/overlays/$overlay/app/images") ;;
  *) echo "pin-image-digests: unknown overlay $overlay (cpu-demo, gpu, tilert)" >&2; exit 2 ;;
esac
[[ "$dcgm" == 1 ]] && dirs+=("$root/kubernetes/dcgm-exporter/images")
for dir in "${dirs[@]}"; do
  python3 - "$dir/kustomization.yaml" "$registry" "$(declare -p explicit)" <<'PY'
import re, subprocess, sys
path, registry, explicit_decl = sys.argv[1], sys.argv[2], sys.argv[3]
explicit = dict(re.findall(r'\[([^\]]+)\]="([^"]*)"', explicit_decl))
text = open(path).read()
out, missing = [], []
for line in text.splitlines():
    m = re.match(r"  - \{name: ([^,]+)(?:, newName: ([^,]+))?, newTag: ([^}]+)\}$", line)
    if m:
        name, new_name, tag = m.group(1), m.group(2) or m.group(1), m.group(3)
        ref = explicit.get(new_name) or explicit.get(name)
        if ref is None:
            local = new_name.split("/", 1)[1] if new_name.startswith("expresslane/") else None
            source = f"{registry}/{local}:{tag}" if (registry and local) else f"{new_name}:{tag}"
            proc = subprocess.run(["docker", "buildx", "imagetools", "inspect", source, "--format",
                                   "{{.Manifest.Digest}}"], capture_output=True, text=True)
            if proc.returncode != 0 or not proc.stdout.strip().startswith("sha256:"):
                missing.append(f"{source}: {proc.stderr.strip()[:200]}")
                out.append(line)
                continue
            ref = f"{source.rsplit(':', 1)[0]}@{proc.stdout.strip()}"
        repo, digest = ref.split("@", 1)
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            sys.exit(f"pin-image-digests: {ref}: not NAME@sha256:<64 hex>")
        out.append(f"  - {{name: {name}, newName: {repo}, digest: {digest}}}")
        print(f"{path}: {name} -> {repo}@{digest}")
        continue
    if line.startswith("  checkov.io/skip") and ("CKV_K8S_43" in line or "CKV_K8S_15" in line):
        continue
    out.append(line)
if missing:
    sys.exit("pin-image-digests: no digest for\n  " + "\n  ".join(missing))
text = "\n".join(out) + "\n"
text = re.sub(r"commonAnnotations:\n(?!  )", "", text)
open(path, "w").write(text)
PY
done
