"""Scheduler side: claim filtering and "ship once, when the whole prompt has been computed".

Per claimed request we track the block ids (per KV cache group) and the computed-token count from the
SchedulerOutput of every step: scheduled_new_reqs give the blocks, scheduled_cached_reqs append
new_block_ids (a request resumed from preemption gets its complete block list again). In the step where
num_computed_tokens + num_scheduled_tokens reaches the prompt length, the request goes into that step's
metadata (the worker copies its KV inside that forward step) and is forgotten: it can never ship twice.
A claimed request that finishes before that (abort, error) is dropped and counted. Unclaimed requests
cost one counter increment in on_new_request and nothing else.

A claim for a destination outside the allow-list is never shipped (nor contacted) and counted; a prompt
longer than the staging slots is refused here. ``request_finished`` returns the outcome known then in
the request's kv_transfer_params (``expresslane_rid``, ``expresslane_status`` staged | failed,
``expresslane_error``); MultiConnector merges them with NixlConnector's (whose keys never start with
``expresslane_``) into the prefill's HTTP response. Failures for an allowed node also go to it as an
abort (through the worker), so its waiting /pd/decode fails at once.

Numbers: this role's counts (claimed, unclaimed, refusals it finds) go to vLLM through
``get_kv_connector_stats`` (stats.py). Each shipped rid stays "pending push work" until every TP rank's
worker reports it done (sent, failed or aborted) in its worker metadata: vLLM keeps stepping the engine
meanwhile (``has_pending_push_work``), so the sends' numbers, recorded in the sender threads, reach
/metrics in the following steps instead of waiting for the next request. The wait is bounded
(``pending_bound_s``: every sender timeout plus a margin); an rid past it is dropped with an error. Once the
newest pending send is older than ``PACE_AFTER_S`` (it waits on a peer's timeouts) the idle engine's steps are
paced to one per ``PACE_S`` instead of vLLM's one per millisecond.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from expresslane.engine.connector.config import ExpressLaneConnectorConfig
from expresslane.engine.connector.metadata import (
    AbortRequest,
    Claim,
    ExpressLaneConnectorMetadata,
    ExpressLaneWorkerMeta,
    ShipRequest,
)
from expresslane.engine.connector.stats import ExpressLaneStats
from expresslane.engine.protocol import CLAIM_RID
from expresslane.engine.transfer.sender import KVSender, SenderConfig

STATUS = "expresslane_status"
ERROR = "expresslane_error"
STAGED = "staged"
FAILED = "failed"

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    claim: Claim
    prompt_len: int
    block_ids: list[list[int]] | None = None  # None until scheduled (or after a preemption)


CLAIMED, UNCLAIMED, REFUSED_DESTINATION = "claimed_requests", "unclaimed_requests", "refused_destinations"
FAILURES, ABORTS = "send_failures", "send_aborts"


# Pacing of the idle engine while only old sends are pending. vLLM steps an engine with no requests again
# 1 ms after an empty step for as long as this hook says there is push work, and each empty step is a
# scheduler pass plus a round trip to every worker: measured on the 2-CPU CPU stack, two sends hung on a peer
# that accepts and never answers took the prefill from 0.97 to 1.63 cores for as long as they hung (up to
# pending_bound_s, ~75 s). A send that has not reported within PACE_AFTER_S is waiting on a peer's timeouts, so
# from then on the hook sleeps PACE_S once per engine step before it answers: the numbers still reach /metrics
# within ~PACE_S of the send's end, and a request that arrives meanwhile waits at most PACE_S more (the hook
# is asked only when the engine has no request at all: vLLM's has_requests() checks those first).
PACE_AFTER_S = 0.5
PACE_S = 0.025


def pending_bound_s(c: ExpressLaneConnectorConfig) -> float:
    """The longest a worker's send can take before it reports (connect attempts, busy wait, I/O, WRITE)."""
    return (c.connect_retries + 1) * (c.connect_timeout_s + 2.0) + c.busy_retry_s + 2 * c.io_timeout_s \
        + c.write_timeout_s + 10.0


class ExpressLaneScheduler:
    def __init__(self, config: ExpressLaneConnectorConfig | None = None, max_tokens: int | None = None,
                 world_size: int = 1, clock=time.monotonic, sleep=time.sleep) -> None:
        self.config = config or ExpressLaneConnectorConfig()
        self.max_tokens = max_tokens  # longest prompt the staging slots take; None: not checked here
        self.world_size = world_size  # TP ranks whose workers each report a shipped rid done
        self._clock = clock
        self._sleep = sleep
        self._tracked: dict[str, _Tracked] = {}
        self._outcome: dict[str, dict[str, Any]] = {}  # req_id -> kv_transfer_params for request_finished
        self._aborts: list[AbortRequest] = []
        self._notifier: KVSender | None = None  # abort frames for failures found here (TCP only, no NIXL)
        self._stats = ExpressLaneStats()  # for vLLM (get_kv_connector_stats)
        # The same counts for the rank-0 worker's side port (only when metrics_port is set).
        self._side_delta: ExpressLaneStats | None = ExpressLaneStats() if self.config.metrics_port else None
        self._pending: dict[str, list] = {}  # rid -> [ranks not done yet, deadline]
        self._last_ship_at = 0.0  # when the newest pending rid shipped (pacing starts PACE_AFTER_S after it)
        self._stepped = False  # an engine step ran since the hook last paced (one sleep per step)
        # Totals, for tests and logs.
        self.totals: Counter[str] = Counter()

    def _count(self, key: str, label: str | None = None) -> None:
        self._stats.inc(key, 1, label)
        if self._side_delta is not None:
            self._side_delta.inc(key, 1, label)
        self.totals[f"{key}:{label}" if label else key] += 1

    # ------------------------------------------------------------------ vLLM stats / push-work hooks

    def get_stats(self) -> ExpressLaneStats | None:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, ExpressLaneStats()
        return out

    def update_worker_meta(self, meta: ExpressLaneWorkerMeta | None) -> None:
        for rid, n in (meta.done.items() if meta is not None else ()):
            entry = self._pending.get(rid)
            if entry is None:
                continue  # dropped past its bound, or an abort-only job of an rid never shipped
            entry[0] -= n
            if entry[0] <= 0:
                del self._pending[rid]

    def _expire(self, now: float) -> None:
        """Forget the rids whose workers did not report their sends done within pending_bound_s (every sender
        timeout is shorter: a report that late is lost). Run where the count is read: by the push-work hook (vLLM
        asks it only while the engine has no requests) and before a claim is admitted (under load)."""
        for rid in [r for r, (_, deadline) in self._pending.items() if now > deadline]:
            logger.error("expresslane: rid=%s: %d worker(s) did not report the send done within %.0f s; "
                         "no longer counting it (nor keeping the engine stepping for it)", rid,
                         self._pending[rid][0], pending_bound_s(self.config))
            del self._pending[rid]

    def has_pending_push_work(self) -> bool:
        if self._pending:
            now = self._clock()
            self._expire(now)
            if self._pending and self._stepped and now - self._last_ship_at > PACE_AFTER_S:
                self._stepped = False
                self._sleep(PACE_S)
        return bool(self._pending)

    # ------------------------------------------------------------------ hooks

    def on_new_request(self, request: "Request") -> None:
        params = request.kv_transfer_params
        try:
            claim = Claim.parse(params)
        except ValueError as e:
            logger.error("expresslane: request %s has a malformed express-lane marker, not shipping: %s",
                         request.request_id, e)
            self._count(FAILURES, "bad_params")
            rid = params.get(CLAIM_RID) if isinstance(params, dict) else None
            self._outcome[request.request_id] = _failed(rid if isinstance(rid, str) else "", "bad_params")
            return
        if claim is None:
            self._count(UNCLAIMED)
            return
        self._count(CLAIMED)
        if not self.config.allows(claim.host, claim.port):
            logger.error("expresslane: request %s names destination %s:%d, which is not in the allow-list; "
                         "nothing is sent", request.request_id, claim.host, claim.port)
            self._count(REFUSED_DESTINATION)
            self._count(FAILURES, "not_allowed")
            self._outcome[request.request_id] = _failed(claim.rid, "not_allowed")
            return
        if self.max_tokens is not None and request.num_prompt_tokens > self.max_tokens:
            logger.error("expresslane: rid=%s has %d prompt tokens > staging_max_tokens %d; not shipping",
                         claim.rid, request.num_prompt_tokens, self.max_tokens)
            self._count(FAILURES, "too_long")
            self._fail(request.request_id, claim, "too_long")
            return
        self._tracked[request.request_id] = _Tracked(claim, request.num_prompt_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> ExpressLaneConnectorMetadata:
        meta = ExpressLaneConnectorMetadata()
        self._stepped = True
        if self._tracked:
            self._scan(scheduler_output, meta)
        if self._aborts:  # already sent by the notifier; the worker only logs/counts them
            meta.abort, self._aborts = self._aborts, []
        if self._side_delta is not None and not self._side_delta.is_empty():
            meta.stats_delta, self._side_delta = self._side_delta.data, ExpressLaneStats()
        return meta

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        # Shipped requests were forgotten when they shipped; the copy already happened in the forward
        # step, so blocks are never held back.
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is not None:
            logger.warning("expresslane: rid=%s (request %s) finished before its prompt was computed "
                           "(status %s); nothing shipped", tracked.claim.rid, request.request_id,
                           getattr(request, "status", "?"))
            self._count(FAILURES, "finished_before_ship")
            self._fail(request.request_id, tracked.claim, "finished_before_ship")
        return False, self._outcome.pop(request.request_id, None)

    def _fail(self, req_id: str, claim: Claim, reason: str) -> None:
        """Outcome for request_finished + an abort frame to the (allowed) node right now: the engine may
        not schedule another step for a while, so this cannot wait for the worker."""
        self._outcome[req_id] = _failed(claim.rid, reason)
        self._aborts.append(AbortRequest(claim, reason))
        self._count(ABORTS, reason)  # handed to the notifier now (it runs on its own thread)
        if self._notifier is None:
            c = self.config
            self._notifier = KVSender(None, None, None, peer_secret=c.peer_secret, config=SenderConfig(
                connect_timeout_s=c.connect_timeout_s, connect_retries=c.connect_retries,
                io_timeout_s=c.io_timeout_s))
        self._notifier.submit_abort(claim.rid, claim.host, claim.port, reason)

    def shutdown(self) -> None:
        if self._notifier is not None:
            self._notifier.stop()

    # ------------------------------------------------------------------ internals

    def _scan(self, so: "SchedulerOutput", meta: ExpressLaneConnectorMetadata) -> None:
        for req_id in so.preempted_req_ids or ():
            if req_id in self._tracked:
                self._tracked[req_id].block_ids = None  # its blocks were freed; resumes with a full list
        for new in so.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = [list(g) for g in new.block_ids]
                self._maybe_ship(new.req_id, tracked, new.num_computed_tokens, so, meta)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids or tracked.block_ids is None:
                if new_ids is None:
                    logger.error("expresslane: request %s resumed without block ids; dropping", req_id)
                    self._count(FAILURES, "internal")
                    del self._tracked[req_id]
                    continue
                tracked.block_ids = [list(g) for g in new_ids]
            elif new_ids is not None:
                for group, ids in zip(tracked.block_ids, new_ids):
                    group.extend(ids)
            self._maybe_ship(req_id, tracked, cached.num_computed_tokens[i], so, meta)

    def _maybe_ship(self, req_id: str, tracked: _Tracked, num_computed: int, so: "SchedulerOutput",
                    meta: ExpressLaneConnectorMetadata) -> None:
        if num_computed + so.num_scheduled_tokens.get(req_id, 0) < tracked.prompt_len:
            return  # a chunk of the prompt; the rest comes in later steps
        assert tracked.block_ids is not None
        self._expire(self._clock())
        if len(self._pending) >= self.config.staging_slots:
            # Every shipped rid holds a staging slot on each rank until its worker reports the send done (the
            # slot is released before that report), so none is free for this one. Fail it here: the reply to
            # this request carries the failure (the router answers its client at once) and the node gets the
            # abort now. Left to the worker, the reply would say "staged" and the router would learn of the
            # failure only from the node, after the abort frame reached it. The count can run high for a step
            # (a slot freed in this step's forward is reported with its output) and while a failed rid's abort
            # frame is still being sent: a claim refused then could have found a slot. The worker's own check
            # stays (a slot held past its rid's pending bound).
            logger.error("expresslane: no free staging slot for rid=%s (%d sends in flight); increase "
                         "staging_slots. Not shipping", tracked.claim.rid, len(self._pending))
            del self._tracked[req_id]
            self._count(FAILURES, "no_staging_slot")
            self._fail(req_id, tracked.claim, "no_staging_slot")
            return
        meta.ship.append(ShipRequest(req_id, tracked.claim, tracked.prompt_len,
                                     tuple(list(g) for g in tracked.block_ids)))
        del self._tracked[req_id]
        self._last_ship_at = self._clock()
        self._pending[tracked.claim.rid] = [self.world_size, self._last_ship_at + pending_bound_s(self.config)]
        # Staged in this step's forward; later failures reach the node as an abort frame.
        self._outcome[req_id] = {CLAIM_RID: tracked.claim.rid, STATUS: STAGED, ERROR: ""}


def _failed(rid: str, reason: str) -> dict[str, Any]:
    return {CLAIM_RID: rid, STATUS: FAILED, ERROR: reason}
