"""GreedyChain: greedy decode steps queued one ahead of the host.

The plain token loop (engine.py) syncs once a token: it launches step n, waits for its argmax on the host
(`.item()`), and only then launches step n + 1, so the GPU idles for the host's share of every token (the
Python loop, the stop checks, handing the token to the server: 0.08-0.22 ms a token on the H200, measured as
the gap between the graph replay's time and the loop's). For greedy sampling the next step's input is known on
the device as soon as this step ends, so the chain keeps the device one step ahead:

    start(token, pos)         the runner's device buffers hold `token` at `pos`
    submit() -> step n        StepRunner.greedy_step: the step, then argmax -> token buffer, pos + 1
                              (inside the step's CUDA graph), then a copy of the token into a pinned host slot
                              and an event, all queued on the stream (the lean step: no copy, see below)
    result(step n) -> int     waits for step n's token only: step n + 1 is already queued behind it

The engine submits step n + 1 before it reads step n's token. When the stream stops (a stop token, the length
limit, a cancel), the one step already queued runs to the end and its token is dropped: it wrote the K/V of
the last emitted token one row past the cache's live length, which attention never reads and the next request
overwrites (the same rule as a rejected draft's rows). It never writes past the row the plain loop would reach
for the same request's limit (the engine submits no step whose token the limit would not take).

Exactness: the argmax is the same operation on the same float32 logits as Sampler.sample for greedy, so the
chain's tokens are the plain loop's (tests/unit/engine/test_greedy_chain.py). It is used only where the plain
loop's token is that argmax alone: greedy, no grammar, no logprobs, no logits processing; with or without a
drafter.

Under speculation (prompt lookup, the express node's default) most steps on text that does not repeat have no
draft; the engine (DecodeEngine._run_chain) runs those on the chain too, in two states (ChainState):

    SYNCED   nothing queued. The drafter's proposal picks the forward, as in the per-token loop: drafts, one
             verify of rows [token, *drafts]; none, start the chain and queue a step -> AHEAD.
    AHEAD    one step queued whose input is the last emitted token: it is row 0 of the next forward, whatever
             the drafter proposes once that token is known.
             no drafts   a plain step. Queue the step after it when the limit takes its token and the drafter
                         says it cannot draft there (`may_draft_next`, below), then read it: still AHEAD;
                         otherwise read it -> SYNCED.
             drafts d    (the hint was wrong) read it: the target's token after the context. If it is d[0],
                         verify the rest with one forward of rows d at the next position (row i's argmax is the
                         target's token after d[:i + 1]); either way the kept tokens are those of the one verify
                         forward of the per-token loop (`greedy_accept`) -> SYNCED.
             one draft   the rest of that verify is one row, the draft at the next position: the chain's next
                         step if the draft is right, the next plain step if it is wrong. So it is queued before
                         the read; a wrong draft stays AHEAD, a right one -> SYNCED.

The hint: `Drafter.may_draft_next()` is False where the next proposal is predicted empty whatever token comes
next (prompt lookup: the context's last n - 1 tokens head no key of its index for n = 3, 4, 2-grams left out
because on text that does not repeat the last token alone heads a key at up to a fifth of the steps while the
next token almost never completes it; the adaptive drafter: pausing). Only there is a plain step's successor
queued ahead, so with a right hint no queued step is ever row 0 of a verify, and every verify is the per-token
loop's one forward; a "may" where no draft follows costs the sync the queue-ahead saves. A drafter without the
hint is taken to draft anywhere, so its plain steps do not run ahead (DraftModelDrafter says as much: it drafts
every step).

The drafter is asked at the same points with the same context and k (the hint is read-only), the counters
(SpecStats) record the same steps, and every row written lies inside the rows the per-token loop writes for
the request's limit. Where a hint is wrong, a verify entered from AHEAD whose first draft is kept runs as two
forwards (the queued step and the rest, counted on Generation.split_verifies) where the per-token loop runs
one; where its first draft is wrong it is one forward of one row instead of 1 + len(d) rows
(tests/unit/engine/test_lookup_chain.py).

Off a GPU (the eager or compiled CPU step) the same steps run synchronously: nothing overlaps, and the result
is read from the token buffer directly.

With the lean step on a GPU (models/lean.py) the greedy step writes its token itself, with the step's number,
into a ring of pinned host memory (StepRunner.start_greedy returns it): nothing is queued between two steps' graphs,
and result() polls the ring slot of step n's number (yielding the GIL each poll, READ_TIMEOUT_S at most). The
copy and the event cost 10 us a step on the H200 (docs/bench/2026-12-02-gpu-pdl-argmax/).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

import torch

from .runner import StepRunner


class ChainState(str, enum.Enum):
    SYNCED = "synced"  # nothing queued on the device
    AHEAD = "ahead"  # one step queued: its input is the last emitted token


def greedy_accept(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """Greedy verification: targets[i] is the target's argmax after the context and drafts[:i] (len(drafts)
    + 1 of them). Returns the tokens to emit: the longest prefix of drafts that matches, then the target's own
    token (Sampler.verify's greedy rule)."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return [*drafts[:n], targets[n]]


class GreedyChain:
    #: Pinned host slots and events: at most two steps are outstanding (the one read, the one queued).
    DEPTH = 4
    #: How long result() waits for a step's token in the ring before it says the device did not finish it.
    READ_TIMEOUT_S = 60.0

    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner
        self._cuda = runner.device.type == "cuda"
        self._ring: torch.Tensor | None = None  # the lean step's token ring (start() asks the runner)
        self._ring_view = None
        self._seq0 = 0
        self._pos = 0
        self._submitted = 0
        if self._cuda:
            self._host = torch.empty(self.DEPTH, dtype=torch.long, pin_memory=True)
            self._events = [torch.cuda.Event() for _ in range(self.DEPTH)]
        self._cpu_results: dict[int, int] = {}

    @property
    def submitted(self) -> int:
        """Steps submitted since `start`."""
        return self._submitted

    def start(self, token: int, pos: int) -> None:
        """The next step takes `token` at position `pos`."""
        ring = self.runner.start_greedy(token, pos)  # sets the buffers first, then captures if need be
        self._ring = ring[0] if ring is not None else None
        if ring is not None:
            self._ring_view = ring[0].numpy()  # pinned host memory the step writes: read it in place
            self._seq0 = ring[1]  # steps counted so far (on the host: no read of the device)
        self._pos = pos
        self._submitted = 0
        self._cpu_results.clear()

    def submit(self) -> int:
        """Queue the next step; returns its number (0, 1, ...) for `result`."""
        n = self._submitted
        tok = self.runner.greedy_step(self._pos + n)
        if self._ring is not None:
            pass  # the step writes its token into the ring itself
        elif self._cuda:
            slot = n % self.DEPTH
            with torch.inference_mode():
                self._host[slot:slot + 1].copy_(tok, non_blocking=True)
            self._events[slot].record()
        else:
            self._cpu_results[n] = int(tok.item())
        self._submitted = n + 1
        return n

    def result(self, n: int) -> int:
        """Step n's token (blocks until step n is done, not the steps queued after it). Read each step's
        result before DEPTH - 1 more steps are submitted."""
        if not self._cuda:
            return self._cpu_results.pop(n)
        if self._submitted - n >= self.DEPTH:
            raise RuntimeError(f"step {n}'s host slot was reused: read results at most {self.DEPTH - 1} behind")
        if self._ring is not None:
            return self._read_ring(n)
        slot = n % self.DEPTH
        self._events[slot].synchronize()
        return int(self._host[slot])

    def _read_ring(self, n: int) -> int:
        """Step n's token from the lean step's ring: wait until its slot holds step n's number. The wait yields
        the GIL every poll (the node's server threads keep running) and gives up after READ_TIMEOUT_S."""
        seq = self._seq0 + n + 1
        want, slot, ring = seq & 0x7FFFFFFF, seq % len(self._ring_view), self._ring_view
        deadline = None
        while True:
            value = int(ring[slot])
            if value >= 0 and value >> 32 == want:
                return value & 0xFFFFFFFF
            if deadline is None:
                deadline = time.monotonic() + self.READ_TIMEOUT_S
            elif time.monotonic() > deadline:
                raise RuntimeError(f"greedy step {n} did not finish on the device in {self.READ_TIMEOUT_S:.0f} s")
            time.sleep(0)
