"""What the scheduler-side connector tells the worker-side connector each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from expresslane.engine.protocol import CLAIM_HOST, CLAIM_PORT, CLAIM_RID


@dataclass(frozen=True)
class Claim:
    """The express-lane marker of a request (kv_transfer_params set by the router)."""

    host: str
    port: int
    rid: str

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> "Claim | None":
        """None when the request is not ours. Raises ValueError for a half-written marker."""
        if not params:
            return None
        present = [k for k in (CLAIM_HOST, CLAIM_PORT, CLAIM_RID) if k in params]
        if not present:
            return None
        if len(present) != 3:
            raise ValueError(f"kv_transfer_params has {present} but needs all of "
                             f"{CLAIM_HOST}, {CLAIM_PORT}, {CLAIM_RID}")
        host, port, rid = params[CLAIM_HOST], params[CLAIM_PORT], params[CLAIM_RID]
        if not isinstance(host, str) or not host or not isinstance(rid, str) or not rid:
            raise ValueError(f"bad express-lane marker host={host!r} rid={rid!r}")
        port = int(port)
        if not 0 < port < 65536:
            raise ValueError(f"bad {CLAIM_PORT} {port}")
        return cls(host, port, rid)


@dataclass(frozen=True)
class ShipRequest:
    """Copy this request's prompt KV into staging in this step, then send it."""

    req_id: str
    claim: Claim
    num_tokens: int
    block_ids: tuple[list[int], ...]  # per KV cache group, covering at least num_tokens


@dataclass(frozen=True)
class AbortRequest:
    """Tell the claim's node that this rid failed on the prefill (its waiter fails at once)."""

    claim: Claim
    reason: str


@dataclass
class ExpressLaneConnectorMetadata(KVConnectorMetadata):
    ship: list[ShipRequest] = field(default_factory=list)
    abort: list[AbortRequest] = field(default_factory=list)
    # Only with the side port on (metrics_port): the scheduler's stats payload since the last step
    # (stats.py form), which the rank-0 worker adds to the side port. vLLM's /metrics gets them directly.
    stats_delta: dict[str, Any] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not self.ship and not self.abort and not self.stats_delta


@dataclass
class ExpressLaneWorkerMeta(KVConnectorWorkerMetadata):
    """What a worker tells the scheduler side each step: rids whose send finished here (sent, failed or
    aborted), with how many ranks; vLLM sums the TP ranks' metas with ``aggregate``."""

    done: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "ExpressLaneWorkerMeta":
        assert isinstance(other, ExpressLaneWorkerMeta)
        merged = dict(self.done)
        for rid, n in other.done.items():
            merged[rid] = merged.get(rid, 0) + n
        return ExpressLaneWorkerMeta(merged)
