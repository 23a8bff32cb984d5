"""Where the decode server gets a request's prompt KV: the interface both sides agree on.

The production source is ``expresslane.engine.transfer.receiver.KVReceiver`` (control-plane TCP server +
NIXL-registered receive buffer). ``LocalKVSource`` is an in-process source for tests and local runs: KV is
handed to it with ``put`` (e.g. computed by a real DecodeEngine.prefill).

The node uses exactly these calls of a KVSource (docs/protocol.md, "What the decode node uses of it"):
  start() / stop()                      lifespan
  expect(rid, ttl_s)                    on /pd/reserve (ttl = the reservation's) and again when /pd/decode takes
                                        the reservation over (ttl = the KV wait): KV is admitted for rid until then;
                                        a KVReceiveError (KVRefused) means it can never be taken -> 429
  cancel(rid)                           on every early exit: reservation cancelled / expired, client gone, 504,
                                        stall, deadline, error; un-expects rid so late KV is refused at admit
  wait_for(rid, timeout_s)              KVTimeout -> 504, KVCancelled -> 499, KVTransferFailed(reason) -> 502 at
                                        once, any other KVReceiveError -> 502 with reason "receive_error"
  health() -> {"control_plane": "ok"|why, "nixl": "ok"|why}
  set_busy(bool), stats (dict)
Errors are the data plane's own classes (one definition, shared with the receiver).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from expresslane.engine.transfer.errors import KVCancelled, KVReceiveError, KVRefused, KVTimeout, KVTransferFailed

__all__ = [
    "KVCancelled",
    "KVReceiveError",
    "KVRefused",
    "KVSource",
    "KVTimeout",
    "KVTransferFailed",
    "LocalKVSource",
    "LocalReceivedKV",
    "ReceivedKVLike",
    "transfer_failed",
    "transfer_failure_reason",
]


@runtime_checkable
class ReceivedKVLike(Protocol):
    """One request's KV: dense [num_layers, num_tokens, num_kv_heads, head_dim] on the engine's device/dtype.
    k/v may be views of a receive buffer: copy them, then call release() (after which they must not be read)."""

    rid: str
    num_tokens: int
    k: torch.Tensor
    v: torch.Tensor
    nbytes: int
    wire_wait_s: float  # how long wait_for waited (0 when the KV had already arrived)
    transfer_s: float  # first accept -> last done, as seen by the receiver
    convert_s: float  # receive bytes -> k/v

    def release(self) -> None: ...


@runtime_checkable
class KVSource(Protocol):
    def set_busy(self, busy: bool) -> None: ...  # advertised in the control-plane hello

    async def wait_for(self, rid: str, timeout_s: float) -> ReceivedKVLike: ...  # KVTimeout / KVCancelled

    def cancel(self, rid: str) -> None: ...

    def expect(self, rid: str, ttl_s: float) -> None: ...  # KVReceiveError (KVRefused): never admissible

    def health(self) -> dict[str, str]: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class LocalReceivedKV:
    rid: str
    num_tokens: int
    k: torch.Tensor
    v: torch.Tensor
    nbytes: int
    wire_wait_s: float = 0.0
    transfer_s: float = 0.0
    convert_s: float = 0.0
    released: bool = field(default=False, repr=False)

    def release(self) -> None:
        self.released = True


def transfer_failure_reason(err: KVReceiveError) -> str:
    """The contract's `reason` of a KVTransferFailed (`aborted:<why>`, `sender_vanished`, ...)."""
    return getattr(err, "reason", None) or ("transfer_failed" if isinstance(err, KVTransferFailed) else "receive_error")


def transfer_failed(reason: str) -> KVTransferFailed:
    err = KVTransferFailed(reason)
    err.reason = reason  # the receiver's class carries it itself; set it here for one without the attribute
    return err


class LocalKVSource:
    """Thread-safe in-process KVSource with the receiver's admission rule: `put` (the sender's admit + write, from
    any thread) is admitted only for a rid `expect`ed and not yet expired or cancelled, else refused (False,
    counted in stats["refused_unknown_rid"]); `fail` is the sender's abort; `wait_for` runs on the event loop.
    `degrade(check, why)` marks one of health()'s checks down (what a dead accept loop / NIXL agent reports)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrived: dict[str, LocalReceivedKV] = {}
        self._failed: dict[str, str] = {}
        self._expected: dict[str, float] = {}  # rid -> monotonic deadline
        self._cancelled: set[str] = set()  # tombstones: a cancelled rid is never admitted again
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._health = {"control_plane": "ok", "nixl": "ok"}
        self.busy = False
        self.started = False
        self.delivered: list[LocalReceivedKV] = []
        self.calls: list[tuple[str, str]] = []  # (method, rid) of expect / cancel, in order
        self.stats = {"slots_in_use": 0, "connections_open": 0, "auth_failures": 0, "refused_unknown_rid": 0}

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.started = False

    def set_busy(self, busy: bool) -> None:
        self.busy = busy

    def health(self) -> dict[str, str]:
        h = dict(self._health)
        if not self.started and h["control_plane"] == "ok":
            h["control_plane"] = "not started"
        return h

    def degrade(self, check: str, why: str | None) -> None:
        """Mark a health check down (why) or back up (None)."""
        if check not in self._health:
            raise KeyError(check)
        self._health[check] = why or "ok"

    def expect(self, rid: str, ttl_s: float) -> None:
        with self._lock:
            self.calls.append(("expect", rid))
            if rid in self._cancelled:
                raise KVRefused(f"rid {rid} was cancelled on this node", reason="cancelled")
            self._expected[rid] = max(self._expected.get(rid, 0.0), time.monotonic() + ttl_s)

    def expected(self, rid: str) -> bool:
        with self._lock:
            return self._expected.get(rid, 0.0) > time.monotonic()

    def put(self, rid: str, k: torch.Tensor, v: torch.Tensor, num_tokens: int | None = None) -> bool:
        num_tokens = k.shape[1] if num_tokens is None else num_tokens
        kv = LocalReceivedKV(rid, num_tokens, k, v, nbytes=k.nbytes + v.nbytes)
        with self._lock:
            if self._expected.get(rid, 0.0) <= time.monotonic():
                self.stats["refused_unknown_rid"] += 1
                return False
            self._arrived[rid] = kv
            self._wake(rid, None)
            return True

    def fail(self, rid: str, reason: str) -> None:
        """The sender gave up on rid's transfer (abort frame, vanished, checksum mismatch)."""
        with self._lock:
            if rid not in self._expected:
                return
            self._failed[rid] = reason
            self._wake(rid, None)

    def cancel(self, rid: str) -> None:
        with self._lock:
            self.calls.append(("cancel", rid))
            self._cancelled.add(rid)
            self._expected.pop(rid, None)
            self._arrived.pop(rid, None)
            self._failed.pop(rid, None)
            self._wake(rid, KVCancelled(f"rid {rid} was cancelled"))

    async def wait_for(self, rid: str, timeout_s: float) -> LocalReceivedKV:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        with self._lock:
            fut = loop.create_future()
            self._waiters.setdefault(rid, []).append((loop, fut))
            if rid in self._arrived or rid in self._failed or rid not in self._expected:
                fut.set_result(None)
        try:
            await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise KVTimeout(f"KV for rid {rid} did not arrive within {timeout_s}s") from None
        finally:
            with self._lock:
                waiters = self._waiters.get(rid, [])
                if (loop, fut) in waiters:
                    waiters.remove((loop, fut))
        with self._lock:
            if rid in self._failed:
                self._expected.pop(rid, None)
                raise transfer_failed(self._failed.pop(rid))
            if rid not in self._arrived:
                raise KVCancelled(f"rid {rid} was cancelled (or never expected)")
            kv = self._arrived.pop(rid)
            self._expected.pop(rid, None)
        kv.wire_wait_s = time.monotonic() - t0
        self.delivered.append(kv)
        return kv

    def _wake(self, rid: str, exc: BaseException | None) -> None:
        for loop, fut in self._waiters.pop(rid, []):
            def _set(fut: asyncio.Future = fut) -> None:
                if not fut.done():
                    if exc is None:
                        fut.set_result(None)
                    else:
                        fut.set_exception(exc)
            loop.call_soon_threadsafe(_set)
