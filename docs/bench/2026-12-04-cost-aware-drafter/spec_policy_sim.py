#!/usr/bin/env python3
"""What the express engine's drafter earns on recorded text at measured step costs, without a GPU.

    python docs/bench/2026-12-04-cost-aware-drafter/spec_policy_sim.py --texts docs/bench/2026-12-04-cost-aware-drafter/texts.json \
        --costs docs/bench/2026-12-04-gpu-check/bench.jsonl [--costs MORE.jsonl] [--overhead 0.08]

Greedy output is fixed, so a draft is kept exactly where it matches the recorded output: the engine's loop can
be played over a recorded request (its prompt and greedy output: docs/bench/2026-12-04-copy-acceptance/make_copy_model.py --texts) with any
drafter, charging each step what a forward of that many rows costs (`step_ms_by_rows` of the decode bench's
JSON lines, per model / GEMV family / context; two contexts make the costs' length dependence, one is used for
every length). For each cost table and text it prints plain time over speculative time for:

* adaptive: the node's drafter (prompt lookup behind AdaptiveDrafter, given those costs); with --margin, one row
  per margin (what a verify must gain over a plain step) instead;
* lookup k=4: prompt lookup with no policy (every proposal verified in full);
* always wrong: the adaptive drafter over a drafter whose k drafts are never right (the worst case).

--overhead adds that fraction of a one-row step to every verify (a host wait the bench's back-to-back timing
does not hold; the engine's own calibration at warm-up does). A prediction, not a measurement: the GPU check's
`text-*` rows (bench --replay-text) measure the same drafter on the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "engine" / "src"))  # from docs/bench/<note>/

from expresslane.engine.decode import AdaptiveDrafter, PromptLookupDrafter, SpeculationConfig, StepCosts  # noqa: E402
from expresslane.engine.decode.bench import load_texts, simulate_speedup  # noqa: E402


class AlwaysWrong:
    def start(self, context):
        pass

    def propose(self, k):
        return [-1] * k

    def extend(self, tokens):
        pass


def cost_tables(paths: list[str]) -> dict[str, StepCosts]:
    """{"model gemv": StepCosts} from bench JSON lines: the shortest and the longest context measured."""
    by_key: dict[str, dict[int, list[float]]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            rows = r.get("step_ms_by_rows") or {}
            if len(rows) < 2:
                continue  # an engine without speculation: no verify rows timed
            key = f"{Path(r['model']).name} {r.get('gemv', '-')}"
            by_key.setdefault(key, {})[int(r["context"])] = [rows[str(t)] if str(t) in rows else rows[t]
                                                             for t in range(1, len(rows) + 1)]
    tables = {}
    for key, ctx in by_key.items():
        lo, hi = min(ctx), max(ctx)
        if lo == hi:
            tables[key] = StepCosts((lo, lo + 1), tuple(ctx[lo]), tuple(ctx[lo]))
        else:
            tables[key] = StepCosts((lo, hi), tuple(ctx[lo]), tuple(ctx[hi]))
    return tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", required=True)
    ap.add_argument("--costs", action="append", required=True, help="decode bench JSON lines (repeatable)")
    ap.add_argument("--overhead", type=float, default=0.0, help="a verify's extra cost, in one-row steps")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--margin", type=float, action="append",
                    help="the adaptive drafter's margin (repeatable: one row each); default: the drafter's own")
    args = ap.parse_args()
    texts = load_texts(args.texts)
    tables = cost_tables(args.costs)
    if not tables:
        ap.error("no bench row with step_ms_by_rows of two or more rows in --costs")
    print(f"plain time / speculative time, k <= {args.k}, verify overhead {args.overhead} of a step")
    for key, costs in sorted(tables.items()):
        print(f"== {key} (costs at contexts {costs.lengths[0]} .. {costs.lengths[1]})")
        names = list(texts)
        print(f"  {'drafter':14s}" + "".join(f"{n:>16s}" for n in names) + f"{'geomean':>10s}")
        margins = args.margin or [None]
        labels = [("adaptive" if m is None else f"margin {m:g}", m) for m in margins]
        for label, margin in [*labels, ("lookup k=4", None), ("always wrong", None)]:
            got = []
            for prompt, output in texts.values():
                known = StepCosts(costs.lengths,
                                  tuple(c + (args.overhead * costs.short[0] if i else 0) for i, c in enumerate(costs.short)),
                                  tuple(c + (args.overhead * costs.long[0] if i else 0) for i, c in enumerate(costs.long)))
                if label.startswith(("adaptive", "margin")):
                    d = SpeculationConfig(k=args.k).drafter(known, start_length=len(prompt))
                    if margin is not None:
                        d.margin = margin
                elif label == "lookup k=4":
                    d = PromptLookupDrafter()
                else:
                    d = AdaptiveDrafter(AlwaysWrong(), known, start_length=len(prompt))
                got.append(simulate_speedup(d, prompt, output, costs, args.k,
                                            verify_overhead=args.overhead * costs.short[0]))
            print(f"  {label:14s}" + "".join(f"{g:>15.3f}x" for g in got)
                  + f"{statistics.geometric_mean(got):>9.3f}x")


if __name__ == "__main__":
    main()
