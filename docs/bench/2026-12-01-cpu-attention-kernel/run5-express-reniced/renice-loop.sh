#!/usr/bin/env bash
# experiment only: every 2 s give every thread of the express node nice -10 (the spinners stay at 0)
while true; do
  pid=$(pgrep -f "expresslane.engine.server" | head -1)
  [[ -n "$pid" ]] && for t in /proc/$pid/task/*; do renice -n -10 -p "$(basename "$t")" >/dev/null 2>&1; done
  sleep 2
done
