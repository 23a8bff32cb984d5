"""Prefill side of the data plane: a background thread that ships staged requests to decode nodes.

Per request: TCP connect -> hello (checked: magic, version, layout hash) -> admit -> accept | reject
(busy/cancelling retried with bounded backoff) -> one-sided NIXL WRITE staging slot -> receive slot ->
done -> ack. The staging slot is released on every path. The forward loop only ever calls submit(),
which never blocks.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from expresslane.engine.protocol import messages as m
from expresslane.engine.protocol.errors import ProtocolError, ProtocolMismatch
from expresslane.engine.protocol.layout import KVLayoutSpec
from expresslane.engine.transfer.errors import SendError
from expresslane.engine.transfer.nixl_transport import NixlEndpoint, Region
from expresslane.engine.transfer.staging import StagingSlot

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SenderConfig:
    connect_timeout_s: float = 3.0
    io_timeout_s: float = 10.0
    write_timeout_s: float = 30.0
    busy_retry_s: float = 10.0  # total time spent retrying busy/cancelling rejects
    backoff_initial_s: float = 0.02
    backoff_max_s: float = 0.5
    queue_size: int = 64


@dataclass
class SendJob:
    rid: str
    host: str
    port: int
    num_tokens: int
    slot: StagingSlot
    nbytes: int
    # Called in the sender thread before the WRITE: waits for the device copy into staging (CUDA event).
    ready: Callable[[], None] | None = None
    t_staged: float = field(default_factory=time.monotonic)
    stage_s: float = 0.0


class SendObserver:
    """Hooks for metrics; the default does nothing."""

    def on_sent(self, job: SendJob, seconds: float) -> None:
        pass

    def on_failure(self, job: SendJob | None, reason: str) -> None:
        pass


class KVSender:
    def __init__(
        self,
        endpoint: NixlEndpoint,
        staging_region: Region,
        layout: KVLayoutSpec,
        *,
        rank: int = 0,
        world_size: int = 1,
        head_start: int = 0,
        num_heads: int | None = None,
        config: SenderConfig | None = None,
        observer: SendObserver | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.staging_region = staging_region
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self.head_start = head_start
        self.num_heads = layout.num_kv_heads if num_heads is None else num_heads
        self.config = config or SenderConfig()
        self.observer = observer or SendObserver()
        self._queue: queue.Queue[SendJob | None] = queue.Queue(self.config.queue_size)
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ thread

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="expresslane-kv-sender", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._thread is not None:
            try:
                self._queue.put(None, timeout=timeout_s)
            except queue.Full:
                pass
            self._thread.join(timeout_s)
            self._thread = None

    def submit(self, job: SendJob) -> bool:
        """Hand a staged job to the sender thread. Never blocks; False (slot released) if the queue is full."""
        try:
            self._queue.put_nowait(job)
            return True
        except queue.Full:
            job.slot.release()
            logger.error("expresslane: send queue full, dropping KV of rid=%s", job.rid)
            self.observer.on_failure(job, "queue_full")
            return False

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self.send(job)
            except SendError:
                pass  # already logged and counted
            except Exception:  # never let the thread die
                logger.exception("expresslane: unexpected error sending rid=%s", job.rid)

    # ------------------------------------------------------------------ one request

    def send(self, job: SendJob) -> None:
        """Ship one job synchronously (the thread's body; tests call it directly). Releases the slot."""
        try:
            if job.ready is not None:
                job.ready()
            self._exchange(job)
        except SendError as e:
            log = logger.error if e.reason != "rejected_cancelled" else logger.warning
            log("expresslane: KV send for rid=%s to %s:%s failed: %s", job.rid, job.host, job.port, e)
            self.observer.on_failure(job, e.reason)
            raise
        except ProtocolMismatch as e:
            logger.error("expresslane: KV send for rid=%s refused: %s", job.rid, e)
            self.observer.on_failure(job, "incompatible")
            raise SendError("incompatible", str(e)) from e
        except ProtocolError as e:
            logger.error("expresslane: KV send for rid=%s: protocol error: %s", job.rid, e)
            self.observer.on_failure(job, "protocol")
            raise SendError("protocol", str(e)) from e
        except (TimeoutError, socket.timeout) as e:
            logger.error("expresslane: KV send for rid=%s: control-plane timeout", job.rid)
            self.observer.on_failure(job, "timeout")
            raise SendError("timeout", str(e)) from e
        except OSError as e:
            logger.error("expresslane: KV send for rid=%s: network error: %s", job.rid, e)
            self.observer.on_failure(job, "network")
            raise SendError("network", str(e)) from e
        else:
            self.observer.on_sent(job, time.monotonic() - job.t_staged)
        finally:
            job.slot.release()

    def _exchange(self, job: SendJob) -> None:
        cfg = self.config
        try:
            sock = socket.create_connection((job.host, job.port), timeout=cfg.connect_timeout_s)
        except OSError as e:
            raise SendError("connect", f"cannot reach decode node control port {job.host}:{job.port}: {e}") from e
        with sock:
            sock.settimeout(cfg.io_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = m.expect(m.recv_msg(sock), m.HELLO)
            m.check_compat(hello, self.layout, peer=f"decode node {job.host}:{job.port}")
            transport = hello.get("transport") or {}
            if transport.get("name") != "nixl":
                raise SendError("incompatible", f"decode node offers transport {transport.get('name')!r}, "
                                "this prefill speaks only 'nixl'")
            remote_agent = self.endpoint.ensure_remote(transport["agent_name"], transport["agent_metadata"])
            remote_region = Region.from_wire(transport["region"])

            admit = m.admit(rid=job.rid, rank=self.rank, world_size=self.world_size, head_start=self.head_start,
                            num_heads=self.num_heads, num_tokens=job.num_tokens, nbytes=job.nbytes,
                            layout=self.layout)
            t_admit = time.monotonic()
            deadline = t_admit + cfg.busy_retry_s
            backoff = cfg.backoff_initial_s
            while True:
                m.send_msg(sock, admit)
                reply = m.expect(m.recv_msg(sock), m.ACCEPT, m.REJECT)
                if reply["type"] == m.ACCEPT:
                    break
                reason = str(reply.get("reason"))
                if not reply.get("retryable") or time.monotonic() + backoff > deadline:
                    suffix = "" if not reply.get("retryable") else f" (gave up after {cfg.busy_retry_s}s)"
                    raise SendError(f"rejected_{reason}", f"decode node rejected rid={job.rid}: "
                                    f"{reason} {reply.get('detail', '')}{suffix}")
                time.sleep(backoff)
                backoff = min(backoff * 2, cfg.backoff_max_s)
            t_accept = time.monotonic()
            generation = int(reply["generation"])
            if int(reply["nbytes"]) != job.nbytes:
                raise SendError("protocol", f"accept for {reply['nbytes']} B, admitted {job.nbytes} B")

            self.endpoint.write(
                local=self.staging_region, local_offset=job.slot.offset, nbytes=job.nbytes,
                remote_agent=remote_agent, remote=remote_region, remote_offset=int(reply["dest_offset"]),
                notif=str(reply["notif"]).encode(), timeout_s=cfg.write_timeout_s,
            )
            t_written = time.monotonic()
            m.send_msg(sock, m.done(rid=job.rid, rank=self.rank, generation=generation, nbytes=job.nbytes,
                                    timings={"stage_s": job.stage_s, "queue_s": t_admit - job.t_staged,
                                             "admit_s": t_accept - t_admit, "write_s": t_written - t_accept}))
            ack = m.expect(m.recv_msg(sock), m.ACK)
            if not ack.get("ok"):
                raise SendError(f"nack_{ack.get('error') or 'unknown'}",
                                f"decode node did not take rid={job.rid}: {ack.get('error')}")
