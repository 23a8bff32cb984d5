"""Several users on one engine: every active request's rows in one forward a step, each bit-identical to alone.

A `DecodeEngine(seats=S)` holds up to S requests, each in its own seat of the static cache (decode/cache.py),
with its own position, sampler, drafter and grammar (a decode/sequence.py SequenceRun). `SeatScheduler.step`
runs one forward over all of them:

    settle     each request's pending tokens are appended (stop rules); finished or cancelled ones leave
    plan       each request's rows: its last token, then the drafts worth verifying in a step this wide
    forward    one forward over every row (runner.forward_rows): the projections read each weight once for all
               rows; each request's attention reads its own seat
    deliver    while the device runs that forward, the settled tokens go to their listeners (the node's event
               loop) and the requests that left are told so: a step's host work for its users' streams hides
               under the device's step instead of running between steps (on a CPU, which computes the step
               itself, before the forward)
    consume    each request verifies / samples on its own rows' logits

Bit-identity: a request's rows are computed by row-invariant kernels (models/cpu_linear.py on a CPU; the lean
step's tensor-core GEMVs on a GPU) and its own attention call, so its logits at every position are the bits the
same request gets alone on this engine, whatever the other rows are: their number, contexts, drafts, sampling,
or a neighbour that left mid-way. Greedy tokens are therefore the same; so is every sampled token of a request
with a seed that does not speculate.

Speculation per user: each request keeps its own drafter. The adaptive drafter weighs a draft against the step it
joins (`set_batch_rows`: the rows the others put in the same forward), so a draft must pay for what it adds to
a step of that width; `max_step_rows` bounds the rows of one step (a GPU step's row-invariant GEMVs take a fixed
number at most).

Joining and leaving happen between steps (the caller owns the thread: the node's engine thread,
server/batch_loop.py). A join costs the others at most one step plus its own inject. Errors are per request
where they belong to one (a grammar that refuses its own mask's token ends that request, `Generation.error`);
a forward that fails fails every request of the step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from .sequence import SequenceRun
from .speculative import SpecStats


class SeatRequest(Protocol):
    """What the scheduler uses of a request (decode/engine.py's Generation): its cancel flag, its outcome, and
    the two hooks it calls, each token as it is out and once at its end."""

    cancel_event: threading.Event
    finish_reason: str | None
    error: BaseException | None
    spec: SpecStats

    def _deliver(self, token: int, index: int) -> None: ...  # token_ids[index] (and its logprobs) is out

    def _done(self) -> None: ...



class SeatScheduler:
    """The active requests of a multi-seat engine, stepped together. Not thread-safe: one thread drives it."""

    def __init__(self, forward_rows, seats: int, *, max_step_rows: int | None = None,
                 on_finished: Callable[[SeatRequest], None] | None = None) -> None:
        # runner.forward_rows: ([(seat, start, tokens)], want_argmax, while_running) -> (logits [rows, vocab],
        # row argmaxes | None); it calls while_running() once the forward is under way (before it waits on it)
        self._forward_rows = forward_rows
        self.seats = seats
        self.max_step_rows = max_step_rows
        self._on_finished = on_finished
        self._runs: dict[int, tuple[SeatRequest, SequenceRun]] = {}
        self._order = 0  # rotates which request plans first (drafts weighed against the others' rows)
        self.steps = 0
        self.rows_histogram: dict[int, int] = {}  # forwards by row count
        self.users_histogram: dict[int, int] = {}  # forwards by the requests they ran

    @property
    def active(self) -> int:
        return len(self._runs)

    def busy(self, seat: int) -> bool:
        return seat in self._runs

    def join(self, seat: int, gen: SeatRequest, run: SequenceRun) -> None:
        if not 0 <= seat < self.seats:
            raise ValueError(f"seat {seat} outside [0, {self.seats})")
        if seat in self._runs:
            raise ValueError(f"seat {seat} already decodes a request")
        self._runs[seat] = (gen, run)

    def _leave(self, seat: int) -> None:
        gen, _ = self._runs.pop(seat)
        self._finish(gen)

    def _finish(self, gen: SeatRequest) -> None:
        gen._done()
        if self._on_finished is not None:
            self._on_finished(gen)

    def _settle(self, seat: int, out: list) -> None:
        """Append the seat's pending tokens (stop rules applied); a request that finished or was cancelled leaves
        its seat now. What its listener hears goes to `out`, delivered by `_deliver` in order."""
        gen, run = self._runs[seat]
        first = len(gen.token_ids)
        tokens = list(run.emit())  # each token (and its logprobs) appended: token_ids[first + i]
        left = run.finished
        if not left and gen.cancel_event.is_set():
            gen.finish_reason = "abort"
            left = True
        if left:
            self._runs.pop(seat)
        if tokens or left:
            out.append((gen, first, tokens, left))

    def _deliver(self, out: list) -> None:
        """Hand the settled tokens to their requests, each request's tokens before its end (idempotent: `out` is
        emptied)."""
        items = out[:]
        out.clear()
        for gen, first, tokens, left in items:
            for i, tok in enumerate(tokens):
                gen._deliver(tok, first + i)
            if left:
                self._finish(gen)

    def step(self) -> int:
        """Settle every active request's pending tokens, run one forward for those still going (delivering the
        settled tokens while it runs), consume its logits. Returns the number of rows of that forward (0: none
        ran)."""
        out: list = []
        for seat in list(self._runs):
            self._settle(seat, out)
        if not self._runs:
            self._deliver(out)
            return 0
        seats = sorted(self._runs)
        k = self._order % len(seats)
        seats = seats[k:] + seats[:k]
        self._order += 1
        plan = []
        planned = 0
        for i, seat in enumerate(seats):
            _, run = self._runs[seat]
            others = len(seats) - i - 1  # requests still to plan: one row each at least
            room = None if self.max_step_rows is None else max(0, self.max_step_rows - planned - others - 1)
            rows = run.plan(rows_before=planned + others, max_drafts=room)
            plan.append((seat, run.pos, rows))
            planned += len(rows)
        # Plain greedy requests need only their rows' argmaxes: every row's, read with the step's one host sync.
        want_argmax = any(self._runs[seat][1].argmax_only for seat, _, _ in plan)
        try:
            logits, argmax = self._forward_rows(plan, want_argmax, lambda: self._deliver(out))
        except BaseException as e:
            self._deliver(out)
            for seat in seats:
                self._fail(seat, e)
            raise
        self._deliver(out)  # a forward that did not call back (no-op when it did)
        self.steps += 1
        self.rows_histogram[planned] = self.rows_histogram.get(planned, 0) + 1
        self.users_histogram[len(plan)] = self.users_histogram.get(len(plan), 0) + 1
        first = 0
        for seat, _, rows in plan:
            gen, run = self._runs[seat]
            last = first + len(rows)
            try:
                run.consume(logits[first:last], argmax[first:last] if argmax and run.argmax_only else None)
            except Exception as e:  # noqa: BLE001 - this request's own failure (a grammar): it alone ends
                self._fail(seat, e)
            first = last
        return planned

    def _fail(self, seat: int, error: BaseException) -> None:
        if seat not in self._runs:
            return
        gen, _ = self._runs[seat]
        gen.error = error
        gen.finish_reason = "error"
        self._leave(seat)

    def cancel_all(self, error: BaseException) -> None:
        """Fail every active request (the engine thread is going away)."""
        for seat in list(self._runs):
            self._fail(seat, error)
