"""Where the decode server gets a request's prompt KV: the interface both sides agree on.

The production source is ``expresslane.engine.transfer.receiver.KVReceiver`` (control-plane TCP server +
NIXL-registered receive buffer). ``LocalKVSource`` is an in-process source for tests and local runs: KV is
handed to it with ``put`` (e.g. computed by a real DecodeEngine.prefill).

Errors raised by ``wait_for`` are the data plane's own classes (one definition, shared with the receiver):
KVTimeout -> 504, KVCancelled -> 499, KVTransferFailed / other KVReceiveError -> 500.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from expresslane.engine.transfer.errors import KVCancelled, KVReceiveError, KVTimeout, KVTransferFailed

__all__ = [
    "KVCancelled",
    "KVReceiveError",
    "KVSource",
    "KVTimeout",
    "KVTransferFailed",
    "LocalKVSource",
    "LocalReceivedKV",
    "ReceivedKVLike",
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


class LocalKVSource:
    """Thread-safe in-process KVSource: `put` from any thread, `wait_for` on the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrived: dict[str, LocalReceivedKV] = {}
        self._cancelled: set[str] = set()
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self.busy = False
        self.started = False
        self.delivered: list[LocalReceivedKV] = []

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.started = False

    def set_busy(self, busy: bool) -> None:
        self.busy = busy

    def put(self, rid: str, k: torch.Tensor, v: torch.Tensor, num_tokens: int | None = None) -> None:
        num_tokens = k.shape[1] if num_tokens is None else num_tokens
        kv = LocalReceivedKV(rid, num_tokens, k, v, nbytes=k.nbytes + v.nbytes)
        with self._lock:
            if rid in self._cancelled:
                return
            self._arrived[rid] = kv
            self._wake(rid, None)

    def cancel(self, rid: str) -> None:
        with self._lock:
            self._cancelled.add(rid)
            self._arrived.pop(rid, None)
            self._wake(rid, KVCancelled(f"rid {rid} was cancelled"))

    async def wait_for(self, rid: str, timeout_s: float) -> LocalReceivedKV:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        with self._lock:
            fut = loop.create_future()
            self._waiters.setdefault(rid, []).append((loop, fut))
            if rid in self._arrived or rid in self._cancelled:
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
            if rid in self._cancelled:
                raise KVCancelled(f"rid {rid} was cancelled")
            kv = self._arrived.pop(rid)
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
