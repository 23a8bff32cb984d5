"""Block shapes decided by the step they run in.

models/fused.py's `pick_config` times each kernel's candidate block shapes alone (`triton.testing.do_bench`: one
launch from Python after an L2 flush, no neighbours). The lean step runs them as one CUDA graph, each kernel
started early by programmatic dependent launch behind the one before it and reading the weights of its own
layer. The two disagree by more than the margin between the best candidates: on the H200 at the 8B shape the
picks by `do_bench` were 1.8 % a layer slower in graph replay than the fastest candidate (qkv, o_proj, gate_up;
docs/bench/2026-12-05-h200-hint-packed/), and the plain engine ran 244.2 tok/s against 250.0 with other picks.
Replaying one kernel alone in a graph does not settle it either: an o_proj's 32 MiB of weights stay in the
H200's L2 from one replay to the next, which the step's 32 layers never do.

So after the first forward has picked every kernel, `refine` takes each timed pick in turn (the step's order)
and its candidates within CANDIDATE_SLACK of the fastest alone (at most MOST_TRIED, the current pick always
among them), captures the whole step once per candidate with the other kernels as picked, and times the
graphs' replays side by side. A plain step keeps the candidate whose step is fastest. A step that also
verifies `rows` rows (the CUDA-core family of a speculating engine: one block shape for every row count) keeps,
among the candidates whose one-row step is within VERIFY_SLACK of the fastest, the one whose `rows`-row step is
fastest: the verify's gain bought with at most that much of every plain step. The rule is `choose`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from . import fused

CANDIDATE_SLACK = 0.05  # candidates within this fraction of the fastest alone are timed in the step
MOST_TRIED = 5  # and at most this many of them (the fastest alone first), besides the current pick
#: A verifying step's pick may cost every one-row step this fraction, per kernel, for a faster verify.
VERIFY_SLACK = 0.003
ROUNDS = 3  # rounds over the candidates' graphs (the best round kept: noise on a device only adds)
REPS = 4  # replays a round, timed together


Shape = tuple[int, ...]


def candidates(pick: fused.TimedPick, slack: float = CANDIDATE_SLACK, most: int = MOST_TRIED) -> list[Shape]:
    """The pick's block shapes worth timing in the step: the current pick, then up to `most` of those within
    `slack` of the fastest alone, fastest first."""
    fastest = min(pick.one_row.values())
    close = sorted((c for c in pick.one_row if pick.one_row[c] <= fastest * (1 + slack)), key=pick.one_row.get)
    return [pick.picked] + [c for c in close if c != pick.picked][:most]


def choose(one_row: dict[Shape, float], verify: dict[Shape, float] | None,
           slack: float = VERIFY_SLACK) -> Shape:
    """The shape a step keeps from its step times: the fastest one-row step; with `verify` (the `rows`-row
    step's time of each shape), of the shapes within `slack` of the fastest one-row step, the fastest verify.
    Ties keep the earlier shape (the current pick first)."""
    fastest = min(one_row, key=one_row.get)
    if not verify:
        return fastest
    close = [c for c in one_row if c in verify and one_row[c] <= one_row[fastest] * (1 + slack)]
    return min(close, key=verify.get) if close else fastest


def _captured(run: Callable[[], object], device: torch.device) -> torch.cuda.CUDAGraph:
    """`run` captured as a CUDA graph, after one run on a side stream (it loads the kernels, as capture
    requires)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        run()
    return graph


def replay_ms(graphs: list[torch.cuda.CUDAGraph], rounds: int = ROUNDS, reps: int = REPS) -> list[float]:
    """Each graph's milliseconds a replay: the best of `rounds` rounds, each round `reps` replays of every graph
    in turn (one warm replay first), so a drift of the device's clock reaches every candidate alike."""
    best = [math.inf] * len(graphs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for i, g in enumerate(graphs):
            g.replay()
            start.record()
            for _ in range(reps):
                g.replay()
            end.record()
            end.synchronize()
            best[i] = min(best[i], start.elapsed_time(end) / reps)
    return best


def refine(run: Callable[[int], object], rows: int, picks: Iterable[fused.TimedPick],
           device: torch.device) -> list[dict]:
    """Re-decide each pick by the step's time (see the module's docstring). `run(r)`: one forward of the step
    over r rows on scratch buffers and cache rows (captured, then replayed); `rows`: the most rows the step
    runs. Returns what was measured, one entry per pick (also in its TUNING_LOG entry: step_us, step_us_rows)."""
    out = []
    for pick in picks:
        if pick.step_timed:
            continue
        pick.step_timed = True
        shapes = candidates(pick)
        if len(shapes) < 2:
            continue
        verify_rows = rows if pick.rows > 1 and rows > 1 else None
        graphs, labels = [], []
        for cfg in shapes:
            fused.repick(pick, cfg, compile=False)  # its one-row and `rows`-row kernels were compiled to time
            graphs.append(_captured(lambda: run(1), device))
            labels.append((cfg, 1))
            if verify_rows:
                graphs.append(_captured(lambda: run(verify_rows), device))
                labels.append((cfg, verify_rows))
        times = replay_ms(graphs)
        del graphs
        one = {cfg: t for (cfg, r), t in zip(labels, times) if r == 1}
        many = {cfg: t for (cfg, r), t in zip(labels, times) if r != 1}
        best = choose(one, many or None)
        fused.repick(pick, best)
        pick.log["step_us"] = {fused._label(c): round(1e3 * t, 1) for c, t in one.items()}
        if many:
            pick.log["step_us_rows"] = {fused._label(c): round(1e3 * t, 1) for c, t in many.items()}
        out.append({"kernel": pick.log["kernel"], "n": pick.log["n"], "k": pick.log["k"],
                    "was": fused._label(shapes[0]), "best": fused._label(best),
                    "step_us": pick.log["step_us"], **({"step_us_rows": pick.log["step_us_rows"]} if many else {})})
    return out
