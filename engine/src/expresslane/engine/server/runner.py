"""The node's single request slot (slot.RequestSlot) driven for real, and its decode thread.

/pd/reserve holds the slot for a rid (and tells the KV source to expect it); /pd/decode takes the reservation
over (`acquire`), waits for the KV, injects, decodes. The slot is free again only when the handler is finished
AND the decode thread has stopped touching the engine, so the next request's inject can never race the previous
decode. Every exit that is not a normal end cancels the rid at the KV source, so late KV is refused at admission.

Busy is advertised to the KV source (the control-plane hello / admission) from the moment this request's KV is
claimed until the engine is free again. Engine work (inject, the decode loop) runs on one dedicated thread, off
the event loop; tokens come back through an asyncio.Queue, read with the stall watchdog and the deadline.
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
from .errors import Busy, Cancelled, DeadlineExceeded, DecodeStalled, KVTransferFailed, KVTransferTimeout, NotReserved
from .kv_source import (KVCancelled, KVReceiveError, KVRefused, KVSource, KVTimeout, ReceivedKVLike,
                        transfer_failure_reason)
from .metrics import DecodeMetrics
from .slot import ACTIVE_STATES, RequestSlot, SlotBusy, SlotState
from .slot import NotReserved as SlotNotReserved

log = logging.getLogger(__name__)

_DONE = object()


@dataclass
class ActiveRequest:
    rid: str
    deadline: float  # time.monotonic() by which the request must be over
    t0: float = field(default_factory=time.perf_counter)
    cancel_event: threading.Event = field(default_factory=threading.Event)
    job: concurrent.futures.Future | None = None  # the last engine job submitted for this request
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
        self.slot = RequestSlot()
        self.active: ActiveRequest | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="expresslane-decode")

    def shutdown(self) -> None:
        if self.active is not None:
            self.active.cancel_event.set()
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ the slot (event loop only)
    def status(self) -> dict:
        v = self.slot.view
        if v.state is SlotState.IDLE:
            return {"state": "idle", "rid": None}
        out = {"state": "busy", "rid": v.rid, "phase": v.state.value}
        if v.deadline is not None:
            out["expires_in_s"] = round(max(v.deadline - time.monotonic(), 0.0), 3)
        return out

    def reserve(self, rid: str, ttl_s: float) -> float:
        """Hold the slot for rid; the ttl actually granted (capped by the node)."""
        ttl_s = min(ttl_s, self.reservation_ttl_s)
        self.expire()
        try:
            new = self.slot.reserve(rid, ttl_s, time.monotonic())
        except SlotBusy:
            self.metrics.reservations.labels("busy").inc()
            raise Busy("the node's slot is held by another request; one request per node") from None
        try:
            self.source.expect(rid, ttl_s)
        except KVReceiveError as e:
            self.slot.cancel_reservation(rid)
            self.metrics.reservations.labels("refused").inc()
            raise Busy(f"the KV receiver cannot take this request now: {e}") from None
        self._arm_expiry(ttl_s)
        self.metrics.reservations.labels("reserved" if new else "refreshed").inc()
        self.metrics.busy.set(1)
        return ttl_s

    def _arm_expiry(self, ttl_s: float) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_later(ttl_s, self._on_expiry_timer)

    def _on_expiry_timer(self) -> None:
        self._expiry = None
        self.expire()
        v = self.slot.view
        if v.state is SlotState.RESERVED and v.deadline is not None:  # the loop may fire a hair early
            self._arm_expiry(max(v.deadline - time.monotonic(), 0.001))

    def expire(self) -> None:
        """A reservation past its deadline frees the slot and is cancelled at the KV source."""
        rid = self.slot.expire(time.monotonic())
        if rid is not None:
            log.info("a reservation expired without its /pd/decode: slot free")
            self.source.cancel(rid)
            self.metrics.reservations.labels("expired").inc()
            self.metrics.busy.set(0)

    def acquire(self, rid: str, kv_timeout_s: float) -> ActiveRequest:
        """/pd/decode takes rid's reservation over (NotReserved 409 / Busy 429 otherwise)."""
        self.expire()
        try:
            self.slot.take(rid, time.monotonic())
        except SlotNotReserved as e:
            raise NotReserved(str(e)) from None
        except SlotBusy as e:
            raise Busy(str(e)) from None
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        active = ActiveRequest(rid, deadline=time.monotonic() + self.request_deadline_s)
        self.active = active
        try:
            self.source.expect(rid, min(kv_timeout_s, self.request_deadline_s))  # admit the KV for the whole wait
        except KVReceiveError as e:
            self.finish(active, ok=False)
            raise Busy(f"the KV receiver cannot take this request: {e}") from None
        self.metrics.reservations.labels("taken").inc()
        return active

    def finish(self, active: ActiveRequest, ok: bool) -> None:
        """The handler is done with `active`; free the slot now or when its engine job stops. A request that did
        not end normally is cancelled at the KV source (late KV for it is refused)."""
        if not ok:
            self.source.cancel(active.rid)
        if self.slot.rid == active.rid and self.slot.state in ACTIVE_STATES:
            self.slot.finish(active.rid)
        job = active.job
        if job is None or job.done():
            self._release(active)
            return
        active.cancel_event.set()  # a job still running here means nobody reads its tokens
        loop = asyncio.get_running_loop()
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release, active))

    def _release(self, active: ActiveRequest) -> None:
        if self.active is active:
            self.active = None
            self.slot.release(active.rid)
            self.metrics.busy.set(0)
            self.source.set_busy(False)

    def cancel_reservation(self, rid: str) -> bool:
        """Cancel rid's reservation only (not a request being served). True when rid held it."""
        if not self.slot.cancel_reservation(rid):
            return False
        self.source.cancel(rid)
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self.metrics.reservations.labels("cancelled").inc()
        self.metrics.busy.set(0)
        return True

    def cancel(self, rid: str) -> bool:
        """Cancel rid's reservation, KV wait and/or decode. True when rid held the slot."""
        self.source.cancel(rid)  # also refuses KV that is still on its way
        if self.cancel_reservation(rid):
            return True
        a = self.active
        if a is not None and a.rid == rid:
            a.cancel_event.set()
            return True
        return False

    # ------------------------------------------------------------------ engine health (event loop)
    async def probe_engine(self, timeout_s: float) -> str:
        """"ok", or why the engine thread is not serving: a running job must show progress within the stall bound,
        an idle thread must run a no-op job within timeout_s."""
        a, state = self.active, self.slot.state
        if a is not None and state in (SlotState.INJECTING, SlotState.DECODING, SlotState.FINISHING) \
                and a.job is not None and not a.job.done():
            age = time.monotonic() - a.progress_at
            return "ok" if age < self.stall_timeout_s else f"engine thread stalled: no progress for {age:.1f}s"
        try:
            job = self._executor.submit(time.monotonic)
        except RuntimeError as e:
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
        self.source.set_busy(True)  # our KV is in: refuse other admissions until the engine is free
        if active.cancel_event.is_set():
            received.release()
            raise Cancelled(f"rid {active.rid} was cancelled")
        return received

    async def inject(self, active: ActiveRequest, received: ReceivedKVLike) -> float:
        self.slot.advance(active.rid, SlotState.INJECTING)
        active.progress_at = time.monotonic()
        active.job = self._executor.submit(self._inject_job, received)
        try:
            return await asyncio.wrap_future(active.job)
        except ValueError as e:  # geometry / length mismatch between the KV and this engine
            raise KVTransferFailed("incompatible_kv", f"received KV cannot be injected: {e}") from None

    def _inject_job(self, received: ReceivedKVLike) -> float:
        t = time.perf_counter()
        try:
            self.engine.inject(received.k, received.v, received.num_tokens)
        finally:
            received.release()
        return time.perf_counter() - t

    def start_decode(self, active: ActiveRequest, first_token_id: int, num_prompt_tokens: int,
                     params: SamplingParams, grammar: RequestGrammar | None = None) -> AsyncIterator[list]:
        """Start the decode loop on the engine thread; iterate the result for batches (raises DecodeStalled /
        DeadlineExceeded): token ids, or (id, logprob, top) triples when params.logprobs is set (None for the
        first token's). After iteration, `active.job.result()` is the DecodeResult."""
        if active.cancel_event.is_set():
            raise Cancelled(f"rid {active.rid} was cancelled")
        gen = self.engine.generate(first_token_id, num_prompt_tokens, params, cancel_event=active.cancel_event,
                                   grammar=grammar)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(item: object) -> None:
            active.progress_at = time.monotonic()
            loop.call_soon_threadsafe(queue.put_nowait, item)

        self.slot.advance(active.rid, SlotState.DECODING)
        active.progress_at = time.monotonic()
        active.job = self._executor.submit(self._decode_job, gen, emit)
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
