#!/usr/bin/env bash
# THE test command (README, .ci/run): install from the project's own files, then run the whole suite:
# unit tests, integration tests that start the real processes (vLLM, NIXL, the express decode server,
# the router, Prometheus), and, with EXPRESSLANE_COMPOSE=1 (as in CI), the compose end-to-end test.
# Extra args go to pytest.
#
# Prometheus and promtool (the dashboards' live test, the alert-rule tests) are the tests' own: unpacked from
# Debian's prometheus .deb (`apt-get download` + `dpkg -x`, no root needed, nothing installed or started on the
# host) into $EXPRESSLANE_CACHE/prometheus-<version>/ and handed to the tests as PROMETHEUS_BIN / PROMTOOL_BIN.
# Each test starts its own instance with its own config, data directory and a free port. Set PROMETHEUS_BIN and
# PROMTOOL_BIN yourself to use other binaries (e.g. prom/prometheus v3's).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-dev.sh

EXPRESSLANE_CACHE="${EXPRESSLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/expresslane}"
prometheus_tools() {  # sets PROMETHEUS_BIN and PROMTOOL_BIN, unpacking Debian's package when needed
  if [[ -n "${PROMETHEUS_BIN:-}" && -n "${PROMTOOL_BIN:-}" ]]; then return 0; fi
  command -v apt-get >/dev/null && command -v dpkg >/dev/null \
    || { echo "test: no apt-get/dpkg to fetch prometheus; set PROMETHEUS_BIN and PROMTOOL_BIN" >&2; return 1; }
  local version dir
  version="$(apt-cache policy prometheus 2>/dev/null | awk '/Candidate:/ {print $2}')"
  if [[ -z "$version" || "$version" == "(none)" ]]; then
    echo "test: apt has no prometheus candidate; running apt-get update (lists only)" >&2
    apt-get update -qq >/dev/null 2>&1 || true
    version="$(apt-cache policy prometheus 2>/dev/null | awk '/Candidate:/ {print $2}')"
  fi
  [[ -n "$version" && "$version" != "(none)" ]] || { echo "test: no prometheus package in apt" >&2; return 1; }
  dir="$EXPRESSLANE_CACHE/prometheus-${version//[^A-Za-z0-9.+-]/_}"
  if [[ ! -x "$dir/usr/bin/promtool" ]]; then
    local tmp
    tmp="$(mktemp -d)"
    echo "test: apt-get download prometheus=$version -> $dir" >&2
    (cd "$tmp" && apt-get download -q "prometheus=$version" >/dev/null 2>&1) \
      || { rm -rf "$tmp"; echo "test: apt-get download prometheus failed" >&2; return 1; }
    mkdir -p "$dir" && dpkg -x "$tmp"/prometheus_*.deb "$dir" && rm -rf "$tmp"
  fi
  export PROMETHEUS_BIN="${PROMETHEUS_BIN:-$dir/usr/bin/prometheus}" PROMTOOL_BIN="${PROMTOOL_BIN:-$dir/usr/bin/promtool}"
  echo "test: prometheus $("$PROMETHEUS_BIN" --version 2>&1 | head -1 | awk '{print $3}') from $PROMETHEUS_BIN" >&2
}
prometheus_tools
exec .venv/bin/python -m pytest "$@"
