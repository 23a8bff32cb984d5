#!/usr/bin/env bash
# every 0.5 s: time, express node's summed schedstat (run ns, runqueue-wait ns) over its threads
while true; do
  pid=$(pgrep -f "expresslane.engine.server" | head -1)
  if [[ -n "$pid" ]]; then
    read run wait < <(cat /proc/$pid/task/*/schedstat 2>/dev/null | awk '{r+=$1; w+=$2} END {printf "%.0f %.0f\n", r, w}')
    echo "$(date -u +%H:%M:%S.%N | cut -c1-12) $pid $run $wait"
  fi
  sleep 0.5
done
