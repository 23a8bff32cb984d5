#!/usr/bin/env python3
"""Prints the router-CPU table of one or more ab.json files (ab_router_overhead.py --out DIR/ab.json): per tree
and round, the per-request router CPU p50 / p90 / mean (threads' schedstat ns read before each request's send and
after its reply), the gross and idle-corrected means over the whole run (/proc ticks), and the idle rate; then per
tree the median over rounds of each column.

    python docs/bench/2026-12-02-router-fast-path/ab_table.py var/router-ab/ab.json [more.json ...]
"""
from __future__ import annotations

import json
import statistics
import sys

COLS = [("router_cpu_ms_p50", "p50 ms"), ("router_cpu_ms_p90", "p90 ms"), ("router_cpu_ms_mean", "mean ms"),
        ("router_cpu_ms_per_request", "gross ms"), ("router_cpu_ms_per_request_net", "net ms"),
        ("router_idle_cpu_ms_per_s", "idle ms/s"), ("overhead_p50_ms", "latency overhead p50 ms")]


def main(paths: list[str]) -> int:
    for path in paths:
        rows = json.load(open(path))
        print(f"## {path}")
        print("| tree | round | " + " | ".join(h for _, h in COLS) + " |")
        print("|---|---|" + "---:|" * len(COLS))
        by_tree: dict[str, list[dict]] = {}
        for r in rows:
            by_tree.setdefault(r["code"], []).append(r)
            print(f"| {r['code']} | {r['round']} | " + " | ".join(str(r.get(k)) for k, _ in COLS) + " |")
        for tree, rs in by_tree.items():
            med = []
            for k, _ in COLS:
                xs = [r[k] for r in rs if r.get(k) is not None]
                med.append(f"{statistics.median(xs):.3f}" if xs else "-")
            print(f"| {tree} | median | " + " | ".join(med) + " |")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
