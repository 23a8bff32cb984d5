"""The node's single request slot and its decode thread.

One request at a time: `acquire` takes the slot (else Busy/429). The slot is released only when the handler
is finished AND the decode thread has stopped touching the engine, so the next request's inject can never
race the previous decode.

Busy is advertised to the KV source (the control-plane hello / admission) from the moment this request's
KV is claimed until the engine is free again, NOT while /pd/decode waits for the KV: the KV being waited
for must still be admitted (the router posts /pd/decode right after the prefill, often before the
prefill's sender has been admitted). Engine work (inject, the decode loop) runs
on one dedicated thread, off the event loop; tokens come back through an asyncio.Queue.
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
from .errors import Busy, Cancelled, KVTransferFailed, KVTransferTimeout
from .kv_source import KVCancelled, KVReceiveError, KVSource, KVTimeout, ReceivedKVLike
from .metrics import DecodeMetrics

log = logging.getLogger(__name__)

_DONE = object()


@dataclass
class ActiveRequest:
    rid: str
    t0: float = field(default_factory=time.perf_counter)
    cancel_event: threading.Event = field(default_factory=threading.Event)
    phase: str = "wire_wait"  # wire_wait | inject | decode
    job: concurrent.futures.Future | None = None  # the last engine job submitted for this request


@dataclass
class DecodeResult:
    decode_s: float
    finish_reason: str
    seq_len: int
    num_tokens: int


class DecodeRunner:
    def __init__(self, engine: DecodeEngine, source: KVSource, metrics: DecodeMetrics) -> None:
        self.engine = engine
        self.source = source
        self.metrics = metrics
        self.active: ActiveRequest | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="expresslane-decode")

    def shutdown(self) -> None:
        if self.active is not None:
            self.active.cancel_event.set()
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ the slot (event loop only)
    def status(self) -> dict:
        a = self.active
        return {"state": "idle", "rid": None} if a is None else {"state": "busy", "rid": a.rid, "phase": a.phase}

    def acquire(self, rid: str) -> ActiveRequest:
        if self.active is not None:
            raise Busy(f"node is serving rid {self.active.rid}; one request per node")
        self.active = ActiveRequest(rid)
        self.metrics.busy.set(1)
        return self.active

    def finish(self, active: ActiveRequest) -> None:
        """The handler is done with `active`; free the slot now or when its engine job stops."""
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
            self.metrics.busy.set(0)
            self.source.set_busy(False)

    def cancel(self, rid: str) -> bool:
        """Abandon the KV wait and/or stop the decode of `rid`. True when rid is the active request."""
        self.source.cancel(rid)  # also refuses KV that is still on its way for a rid not yet posted
        a = self.active
        if a is not None and a.rid == rid:
            a.cancel_event.set()
            return True
        return False

    # ------------------------------------------------------------------ phases
    async def wait_kv(self, active: ActiveRequest, timeout_s: float) -> ReceivedKVLike:
        try:
            received = await self.source.wait_for(active.rid, timeout_s)
        except KVTimeout as e:
            raise KVTransferTimeout(str(e)) from None
        except KVCancelled as e:
            raise Cancelled(str(e)) from None
        except KVReceiveError as e:
            raise KVTransferFailed(str(e)) from None
        self.source.set_busy(True)  # our KV is in: refuse other admissions until the engine is free
        if active.cancel_event.is_set():
            received.release()
            raise Cancelled(f"rid {active.rid} was cancelled")
        return received

    async def inject(self, active: ActiveRequest, received: ReceivedKVLike) -> float:
        active.phase = "inject"
        active.job = self._executor.submit(self._inject_job, received)
        try:
            return await asyncio.wrap_future(active.job)
        except ValueError as e:  # geometry / length mismatch between the KV and this engine
            raise KVTransferFailed(f"received KV cannot be injected: {e}") from None

    def _inject_job(self, received: ReceivedKVLike) -> float:
        t = time.perf_counter()
        try:
            self.engine.inject(received.k, received.v, received.num_tokens)
        finally:
            received.release()
        return time.perf_counter() - t

    def start_decode(self, active: ActiveRequest, first_token_id: int, num_prompt_tokens: int,
                     params: SamplingParams) -> AsyncIterator[list[int]]:
        """Start the decode loop on the engine thread; iterate the result for batches of token ids.
        After iteration, `active.job.result()` is the DecodeResult (or raises the loop's exception)."""
        if active.cancel_event.is_set():
            raise Cancelled(f"rid {active.rid} was cancelled")
        gen = self.engine.generate(first_token_id, num_prompt_tokens, params, cancel_event=active.cancel_event)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(item: object) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        active.phase = "decode"
        active.job = self._executor.submit(self._decode_job, gen, emit)
        active.job.add_done_callback(lambda _: emit(_DONE))
        return _batches(queue)

    @staticmethod
    def _decode_job(gen: Generation, emit) -> DecodeResult:
        t = time.perf_counter()
        for tok in gen:
            emit(tok)
        return DecodeResult(time.perf_counter() - t, gen.finish_reason or "abort", gen.seq_len, len(gen.token_ids))


async def _batches(queue: asyncio.Queue) -> AsyncIterator[list[int]]:
    """Everything available at once, as one list: a slow reader gets fewer, larger NDJSON lines."""
    while True:
        batch = [await queue.get()]
        while not queue.empty():
            batch.append(queue.get_nowait())
        done = batch[-1] is _DONE
        if done:
            batch.pop()
        if batch:
            yield batch
        if done:
            return
