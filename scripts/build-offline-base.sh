#!/usr/bin/env bash
# Build expresslane's base images from Debian packages, for machines that reach Debian and PyPI but no image
# registry. Two images, made with debootstrap (--variant=minbase) and `docker import`:
#
#   ${OFFLINE_DEBIAN_IMAGE:-expresslane/debian:bookworm}      stand-in for debian:bookworm-slim
#   ${OFFLINE_PYTHON_IMAGE:-expresslane/python:3.11-bookworm}  stand-in for python:3.11-slim-bookworm
#                                                               (Debian's python3.11 + venv + pip)
#
# Point the Dockerfiles at them through the build args compose passes (see .env.example):
#   DEBIAN_BASE_IMAGE=expresslane/debian:bookworm PYTHON_BASE_IMAGE=expresslane/python:3.11-bookworm \
#     docker compose up -d --build --wait
#
# Usage: scripts/build-offline-base.sh [--force]
#   --force   rebuild even if the tags already exist.
# Env: DEBIAN_MIRROR (default http://deb.debian.org/debian), DEBIAN_SUITE (default bookworm),
#      WORK_DIR (default a temp dir; removed afterwards).
# Needs root, debootstrap (installed with apt-get if missing) and a running Docker engine.
set -euo pipefail

DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DEBIAN_SUITE="${DEBIAN_SUITE:-bookworm}"
OFFLINE_DEBIAN_IMAGE="${OFFLINE_DEBIAN_IMAGE:-expresslane/debian:bookworm}"
OFFLINE_PYTHON_IMAGE="${OFFLINE_PYTHON_IMAGE:-expresslane/python:3.11-bookworm}"
force=0
[[ "${1:-}" == "--force" ]] && force=1

log() { printf '[build-offline-base] %s\n' "$*" >&2; }
have_image() { docker image inspect "$1" >/dev/null 2>&1; }

if [[ $force == 0 ]] && have_image "$OFFLINE_DEBIAN_IMAGE" && have_image "$OFFLINE_PYTHON_IMAGE"; then
  log "already built: $OFFLINE_DEBIAN_IMAGE $OFFLINE_PYTHON_IMAGE (use --force to rebuild)"
  exit 0
fi
[[ $(id -u) == 0 ]] || { log "must run as root (debootstrap)"; exit 1; }
docker info >/dev/null 2>&1 || { log "no Docker engine answers; start dockerd first"; exit 1; }
if ! command -v debootstrap >/dev/null; then
  log "installing debootstrap"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

work="${WORK_DIR:-$(mktemp -d /var/tmp/expresslane-base.XXXXXX)}"
rootfs="$work/rootfs"
cleanup() { rm -rf "$work"; }
trap cleanup EXIT

# One debootstrap run; the Python image is that Debian tree plus python3 installed with apt in a chroot.
tidy() {  # tidy DIR: no apt lists, caches, docs or logs in the image
  local dir="$1"
  chroot "$dir" apt-get clean
  rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin "$dir"/usr/share/doc/* "$dir"/usr/share/man/* \
    "$dir"/tmp/* "$dir"/var/log/*.log
  : >"$dir/etc/resolv.conf"
}

import() {  # import DIR TAG CHANGES...
  local dir="$1" tag="$2"; shift 2
  local changes=()
  for c in "$@"; do changes+=(--change "$c"); done
  tar --numeric-owner -C "$dir" -c . | docker import "${changes[@]}" - "$tag" >/dev/null
  log "tagged $tag ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}'))"
}

t0=$SECONDS
log "debootstrap $DEBIAN_SUITE (minbase) -> $OFFLINE_DEBIAN_IMAGE"
debootstrap --variant=minbase "$DEBIAN_SUITE" "$rootfs" "$DEBIAN_MIRROR" >"$work/debootstrap.log" 2>&1 \
  || { tail -30 "$work/debootstrap.log" >&2; log "debootstrap failed"; exit 1; }
# The apt sources a debian:bookworm image has (main + updates + security).
printf 'deb %s %s main\ndeb %s %s-updates main\ndeb http://deb.debian.org/debian-security %s-security main\n' \
  "$DEBIAN_MIRROR" "$DEBIAN_SUITE" "$DEBIAN_MIRROR" "$DEBIAN_SUITE" "$DEBIAN_SUITE" >"$rootfs/etc/apt/sources.list"
tidy "$rootfs"
import "$rootfs" "$OFFLINE_DEBIAN_IMAGE" 'ENV LANG=C.UTF-8' 'CMD ["bash"]'

log "apt-get install python3 (3.11) venv pip -> $OFFLINE_PYTHON_IMAGE"
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
chroot "$rootfs" /bin/sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends ca-certificates python3 python3-venv python3-pip >/dev/null' \
  || { log "apt-get install in the chroot failed"; exit 1; }
ln -sf python3 "$rootfs/usr/bin/python"
tidy "$rootfs"
import "$rootfs" "$OFFLINE_PYTHON_IMAGE" 'ENV LANG=C.UTF-8' 'ENV PYTHONUNBUFFERED=1' 'CMD ["python3"]'

version="$(docker run --rm "$OFFLINE_PYTHON_IMAGE" python3 -c 'import sys, venv, ensurepip; print(sys.version.split()[0])')"
log "python in $OFFLINE_PYTHON_IMAGE: $version"
log "done in $((SECONDS - t0)) s"
