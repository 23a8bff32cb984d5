"""Would the drafter earn more if it weighed the host sync a verify brings? (a record; no GPU needed)

    python docs/bench/2026-12-05-sync-penalty-policy/policy_sim.py      # > policy-sim.txt

A verify is launched after a host sync, and so is the plain step after it (decode/chain.py: only a plain step
after a plain step whose drafter said it cannot draft is queued ahead of the host). On the H200 the device lost
100-200 us a synced forward at the 1B shape, 140-550 us at 8B with the CUDA-core GEMVs, against the simulation
at the engine's calibrated costs (../2026-12-05-gpu-check-green/replay-gap.txt). The hypothesis there: fold that
loss into the costs the drafter weighs, and it earns more.

For each text row of that run (its own calibrated `step_costs`), this plays the node's drafter over the recorded
request (bench.simulate_speedup) with a penalty p (a fraction of a one-row step) charged to every synced forward,
twice: the drafter as it is (weighing the calibrated costs), and a drafter that weighs every verify at its
calibrated cost + p. Prints plain time over speculative time for each p, as "as it is -> aware".

Then, at the penalty the device measured (0.15 of a step at 1B, 0.05 at 8B), the drafter as it is three ways:
as the chain runs now; with the step after a verify queued ahead wherever the drafter, once it knows the
verify's tokens, says it cannot draft next (`verify_queues_ahead`: the most a verify that advanced the chain on
the device could give); and with no penalty at all (what removing the host sync would give).
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "engine" / "src"))

from expresslane.engine.decode import SpeculationConfig, StepCosts  # noqa: E402
from expresslane.engine.decode.bench import load_texts, simulate_speedup  # noqa: E402

PENALTIES = (0.0, 0.05, 0.10, 0.15, 0.20)


class VerifyPenalty:
    """`costs` with `pen` added to every forward of more than one row (what an aware drafter weighs)."""

    def __init__(self, costs: StepCosts, pen: float) -> None:
        self.costs, self.pen = costs, pen

    def at(self, length: int, rows: int) -> list[float]:
        c = self.costs.at(length, rows)
        return c[:1] + [x + self.pen for x in c[1:]]


def main() -> None:
    run = REPO / "docs/bench/2026-12-05-gpu-check-green/bench.jsonl"
    texts = load_texts(str(REPO / "docs/bench/2026-12-04-cost-aware-drafter/texts.json"))
    print("p = penalty per synced forward, in one-row steps; plain time / speculative time: as it is -> aware")
    rows = []
    for line in run.read_text().splitlines():
        r = json.loads(line)
        mode = str(r.get("mode", ""))
        if not mode.startswith("text-") or not r.get("step_costs"):
            continue
        sc = r["step_costs"]
        costs = StepCosts(tuple(sc["lengths"]), tuple(sc["short"]), tuple(sc["long"]))
        prompt, output = texts[mode[len("text-"):]]
        at = r["context"] + len(prompt)
        c1 = costs.at(at, 1)[0]
        cells = []
        for frac in PENALTIES:
            pen = frac * c1
            runs = [simulate_speedup(SpeculationConfig(k=4).drafter(weighed, start_length=at), prompt, output,
                                     costs, 4, start=at, sync_overhead=pen)
                    for weighed in (costs, VerifyPenalty(costs, pen))]
            cells.append(f"p={frac:.2f} {runs[0]:.3f}->{runs[1]:.3f}")
        print(f'{Path(r["model"]).name[:9]:9s} {r["gemv"]:11s} {r["context"]:6d} {mode:20s} ' + "  ".join(cells))
        rows.append((r, costs, prompt, output, at, c1))
    print("\nat the measured penalty: the chain as it is / a verify that queues the next step ahead (upper bound) / "
          "no host sync")
    for r, costs, prompt, output, at, c1 in rows:
        pen = (0.15 if "1b" in r["model"] else 0.05) * c1
        runs = [simulate_speedup(SpeculationConfig(k=4).drafter(costs, start_length=at), prompt, output, costs, 4,
                                 start=at, sync_overhead=p, verify_queues_ahead=ahead)
                for p, ahead in ((pen, False), (pen, True), (0.0, False))]
        print(f'{Path(r["model"]).name[:9]:9s} {r["gemv"]:11s} {r["context"]:6d} {r["mode"]:20s} '
              + " / ".join(f"{x:.3f}" for x in runs))


if __name__ == "__main__":
    main()
