"""A thin, thread-safe wrapper over one NIXL agent: register a region, WRITE into a peer, read notifs."""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from expresslane.engine.transfer.errors import SendError

logger = logging.getLogger(__name__)

# Large writes are split into descriptors of at most this size (lets UCX pipeline/parallelise lanes).
_MAX_DESC_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Region:
    """A registered memory region as advertised to peers."""

    addr: int
    nbytes: int
    dev_id: int
    mem_type: str  # "DRAM" | "VRAM"

    def to_wire(self) -> dict:
        return {"addr": self.addr, "nbytes": self.nbytes, "dev_id": self.dev_id, "mem_type": self.mem_type}

    @classmethod
    def from_wire(cls, d: dict) -> "Region":
        return cls(int(d["addr"]), int(d["nbytes"]), int(d["dev_id"]), str(d["mem_type"]))


def region_of(tensor: torch.Tensor) -> Region:
    if not tensor.is_contiguous():
        raise ValueError("NIXL regions must be contiguous tensors")
    dev = tensor.get_device()
    return Region(
        addr=tensor.data_ptr(),
        nbytes=tensor.numel() * tensor.element_size(),
        dev_id=max(dev, 0),
        mem_type="DRAM" if dev < 0 else "VRAM",
    )


def _descs(addr: int, nbytes: int, dev_id: int) -> list[tuple[int, int, int]]:
    return [(addr + off, min(_MAX_DESC_BYTES, nbytes - off), dev_id) for off in range(0, nbytes, _MAX_DESC_BYTES)]


class NixlEndpoint:
    """One NIXL agent (UCX by default). All agent calls are serialised by one lock.

    The agent runs WITHOUT NIXL's progress thread: that thread busy-polls (``sched_yield`` with
    ``pthrDelay=0``) for the agent's whole life, and inside vLLM's worker, which is pinned to its cores,
    it takes CPU from every forward step, claimed or not. Progress is driven by the calls that need it
    instead: the writer polls ``check_xfer_state``; ``wait_notif`` polls ``get_new_notifs``; a receiver that
    must progress while a peer writes into it (UCX over TCP needs the target to progress) runs
    :meth:`start_progress` with a predicate saying when a write is in flight.
    """

    #: Poll period while a peer is writing into us, and when idle (keeps UCX wire-up and keepalives served).
    ACTIVE_POLL_S = 0.0001
    IDLE_POLL_S = 0.02

    def __init__(self, name_prefix: str, backends: tuple[str, ...] = ("UCX",)) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:  # fail loudly: the express lane cannot work without NIXL
            raise RuntimeError(
                "expresslane needs NIXL for the KV data plane: pip install 'expresslane-engine[nixl]' (nixl>=1.5)"
            ) from e
        self.name = f"{name_prefix}-{uuid.uuid4().hex[:8]}"
        self.backends = list(backends)
        self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=self.backends))
        self._lock = threading.Lock()
        self._remotes: dict[str, str] = {}
        self._notifs: set[bytes] = set()
        self._registered: list = []
        self._progress_thread: threading.Thread | None = None
        self._progress_stop = threading.Event()
        self._progress_wake = threading.Event()

    # ------------------------------------------------------------------ progress

    def start_progress(self, active: Callable[[], bool]) -> None:
        """Drive the agent from a background thread: every ACTIVE_POLL_S while ``active()`` (a peer is
        writing into this agent), every IDLE_POLL_S otherwise. :meth:`poke` wakes it at once."""
        if self._progress_thread is not None:
            return
        self._progress_stop.clear()

        def run() -> None:
            while not self._progress_stop.is_set():
                self._collect_notifs()
                if active():
                    time.sleep(self.ACTIVE_POLL_S)
                else:
                    self._progress_wake.wait(self.IDLE_POLL_S)
                    self._progress_wake.clear()

        self._progress_thread = threading.Thread(target=run, name=f"nixl-progress-{self.name}", daemon=True)
        self._progress_thread.start()

    def poke(self) -> None:
        """A write into this agent is about to start: leave the idle poll now."""
        self._progress_wake.set()

    def stop_progress(self) -> None:
        if self._progress_thread is not None:
            self._progress_stop.set()
            self._progress_wake.set()
            self._progress_thread.join(2.0)
            self._progress_thread = None

    def _collect_notifs(self) -> None:
        with self._lock:
            for msgs in self._agent.get_new_notifs().values():  # also progresses the backend
                self._notifs.update(msgs)

    def register(self, tensor: torch.Tensor) -> Region:
        region = region_of(tensor)
        with self._lock:
            self._registered.append(self._agent.register_memory(tensor))
        return region

    def metadata_b64(self) -> str:
        with self._lock:
            return base64.b64encode(self._agent.get_agent_metadata()).decode()

    def ensure_remote(self, agent_name: str, metadata_b64: str) -> str:
        with self._lock:
            if agent_name not in self._remotes:
                self._remotes[agent_name] = self._agent.add_remote_agent(base64.b64decode(metadata_b64))
            return self._remotes[agent_name]

    def write(
        self, *, local: Region, local_offset: int, nbytes: int, remote_agent: str, remote: Region,
        remote_offset: int, notif: bytes, timeout_s: float, on_timeout: Callable[[], None] | None = None,
    ) -> None:
        """One-sided WRITE of ``nbytes`` and wait for completion. Raises SendError("nixl"|"write_timeout").

        On timeout ``on_timeout()`` is called (the caller tells the peer a write may still land) and the
        handle is polled for another ``timeout_s`` until it is final, so the caller's control connection
        (whose close the peer takes as "no write of mine can land any more") outlives the write."""
        if local_offset + nbytes > local.nbytes or remote_offset + nbytes > remote.nbytes:
            raise SendError("bad_request", f"write of {nbytes} B does not fit the registered regions")
        with self._lock:
            ldesc = self._agent.get_xfer_descs(_descs(local.addr + local_offset, nbytes, local.dev_id), local.mem_type)
            rdesc = self._agent.get_xfer_descs(_descs(remote.addr + remote_offset, nbytes, remote.dev_id),
                                               remote.mem_type)
            handle = self._agent.initialize_xfer("WRITE", ldesc, rdesc, remote_agent, notif)
            state = self._agent.transfer(handle)
        timed_out = False
        try:
            state = self._poll(handle, state, timeout_s)
            if state == "PROC":
                timed_out = True
                if on_timeout is not None:
                    on_timeout()
                state = self._poll(handle, state, timeout_s)
                raise SendError("write_timeout", f"NIXL WRITE of {nbytes} B not done after {timeout_s}s "
                                f"(handle {'still in flight' if state == 'PROC' else state} after draining)")
            if state != "DONE":
                raise SendError("nixl", f"NIXL WRITE failed with state {state}")
        finally:
            with self._lock:
                try:
                    self._agent.release_xfer_handle(handle)
                except Exception:  # a handle still in flight cannot be released; the agent reaps it
                    logger.warning("could not release NIXL xfer handle (timed out: %s)", timed_out, exc_info=True)

    def _poll(self, handle, state: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        sleep = 0.0
        while state == "PROC" and time.monotonic() <= deadline:
            if sleep:
                time.sleep(sleep)
            sleep = min(max(sleep * 2, 1e-5), 1e-3)
            with self._lock:
                state = self._agent.check_xfer_state(handle)
        return state

    def wait_notif(self, msg: bytes, timeout_s: float) -> bool:
        """Wait until the notification ``msg`` (attached to a WRITE) arrived at this agent."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._collect_notifs()
            with self._lock:
                if msg in self._notifs:
                    self._notifs.discard(msg)
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)

    def take_notif(self, msg: bytes) -> bool:
        """Non-blocking: True (and forget it) if the notification ``msg`` arrived. Needs the progress
        thread (start_progress) or another caller of :meth:`wait_notif` to collect notifications."""
        with self._lock:
            if msg in self._notifs:
                self._notifs.discard(msg)
                return True
            return False

    def progress_alive(self) -> bool:
        return self._progress_thread is not None and self._progress_thread.is_alive()

    def discard_notifs(self, prefix: bytes) -> None:
        with self._lock:
            self._notifs = {m for m in self._notifs if not m.startswith(prefix)}
