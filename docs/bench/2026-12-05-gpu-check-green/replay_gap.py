"""Where the device's text-* rows lose time against the simulation (a record of this run; no GPU needed).

    python docs/bench/2026-12-05-gpu-check-green/replay_gap.py [RUN_DIR]      # replay-gap.txt

Plays the node's drafter over each replayed text at the engine's own calibrated costs (the row's `step_costs`),
following the greedy chain's rule (decode/chain.py): a forward is launched after a host sync (SYNCED) when it is
a verify or follows a plain step whose hint (`may_draft_next`) was True; otherwise it was queued ahead. Prints
the simulated verify / synced-plain / queued-plain counts, the device's verify / plain counts, the device's time
less the simulated time, and that gap per synced forward. Then the oracle rows (every draft right, k fixed): the
device's time less (verifies x the calibrated cost of k + 1 rows + plain steps x one row), per verify and as a
share of that verify's calibrated cost.
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "engine" / "src"))

from expresslane.engine.decode import SpeculationConfig, StepCosts  # noqa: E402
from expresslane.engine.decode.bench import load_texts, simulate_speedup  # noqa: E402


def main() -> None:
    run = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
    oracle = []
    texts = load_texts(str(REPO / "docs/bench/2026-12-04-cost-aware-drafter/texts.json"))
    for line in (run / "bench.jsonl").read_text().splitlines():
        r = json.loads(line)
        mode = str(r.get("mode", ""))
        if mode.startswith("oracle-k") and r.get("step_costs"):
            oracle.append(r)
        if not mode.startswith("text-") or not r.get("step_costs"):
            continue
        sc = r["step_costs"]
        costs = StepCosts(tuple(sc["lengths"]), tuple(sc["short"]), tuple(sc["long"]))
        prompt, output = texts[mode[len("text-"):]]
        sp = r["spec"]
        n_tok = sp["accepted_tokens"] + sp["verify_steps"] + sp["plain_steps"]
        d = SpeculationConfig(k=r.get("speculation_k") or 4).drafter(costs, start_length=r["context"] + len(prompt))
        out, at = output[:n_tok], r["context"] + len(prompt)
        tally: dict[str, int] = {}
        speedup = simulate_speedup(d, prompt, out, costs, 4, start=at, tally=tally)
        spec = sum(costs.at(at + j, 1)[0] for j in range(len(out) - 1)) / speedup
        nv, nps, npa = tally["verify"], tally["synced"], tally["queued"]
        gap = n_tok / r["tok_per_s"] - spec
        print(f'{Path(r["model"]).name[:9]:9s} {r["gemv"]:11s} {r["context"]:6d} {mode:20s} '
              f'sim verify/synced/queued {nv:3d}/{nps:3d}/{npa:3d}  device verify/plain '
              f'{sp["verify_steps"]:3d}/{sp["plain_steps"]:3d}  device - sim {gap * 1e3:6.2f} ms  '
              f'per synced forward {gap / max(1, nv + nps) * 1e6:6.1f} us  one-row step '
              f'{costs.at(r["context"], 1)[0] * 1e3:.3f} ms')

    for r in oracle:
        sc, sp, k = r["step_costs"], r["spec"], int(r["mode"][len("oracle-k"):])
        costs = StepCosts(tuple(sc["lengths"]), tuple(sc["short"]), tuple(sc["long"]))
        c = costs.at(r["context"] + 128, k + 1)  # mid-run position of the bench's 256 tokens
        n_tok = sp["accepted_tokens"] + sp["verify_steps"] + sp["plain_steps"]
        gap = n_tok / r["tok_per_s"] - (sp["verify_steps"] * c[k] + sp["plain_steps"] * c[0])
        per = gap / max(1, sp["verify_steps"])
        print(f'{Path(r["model"]).name[:9]:9s} {r["gemv"]:11s} {r["context"]:6d} {r["mode"]:20s} '
              f'verifies {sp["verify_steps"]:3d}  device - calibrated {gap * 1e3:6.2f} ms  per verify '
              f'{per * 1e6:6.1f} us = {per / c[k] * 100:4.1f} % of its calibrated cost')


if __name__ == "__main__":
    main()
