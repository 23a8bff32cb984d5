#!/usr/bin/env bash
# The router: the single OpenAI-compatible front door. Its config file interpolates ${VAR:-default}
# from the environment, so compose and the dev stack share compose/config/router.yaml.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/common.sh"
ROUTER_CONFIG="${ROUTER_CONFIG:-$here/../../compose/config/router.yaml}"
exec "$PYTHON" -m expresslane.router --config "$ROUTER_CONFIG" "$@"
