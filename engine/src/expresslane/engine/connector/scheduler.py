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
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from expresslane.engine.connector.config import ExpressLaneConnectorConfig
from expresslane.engine.connector.metadata import AbortRequest, Claim, ExpressLaneConnectorMetadata, ShipRequest
from expresslane.engine.connector.metrics import CLAIMED, FAIL_PREFIX, REFUSED_DESTINATION, UNCLAIMED
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


class ExpressLaneScheduler:
    def __init__(self, config: ExpressLaneConnectorConfig | None = None, max_tokens: int | None = None) -> None:
        self.config = config or ExpressLaneConnectorConfig()
        self.max_tokens = max_tokens  # longest prompt the staging slots take; None: not checked here
        self._tracked: dict[str, _Tracked] = {}
        self._outcome: dict[str, dict[str, Any]] = {}  # req_id -> kv_transfer_params for request_finished
        self._aborts: list[AbortRequest] = []
        self._notifier: KVSender | None = None  # abort frames for failures found here (TCP only, no NIXL)
        self._delta: Counter[str] = Counter()
        # Totals, for tests and logs (the Prometheus counters live in the worker process).
        self.totals: Counter[str] = Counter()

    def _count(self, key: str, n: int = 1) -> None:
        self._delta[key] += n
        self.totals[key] += n

    # ------------------------------------------------------------------ hooks

    def on_new_request(self, request: "Request") -> None:
        params = request.kv_transfer_params
        try:
            claim = Claim.parse(params)
        except ValueError as e:
            logger.error("expresslane: request %s has a malformed express-lane marker, not shipping: %s",
                         request.request_id, e)
            self._count(FAIL_PREFIX + "bad_params")
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
            self._count(FAIL_PREFIX + "not_allowed")
            self._outcome[request.request_id] = _failed(claim.rid, "not_allowed")
            return
        if self.max_tokens is not None and request.num_prompt_tokens > self.max_tokens:
            logger.error("expresslane: rid=%s has %d prompt tokens > staging_max_tokens %d; not shipping",
                         claim.rid, request.num_prompt_tokens, self.max_tokens)
            self._count(FAIL_PREFIX + "too_long")
            self._fail(request.request_id, claim, "too_long")
            return
        self._tracked[request.request_id] = _Tracked(claim, request.num_prompt_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> ExpressLaneConnectorMetadata:
        meta = ExpressLaneConnectorMetadata()
        if self._tracked:
            self._scan(scheduler_output, meta)
        if self._aborts:  # already sent by the notifier; the worker only logs/counts them
            meta.abort, self._aborts = self._aborts, []
        if self._delta:
            meta.stats_delta = dict(self._delta)
            self._delta.clear()
        return meta

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        # Shipped requests were forgotten when they shipped; the copy already happened in the forward
        # step, so blocks are never held back.
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is not None:
            logger.warning("expresslane: rid=%s (request %s) finished before its prompt was computed "
                           "(status %s); nothing shipped", tracked.claim.rid, request.request_id,
                           getattr(request, "status", "?"))
            self._count(FAIL_PREFIX + "finished_before_ship")
            self._fail(request.request_id, tracked.claim, "finished_before_ship")
        return False, self._outcome.pop(request.request_id, None)

    def _fail(self, req_id: str, claim: Claim, reason: str) -> None:
        """Outcome for request_finished + an abort frame to the (allowed) node right now: the engine may
        not schedule another step for a while, so this cannot wait for the worker."""
        self._outcome[req_id] = _failed(claim.rid, reason)
        self._aborts.append(AbortRequest(claim, reason))
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
                    self._count(FAIL_PREFIX + "internal")
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
        meta.ship.append(ShipRequest(req_id, tracked.claim, tracked.prompt_len,
                                     tuple(list(g) for g in tracked.block_ids)))
        del self._tracked[req_id]
        # Staged in this step's forward; later failures reach the node as an abort frame.
        self._outcome[req_id] = {CLAIM_RID: tracked.claim.rid, STATUS: STAGED, ERROR: ""}


def _failed(rid: str, reason: str) -> dict[str, Any]:
    return {CLAIM_RID: rid, STATUS: FAILED, ERROR: reason}
