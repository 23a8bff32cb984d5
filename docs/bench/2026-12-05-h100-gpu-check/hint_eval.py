"""The prompt-lookup drafter's hint (`may_draft_next`) replayed on the CPU: after each plain step, does the hint
say "may draft" and does a proposal follow at the next step? A "yes" with no proposal costs a forward launched
after a read (the chain does not queue ahead); a "no" with a proposal costs a split verify (the queued step, then
the rest). Rules: `now` (the hint as built: the last n - 1 tokens head a key, n = 2..4), `n>=3` (only the last 2
or 3 tokens heading a 3- or 4-gram key), `never`. Texts: the copy model's recorded requests
(docs/bench/2026-12-04-cost-aware-drafter/texts.json) and random tokens after the bench's random prompts.

    PYTHONPATH=engine/src python3 docs/bench/2026-12-05-h100-gpu-check/hint_eval.py
"""

import json
import random
from pathlib import Path

import torch

from expresslane.engine.decode.speculative import PromptLookupDrafter

REPO = Path(__file__).resolve().parents[3]
V = 128256  # the shapes' vocabulary (Llama 3)
def hint(d, rule):
    toks = d.tokens
    def head_ok(n):
        if len(toks) < n - 1: return False
        head = tuple(toks[len(toks) - n + 1:])
        return head in d._heads or (len(toks) >= n and tuple(toks[-n:-1]) == head)
    if rule == "now": return any(head_ok(n) for n in range(2, 5))
    if rule == "n>=3": return any(head_ok(n) for n in range(3, 5))
    if rule == "never": return False
def run(prompt, out, rule):
    d = PromptLookupDrafter(); d.start(prompt + out[:1])
    i = 0; c = dict(yd=0, yn=0, nd=0, nn=0); prev = None
    while i < len(out) - 1:
        drafts = d.propose(4)
        if prev is not None:
            c[("y" if prev else "n") + ("d" if drafts else "n")] += 1
        if drafts:
            n = 0
            while n < len(drafts) and i + 1 + n < len(out) and drafts[n] == out[i + 1 + n]: n += 1
            emit = out[i + 1:i + 2 + n]; prev = None
        else:
            emit = out[i + 1:i + 2]
        d.extend(emit); i += len(emit)
        if not drafts: prev = hint(d, rule)
    return c
rng = random.Random(1)
t = json.load(open(REPO / "docs/bench/2026-12-04-cost-aware-drafter/texts.json"))["texts"]
texts = dict(t)
for ctx in (8192, 32768):
    p = torch.randint(0, V, (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    texts[f"random-{ctx}"] = {"prompt": p, "output": [rng.randrange(V) for _ in range(256)]}
for S, P, shape in ((0.144, 0.52, "1B"), (0.302, 1.1, "8B")):
    print(f"cost at {shape}: a sync for nothing {S} ms, a split verify {P} ms (estimated from the H100's step times)")
    for name, v in texts.items():
        row = []
        for rule in ("now", "n>=3", "never"):
            c = run(v["prompt"], v["output"], rule)
            row.append(f"{rule}: yes->none {c['yn']:3} no->draft {c['nd']:3} cost {c['yn']*S + c['nd']*P:6.2f} ms")
        print(f"  {name:15} " + " | ".join(row))
