#!/usr/bin/env bash
# THE test command (README, .ci/run): install from the project's own files, then run the whole suite:
# unit tests, integration tests that start the real processes (vLLM, NIXL, the express decode server,
# the router, Prometheus), and, with EXPRESSLANE_COMPOSE=1 (as in CI), the compose end-to-end test.
# Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-dev.sh
# The dashboards' live test runs every panel query against a real Prometheus (Debian's package).
if ! command -v prometheus >/dev/null 2>&1 && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
  echo "test: installing prometheus (apt)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
    >/tmp/expresslane-apt-prometheus.log 2>&1 || { cat /tmp/expresslane-apt-prometheus.log; exit 1; }
  # Debian starts the packaged service on :9090; the tests run their own instance.
  (systemctl stop prometheus 2>/dev/null || service prometheus stop 2>/dev/null || pkill -x prometheus) || true
fi
exec .venv/bin/python -m pytest "$@"
