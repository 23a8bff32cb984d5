"""The node's seats (seats.SeatTable) driven for real, and its engine thread (engine_thread.EngineThread).

/pd/reserve holds a free seat for a rid (and tells the KV source to expect it); /pd/decode takes the reservation
over (`acquire`), waits for the KV, injects it into its seat, decodes. A multi-seat engine decodes every active
request in one forward a step (decode/batch.py); a one-seat engine runs its batch-1 loop. A seat is free again
only when the handler is finished AND the engine thread has stopped touching it, so the next request's inject
into that seat can never race the previous decode. Every exit that is not a normal end cancels the rid at the KV
source, so late KV is refused at admission.

Busy is advertised to the KV source (the control-plane hello) while no seat could take another request's KV.
Engine work (inject, start, the steps) runs on the one engine thread, off the event loop; tokens come back
through an asyncio.Queue per request, read with the stall watchdog and the deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..decode import DecodeEngine, Generation, SamplingParams
from ..decode.grammar import RequestGrammar
from .engine_thread import EngineThread, EngineThreadGone
from .errors import Busy, Cancelled, DeadlineExceeded, DecodeStalled, KVTransferFailed, KVTransferTimeout, NotReserved
from .kv_source import (KVCancelled, KVReceiveError, KVRefused, KVSource, KVTimeout, ReceivedKVLike,
                        transfer_failure_reason)
from .metrics import DecodeMetrics
from .seats import ACTIVE_STATES, SeatState, SeatsBusy, SeatTable
from .seats import NotReserved as SeatNotReserved

log = logging.getLogger(__name__)

_DONE = object()


@dataclass
class ActiveRequest:
    rid: str
    seat: int
    deadline: float  # time.monotonic() by which the request must be over
    t0: float = field(default_factory=time.perf_counter)
    cancel_event: threading.Event = field(default_factory=threading.Event)
    job: concurrent.futures.Future | None = None  # what the engine thread does for it now (inject, decode)
    progress_at: float = field(default_factory=time.monotonic)  # last token (or phase start), engine thread

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()


@dataclass
class DecodeResult:
    decode_s: float
    finish_reason: str
    seq_len: int
    num_tokens: int


class DecodeRunner:
    def __init__(self, engine: DecodeEngine, source: KVSource, metrics: DecodeMetrics, *,
                 reservation_ttl_s: float, request_deadline_s: float, stall_timeout_s: float) -> None:
        self.engine = engine
        self.source = source
        self.metrics = metrics
        self.reservation_ttl_s = reservation_ttl_s
        self.request_deadline_s = request_deadline_s
        self.stall_timeout_s = stall_timeout_s
        self.seats = SeatTable(engine.seats)
        self.active: dict[str, ActiveRequest] = {}
        self._kv_in: set[str] = set()  # rids whose KV has arrived (they hold their seat's cache from now on)
        self._expiry: asyncio.TimerHandle | None = None
        self.thread = EngineThread(engine, on_step=metrics.record_step)
        metrics.seats.set(engine.seats)
        self._publish()

    def shutdown(self) -> None:
        for a in self.active.values():
            a.cancel_event.set()
        self.thread.shutdown()

    # ------------------------------------------------------------------ the seats (event loop only)
    def _publish(self) -> None:
        busy = self.seats.busy
        self.metrics.seats_busy.set(busy)
        self.metrics.busy.set(1 if busy == len(self.seats) else 0)

    def status(self) -> dict:
        views = self.seats.views
        busy = [v for v in views if v.state is not SeatState.IDLE]
        now = time.monotonic()
        seats = []
        for v in views:
            s = {"seat": v.index, "state": v.state.value, "rid": v.rid}
            if v.deadline is not None:
                s["expires_in_s"] = round(max(v.deadline - now, 0.0), 3)
            seats.append(s)
        out = {"state": "busy" if len(busy) == len(views) else "idle", "seats": len(views),
               "seats_busy": len(busy), "seat_states": seats,
               # TileRT's one-request fields: the first held seat's (None when every seat is free)
               "rid": busy[0].rid if busy else None}
        if busy:
            out["phase"] = busy[0].state.value
        return out

    def reserve(self, rid: str, ttl_s: float) -> float:
        """Hold a free seat for rid; the ttl actually granted (capped by the node)."""
        ttl_s = min(ttl_s, self.reservation_ttl_s)
        self.expire()
        try:
            _, new = self.seats.reserve(rid, ttl_s, time.monotonic())
        except SeatsBusy as e:
            self.metrics.reservations.labels("busy").inc()
            raise Busy(f"{e}; the router queues or sends the request to another node") from None
        try:
            self.source.expect(rid, ttl_s)
        except KVReceiveError as e:
            self.seats.cancel_reservation(rid)
            self.metrics.reservations.labels("refused").inc()
            raise Busy(f"the KV receiver cannot take this request now: {e}") from None
        self._arm_expiry()
        self.metrics.reservations.labels("reserved" if new else "refreshed").inc()
        self._publish()
        return ttl_s

    def _arm_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        due = self.seats.next_deadline()
        if due is not None:
            self._expiry = asyncio.get_running_loop().call_later(max(due - time.monotonic(), 0.001),
                                                                self._on_expiry_timer)

    def _on_expiry_timer(self) -> None:
        self._expiry = None
        self.expire()
        self._arm_expiry()  # the next reservation's deadline (the loop may also fire a hair early)

    def expire(self) -> None:
        """Reservations past their deadline free their seats and are cancelled at the KV source."""
        for rid in self.seats.expire(time.monotonic()):
            log.info("a reservation expired without its /pd/decode: seat free")
            self.source.cancel(rid)
            self.metrics.reservations.labels("expired").inc()
        self._publish()

    def acquire(self, rid: str, kv_timeout_s: float) -> ActiveRequest:
        """/pd/decode takes rid's reservation over (NotReserved 409 / Busy 429 otherwise)."""
        self.expire()
        try:
            seat = self.seats.take(rid, time.monotonic())
        except SeatNotReserved as e:
            raise NotReserved(str(e)) from None
        except SeatsBusy as e:
            raise Busy(str(e)) from None
        self._arm_expiry()
        active = ActiveRequest(rid, seat, deadline=time.monotonic() + self.request_deadline_s)
        self.active[rid] = active
        try:
            self.source.expect(rid, min(kv_timeout_s, self.request_deadline_s))  # admit the KV for the whole wait
        except KVReceiveError as e:
            self.finish(active, ok=False)
            raise Busy(f"the KV receiver cannot take this request: {e}") from None
        self.metrics.reservations.labels("taken").inc()
        return active

    def finish(self, active: ActiveRequest, ok: bool) -> None:
        """The handler is done with `active`; free its seat now or when its engine work stops. A request that did
        not end normally is cancelled at the KV source (late KV for it is refused)."""
        if not ok:
            self.source.cancel(active.rid)
        v = self.seats.view_of(active.rid)
        if v is not None and v.state in ACTIVE_STATES:
            self.seats.finish(active.rid)
        job = active.job
        if job is None or job.done():
            self._release(active)
            return
        active.cancel_event.set()  # engine work still running here means nobody reads its tokens
        loop = asyncio.get_running_loop()
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release, active))

    def _release(self, active: ActiveRequest) -> None:
        if self.active.get(active.rid) is active:
            del self.active[active.rid]
            self._kv_in.discard(active.rid)
            self.seats.release(active.rid)
            self._publish()
            self._advertise()

    def _advertise(self) -> None:
        """Tell the KV source whether another request's KV could land: not while every seat holds KV."""
        self.source.set_busy(len(self._kv_in) >= len(self.seats))

    def cancel_reservation(self, rid: str) -> bool:
        """Cancel rid's reservation only (not a request being served). True when rid held one."""
        if not self.seats.cancel_reservation(rid):
            return False
        self.source.cancel(rid)
        self._arm_expiry()
        self.metrics.reservations.labels("cancelled").inc()
        self._publish()
        return True

    def cancel(self, rid: str) -> bool:
        """Cancel rid's reservation, KV wait and/or decode (the other seats' requests are untouched). True when
        rid held a seat."""
        self.source.cancel(rid)  # also refuses KV that is still on its way
        if self.cancel_reservation(rid):
            return True
        a = self.active.get(rid)
        if a is not None:
            a.cancel_event.set()
            return True
        return False

    # ------------------------------------------------------------------ engine health (event loop)
    async def probe_engine(self, timeout_s: float) -> str:
        """"ok", or why the engine thread is not serving: running engine work must show progress within the stall
        bound, an idle thread must run a no-op job within timeout_s."""
        running = [a for a in self.active.values() if a.job is not None and not a.job.done()]
        if running:
            age = time.monotonic() - max(a.progress_at for a in running)
            return "ok" if age < self.stall_timeout_s else f"engine thread stalled: no progress for {age:.1f}s"
        try:
            job = self.thread.submit(time.monotonic)
        except EngineThreadGone as e:
            return f"engine thread gone: {e}"
        try:
            await asyncio.wait_for(asyncio.wrap_future(job), timeout_s)
        except asyncio.TimeoutError:
            job.cancel()
            return f"engine thread did not answer within {timeout_s}s"
        return "ok"

    # ------------------------------------------------------------------ phases
    async def wait_kv(self, active: ActiveRequest, timeout_s: float) -> ReceivedKVLike:
        bound = min(timeout_s, active.remaining_s())
        try:
            received = await self.source.wait_for(active.rid, bound)
        except KVTimeout as e:
            if bound < timeout_s:
                raise DeadlineExceeded(f"the request deadline passed while waiting for the KV ({e})") from None
            raise KVTransferTimeout(str(e)) from None
        except KVCancelled as e:
            raise Cancelled(str(e)) from None
        except KVRefused as e:  # the receiver has no slot for it (or it was cancelled there)
            raise Busy(f"the KV receiver cannot take this request: {e}") from None
        except KVReceiveError as e:  # KVTransferFailed(reason) and anything else the receiver knows failed
            raise KVTransferFailed(transfer_failure_reason(e), str(e)) from None
        self._kv_in.add(active.rid)
        self._advertise()
        if active.cancel_event.is_set():
            received.release()
            raise Cancelled(f"rid {active.rid} was cancelled")
        return received

    async def inject(self, active: ActiveRequest, received: ReceivedKVLike) -> float:
        self.seats.advance(active.rid, SeatState.INJECTING)
        active.progress_at = time.monotonic()
        active.job = self.thread.submit(self._inject_job, received, active.seat)
        try:
            return await asyncio.wrap_future(active.job)
        except ValueError as e:  # geometry / length mismatch between the KV and this engine
            raise KVTransferFailed("incompatible_kv", f"received KV cannot be injected: {e}") from None

    def _inject_job(self, received: ReceivedKVLike, seat: int) -> float:
        t = time.perf_counter()
        try:
            self.engine.inject(received.k, received.v, received.num_tokens, seat=seat)
        finally:
            received.release()
        return time.perf_counter() - t

    def start_decode(self, active: ActiveRequest, first_token_id: int, num_prompt_tokens: int,
                     params: SamplingParams, grammar: RequestGrammar | None = None) -> AsyncIterator[list]:
        """Start the request's decode on the engine thread; iterate the result for batches (raises DecodeStalled /
        DeadlineExceeded): token ids, or (id, logprob, top) triples when params.logprobs is set (None for the
        first token's). After iteration, `active.job.result()` is the DecodeResult."""
        if active.cancel_event.is_set():
            raise Cancelled(f"rid {active.rid} was cancelled")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with_logprobs = params.logprobs is not None

        def emit(item: object) -> None:
            active.progress_at = time.monotonic()
            loop.call_soon_threadsafe(queue.put_nowait, item)

        self.seats.advance(active.rid, SeatState.DECODING)
        active.progress_at = time.monotonic()
        if self.engine.scheduler is None:  # one seat: the batch-1 loop, a job that runs to the request's end
            gen = self.engine.generate(first_token_id, num_prompt_tokens, params, cancel_event=active.cancel_event,
                                       grammar=grammar)
            active.job = self.thread.submit(self._decode_job, gen, emit)
        else:  # several seats: the request joins the scheduler's steps; its job ends when it leaves them
            active.job = done = concurrent.futures.Future()
            done.set_running_or_notify_cancel()
            t0 = time.perf_counter()

            def on_token(tok: int, lp, top) -> None:
                emit((tok, lp, top) if with_logprobs else tok)

            def on_done(gen: Generation) -> None:
                if gen.error is not None:
                    done.set_exception(gen.error)
                else:
                    done.set_result(DecodeResult(time.perf_counter() - t0, gen.finish_reason or "abort",
                                                 gen.seq_len, len(gen.token_ids)))

            def join() -> None:
                gen = self.engine.generate(first_token_id, num_prompt_tokens, params,
                                           cancel_event=active.cancel_event, grammar=grammar, seat=active.seat)
                gen.listen(on_token, on_done)

            def joined(f: concurrent.futures.Future) -> None:  # a request that never joined (its grammar
                error = f.exception()                             # refused the first token, the thread is gone)
                if error is not None and not done.done():
                    done.set_exception(error)

            self.thread.submit(join).add_done_callback(joined)
        active.job.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, _DONE))
        return watched_batches(queue, self.stall_timeout_s, active.deadline)

    @staticmethod
    def _decode_job(gen: Generation, emit) -> DecodeResult:
        t = time.perf_counter()
        if gen.logprobs is None:
            for tok in gen:
                emit(tok)
        else:
            for tok in gen:
                emit((tok, gen.logprobs[-1], gen.top_logprobs[-1]))
        return DecodeResult(time.perf_counter() - t, gen.finish_reason or "abort", gen.seq_len, len(gen.token_ids))


async def watched_batches(queue: asyncio.Queue, stall_timeout_s: float, deadline: float) -> AsyncIterator[list]:
    """Everything available at once, as one list (a slow reader gets fewer, larger NDJSON lines), until the
    _DONE marker. No item for stall_timeout_s -> DecodeStalled; past `deadline` (monotonic) -> DeadlineExceeded."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded("the request ran past the node's request deadline")
        wait = min(stall_timeout_s, remaining)
        try:
            first = await asyncio.wait_for(queue.get(), wait)
        except asyncio.TimeoutError:
            if wait < stall_timeout_s:
                raise DeadlineExceeded("the request ran past the node's request deadline") from None
            raise DecodeStalled(f"no token for {stall_timeout_s}s") from None
        batch = [first]
        while not queue.empty():
            batch.append(queue.get_nowait())
        done = batch[-1] is _DONE
        if done:
            batch.pop()
        if batch:
            yield batch
        if done:
            return
