#!/bin/sh
# Grafana's start in expresslane (compose mounts this as the entrypoint of the upstream grafana/grafana image).
# The admin password comes from the environment, never from a default:
#   GF_SECURITY_ADMIN_PASSWORD__FILE  a secret file (the production overlay: compose `secrets:`), or
#   GRAFANA_ADMIN_PASSWORD            the value itself.
# With neither, GRAFANA_REQUIRE_ADMIN_PASSWORD=1 (production) refuses to start; otherwise (a local stack on
# 127.0.0.1) a random password is made once and kept in the data volume: /var/lib/grafana/admin-password.
set -eu
if [ -n "${GF_SECURITY_ADMIN_PASSWORD__FILE:-}" ]; then
  [ -s "$GF_SECURITY_ADMIN_PASSWORD__FILE" ] || {
    echo "grafana: GF_SECURITY_ADMIN_PASSWORD__FILE=$GF_SECURITY_ADMIN_PASSWORD__FILE is missing or empty; refusing to start" >&2
    exit 78
  }
elif [ -n "${GRAFANA_ADMIN_PASSWORD:-}" ]; then
  export GF_SECURITY_ADMIN_PASSWORD="$GRAFANA_ADMIN_PASSWORD"
elif [ "${GRAFANA_REQUIRE_ADMIN_PASSWORD:-0}" = "1" ]; then
  echo "grafana: no admin password (mount the grafana_admin_password secret: GF_SECURITY_ADMIN_PASSWORD__FILE, or set GRAFANA_ADMIN_PASSWORD); refusing to start" >&2
  exit 78
else
  generated=/var/lib/grafana/admin-password
  if [ ! -s "$generated" ]; then
    (umask 077; tr -dc 'A-Za-z0-9' </dev/urandom | head -c 24 >"$generated")
    echo "grafana: made a random admin password (read it: docker compose exec grafana cat $generated)" >&2
  fi
  export GF_SECURITY_ADMIN_PASSWORD__FILE="$generated"
fi
unset GRAFANA_ADMIN_PASSWORD
[ "${GF_SECURITY_ADMIN_PASSWORD:-}" != "admin" ] || { echo "grafana: refusing the password 'admin'" >&2; exit 78; }
exec /run.sh "$@"
