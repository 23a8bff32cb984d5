"""Prefill side of the data plane: one worker thread per destination ships staged requests to it.

Per request: connect (bounded retries with jitter) -> challenge/auth -> hello (magic, version, layout
hash, model fingerprint checked) -> admit -> accept | reject (busy retried with jittered backoff for at
most ``busy_retry_s``) -> one-sided NIXL WRITE staging slot -> receive slot -> done{nbytes, checksum}
-> ack. Every failure after the node was reached is also sent to it as ``abort{rid, reason}`` so its
waiting ``/pd/decode`` fails at once. The staging slot is released on every path. A slow or dead node
only delays its own queue (no head-of-line blocking across destinations). The forward loop only ever
calls submit() / submit_abort(), which never block.
"""

from __future__ import annotations

import logging
import queue
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from expresslane.engine.protocol import messages as m
from expresslane.engine.protocol.errors import AuthError, ProtocolError, ProtocolMismatch
from expresslane.engine.protocol.layout import KVLayoutSpec
from expresslane.engine.transfer.channel import Channel, open_channel
from expresslane.engine.transfer.checksum import checksum, choose_algorithm, warm_wsum16
from expresslane.engine.transfer.errors import SendError
from expresslane.engine.transfer.nixl_transport import NixlEndpoint, Region
from expresslane.engine.transfer.staging import StagingSlot

logger = logging.getLogger(__name__)

# Rejects the node already knows the outcome of: no abort frame needed.
_NODE_KNOWS = frozenset({m.REJECT_UNKNOWN, m.REJECT_CANCELLED, m.REJECT_EXPIRED, m.REJECT_FAILED})


@dataclass(frozen=True)
class SenderConfig:
    connect_timeout_s: float = 3.0
    io_timeout_s: float = 10.0
    write_timeout_s: float = 30.0
    busy_retry_s: float = 10.0  # total time spent retrying busy rejects
    connect_retries: int = 2    # extra connection attempts after a refused/timed-out connect
    backoff_initial_s: float = 0.02
    backoff_max_s: float = 0.5
    queue_size: int = 64        # per destination
    max_destinations: int = 64  # live worker threads (one per host:port at a time)
    destination_idle_s: float = 300.0  # a worker with nothing queued this long ends (node churn frees its place)
    checksum: bool = True       # put a checksum of the staged bytes in done (crc32 | wsum16, checksum.py)
    checksum_algorithm: str = "auto"  # "auto": choose_algorithm (wsum16 for VRAM -> VRAM); or crc32 | wsum16


@dataclass
class SendJob:
    rid: str
    host: str
    port: int
    num_tokens: int
    slot: StagingSlot | None
    nbytes: int
    # Called in the sender thread before the WRITE: waits for the device copy into staging (CUDA event).
    ready: Callable[[], None] | None = None
    t_staged: float = field(default_factory=time.monotonic)
    stage_s: float = 0.0
    abort_reason: str = ""  # set: do not send KV, only tell the node this rid failed (no slot)
    abort_detail: str = ""


class SendObserver:
    """Hooks for metrics; the default does nothing."""

    def on_sent(self, job: SendJob, seconds: float) -> None:
        pass

    def on_failure(self, job: SendJob | None, reason: str) -> None:
        pass

    def on_abort_sent(self, job: SendJob, reason: str) -> None:
        pass


def _jitter(backoff: float) -> float:
    return backoff * random.uniform(0.5, 1.5)


class _Destination:
    """One worker thread per host:port. It ends after destination_idle_s with nothing queued, so nodes that come
    and go (new addresses, new ports) never use up max_destinations; the next job for it starts a new one."""

    def __init__(self, sender: "KVSender", host: str, port: int) -> None:
        self.sender = sender
        self.key = (host, port)
        self.queue: queue.Queue[SendJob | None] = queue.Queue(sender.config.queue_size)
        self.thread = threading.Thread(target=self._run, name=f"expresslane-kv-send-{host}:{port}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                job = self.queue.get(timeout=self.sender.config.destination_idle_s)
            except queue.Empty:
                if self.sender._retire(self):
                    return
                continue
            if job is None:
                return
            try:
                self.sender.send(job)
            except SendError:
                pass  # already logged and counted
            except Exception:  # never let the thread die
                logger.exception("expresslane: unexpected error sending rid=%s", job.rid)


class KVSender:
    def __init__(
        self,
        endpoint: NixlEndpoint | None,
        staging_region: Region | None,
        layout: KVLayoutSpec | None,
        *,
        rank: int = 0,
        world_size: int = 1,
        head_start: int = 0,
        num_heads: int | None = None,
        config: SenderConfig | None = None,
        observer: SendObserver | None = None,
        peer_secret: bytes | None = None,
        ssl_context: ssl.SSLContext | None = None,
        model_fingerprint: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.staging_region = staging_region
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self.head_start = head_start
        # endpoint/region/layout None: an abort-only sender (the scheduler side's: submit_abort only)
        self.num_heads = (layout.num_kv_heads if layout is not None else 0) if num_heads is None else num_heads
        self.config = config or SenderConfig()
        self.observer = observer or SendObserver()
        self.peer_secret = peer_secret
        self.ssl_context = ssl_context
        self.model_fingerprint = model_fingerprint
        if staging_region is not None and staging_region.mem_type == "VRAM" and self.config.checksum:
            warm_wsum16(f"cuda:{staging_region.dev_id}")  # JIT now, not in the first request's send
        self._lock = threading.Lock()
        self._destinations: dict[tuple[str, int], _Destination] = {}
        self._stopped = False

    # ------------------------------------------------------------------ workers

    def start(self) -> None:
        self._stopped = False  # destination workers start on first use

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            self._stopped = True
            dests, self._destinations = list(self._destinations.values()), {}
        for d in dests:
            try:
                d.queue.put(None, timeout=timeout_s)
            except queue.Full:
                pass
        for d in dests:
            d.thread.join(timeout_s)

    def submit(self, job: SendJob) -> bool:
        """Hand a job to its destination's worker. Never blocks; False (slot released) if it cannot queue."""
        with self._lock:
            dest = self._destinations.get((job.host, job.port))
            if dest is None and not self._stopped and len(self._destinations) < self.config.max_destinations:
                dest = self._destinations[(job.host, job.port)] = _Destination(self, job.host, job.port)
            reason = "stopped" if self._stopped else "too_many_destinations" if dest is None else ""
            if not reason:
                try:  # under the lock: a worker retires only with its queue empty, checked under it too
                    dest.queue.put_nowait(job)  # type: ignore[union-attr]
                    return True
                except queue.Full:
                    reason = "queue_full"
        if job.slot is not None:
            job.slot.release()
        logger.error("expresslane: cannot queue rid=%s for %s:%s (%s); not shipping", job.rid, job.host,
                     job.port, reason)
        self.observer.on_failure(job, reason)
        return False

    def _retire(self, dest: _Destination) -> bool:
        """Called by an idle worker: forget it and let it end, unless a job was queued meanwhile."""
        with self._lock:
            if not dest.queue.empty():
                return False
            if self._destinations.get(dest.key) is dest:
                del self._destinations[dest.key]
            return True

    def submit_abort(self, rid: str, host: str, port: int, reason: str, detail: str = "") -> bool:
        """Tell the node at host:port that rid failed on this side (e.g. no staging slot): its waiting
        /pd/decode then fails at once instead of timing out."""
        return self.submit(SendJob(rid=rid, host=host, port=port, num_tokens=0, slot=None, nbytes=0,
                                   abort_reason=reason, abort_detail=detail))

    # ------------------------------------------------------------------ one request

    def send(self, job: SendJob) -> None:
        """Ship one job synchronously (the workers' body; tests call it directly). Releases the slot."""
        try:
            if job.abort_reason:
                self._abort_only(job)
                return
            if job.ready is not None:
                job.ready()
            self._exchange(job)
        except SendError as e:
            quiet = e.reason in ("rejected_cancelled", "rejected_unknown_rid", "rejected_expired")
            (logger.warning if quiet else logger.error)(
                "expresslane: KV send for rid=%s to %s:%s failed: %s", job.rid, job.host, job.port, e)
            self.observer.on_failure(job, e.reason)
            raise
        else:
            if not job.abort_reason:
                self.observer.on_sent(job, time.monotonic() - job.t_staged)
        finally:
            if job.slot is not None:
                job.slot.release()

    def _connect(self, job: SendJob) -> tuple[Channel, m.Hello]:
        cfg = self.config
        backoff = cfg.backoff_initial_s
        for attempt in range(cfg.connect_retries + 1):
            try:
                return open_channel(job.host, job.port, secret=self.peer_secret,
                                    connect_timeout_s=cfg.connect_timeout_s, io_timeout_s=cfg.io_timeout_s,
                                    ssl_context=self.ssl_context)
            except AuthError as e:
                raise SendError("auth", str(e)) from e
            except ProtocolMismatch as e:
                raise SendError("incompatible", str(e)) from e
            except ProtocolError as e:
                raise SendError("protocol", str(e)) from e
            except OSError as e:  # refused, unreachable, timed out, TLS failure
                if attempt == cfg.connect_retries:
                    raise SendError("connect", f"cannot reach decode node control port {job.host}:{job.port} "
                                    f"after {attempt + 1} attempt(s): {e}") from e
                time.sleep(_jitter(backoff))
                backoff = min(backoff * 2, cfg.backoff_max_s)
        raise AssertionError("unreachable")

    def _abort_only(self, job: SendJob) -> None:
        ch, _ = self._connect(job)
        with ch:
            ch.send(m.Abort(rid=job.rid, reason=job.abort_reason, detail=job.abort_detail[:2000], write_final=True))
        self.observer.on_abort_sent(job, job.abort_reason)
        logger.info("expresslane: told %s:%s that rid=%s failed here (%s)", job.host, job.port, job.rid,
                    job.abort_reason)

    def _exchange(self, job: SendJob) -> None:
        ch, hello = self._connect(job)
        state = {"write_final": True}
        with ch:
            try:
                self._transfer(ch, hello, job, state)
            except Exception as e:
                err = _classify(e)
                if not (err.reason.startswith("rejected_") and err.reason[len("rejected_"):] in _NODE_KNOWS):
                    self._send_abort(ch, job, err, state["write_final"])
                if err is e:
                    raise
                raise err from e

    def _send_abort(self, ch: Channel, job: SendJob, err: SendError, write_final: bool) -> None:
        try:
            ch.send(m.Abort(rid=job.rid, reason=err.reason, detail=err.detail[:2000], write_final=write_final))
            self.observer.on_abort_sent(job, err.reason)
        except (OSError, ProtocolError):
            pass  # the node sees the connection close instead (sender_vanished)

    def _transfer(self, ch: Channel, hello: m.Hello, job: SendJob, state: dict) -> None:
        cfg = self.config
        assert self.endpoint is not None and self.staging_region is not None and self.layout is not None
        m.check_compat(hello, self.layout, peer=ch.peer, local_fingerprint=self.model_fingerprint)
        transport = hello.transport
        if transport.get("name") != "nixl":
            raise SendError("incompatible", f"decode node offers transport {transport.get('name')!r}, "
                            "this prefill speaks only 'nixl'")
        try:
            remote_agent = self.endpoint.ensure_remote(str(transport["agent_name"]), str(transport["agent_metadata"]))
            remote_region = Region.from_wire(transport["region"])
        except (KeyError, TypeError, ValueError) as e:
            raise SendError("protocol", f"unreadable transport in hello: {e}") from e
        admit = m.admit(rid=job.rid, rank=self.rank, world_size=self.world_size, head_start=self.head_start,
                        num_heads=self.num_heads, num_tokens=job.num_tokens, nbytes=job.nbytes,
                        layout=self.layout, model_fingerprint=self.model_fingerprint)
        assert job.slot is not None
        crc = ""
        if cfg.checksum:  # wsum16 on the device for VRAM -> VRAM when the node knows it, else crc32
            algorithm = cfg.checksum_algorithm
            if algorithm == "auto":
                algorithm = choose_algorithm(self.staging_region.mem_type == "VRAM", remote_region.mem_type,
                                             transport.get("checksums"))
            crc = checksum(job.slot.bytes(job.nbytes), algorithm)
        t_admit = time.monotonic()
        deadline = t_admit + cfg.busy_retry_s
        backoff = cfg.backoff_initial_s
        while True:
            ch.send(admit)
            reply = m.expect(ch.recv(), m.Accept, m.Reject)
            if isinstance(reply, m.Accept):
                break
            assert isinstance(reply, m.Reject)
            wait = _jitter(backoff)
            if not reply.retryable or time.monotonic() + wait > deadline:
                suffix = "" if not reply.retryable else f" (gave up after {cfg.busy_retry_s}s)"
                raise SendError(f"rejected_{reply.reason}", f"decode node rejected rid={job.rid}: "
                                f"{reply.reason} {reply.detail}{suffix}")
            time.sleep(wait)
            backoff = min(backoff * 2, cfg.backoff_max_s)
        t_accept = time.monotonic()
        if reply.nbytes != job.nbytes or reply.rid != job.rid:
            raise SendError("protocol", f"accept for {reply.rid} {reply.nbytes} B, admitted {job.rid} {job.nbytes} B")

        def on_timeout() -> None:  # the WRITE is still in flight: the node must keep the slot fenced
            state["write_final"] = False
            self._send_abort(ch, job, SendError("write_timeout", f"NIXL WRITE not done after "
                                                f"{cfg.write_timeout_s}s"), write_final=False)

        self.endpoint.write(
            local=self.staging_region, local_offset=job.slot.offset, nbytes=job.nbytes,
            remote_agent=remote_agent, remote=remote_region, remote_offset=reply.dest_offset,
            notif=reply.notif.encode(), timeout_s=cfg.write_timeout_s, on_timeout=on_timeout,
        )
        t_written = time.monotonic()
        ch.send(m.Done(rid=job.rid, rank=self.rank, generation=reply.generation, nbytes=job.nbytes, checksum=crc,
                       timings={"stage_s": job.stage_s, "queue_s": t_admit - job.t_staged,
                                "admit_s": t_accept - t_admit, "write_s": t_written - t_accept}))
        ack = m.expect(ch.recv(), m.Ack)
        assert isinstance(ack, m.Ack)
        if not ack.ok:
            raise SendError(f"nack_{ack.error or 'unknown'}", f"decode node did not take rid={job.rid}: {ack.error}")


def _classify(e: Exception) -> SendError:
    if isinstance(e, SendError):
        return e
    if isinstance(e, AuthError):
        return SendError("auth", str(e))
    if isinstance(e, ProtocolMismatch):
        return SendError("incompatible", str(e))
    if isinstance(e, ProtocolError):
        return SendError("protocol", str(e))
    if isinstance(e, (TimeoutError, socket.timeout)):
        return SendError("timeout", f"control-plane timeout: {e}")
    if isinstance(e, OSError):
        return SendError("network", str(e))
    return SendError("internal", f"{type(e).__name__}: {e}")
