#!/usr/bin/env bash
# every 0.5 s: time, then per thread of the express node: tid run_ns wait_ns
while true; do
  pid=$(pgrep -f "expresslane.engine.server" | head -1)
  if [[ -n "$pid" ]]; then
    line="$(date -u +%H:%M:%S.%N | cut -c1-12)"
    for t in /proc/$pid/task/*; do read r w n < $t/schedstat 2>/dev/null && line="$line $(basename $t):$r:$w"; done
    echo "$line"
  fi
  sleep 0.5
done
