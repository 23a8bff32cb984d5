#!/usr/bin/env bash
# THE test command (README, .ci/run): install from the project's own files, then run the whole suite:
# unit tests, integration tests that start the real processes, and (where a Docker engine can be
# started, i.e. EXPRESSLANE_COMPOSE=1 as in CI) the compose end-to-end test. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-dev.sh
exec .venv/bin/python -m pytest "$@"
