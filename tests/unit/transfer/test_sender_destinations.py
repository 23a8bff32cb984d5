"""The sender's per-destination workers: an idle one ends and frees its place, so node churn (new addresses,
new ports) never exhausts max_destinations; a job queued for a retiring worker is never stranded."""

from __future__ import annotations

import socket
import threading
import time

from expresslane.engine.transfer.sender import KVSender, SenderConfig, SendObserver


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens: a connect is refused at once
    return port


class _Failures(SendObserver):
    def __init__(self) -> None:
        self.reasons: list[tuple[str, str]] = []
        self.event = threading.Event()

    def on_failure(self, job, reason: str) -> None:
        self.reasons.append((job.rid if job else "", reason))
        self.event.set()


def _sender(**kw) -> tuple[KVSender, _Failures]:
    obs = _Failures()
    cfg = SenderConfig(connect_timeout_s=0.5, connect_retries=0, **kw)
    return KVSender(None, None, None, config=cfg, observer=obs), obs


def _wait(pred, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def test_an_idle_destination_ends_and_frees_its_place():
    sender, obs = _sender(max_destinations=1, destination_idle_s=0.1)
    a, b = _closed_port(), _closed_port()
    assert sender.submit_abort("r1", "127.0.0.1", a, "test")
    assert _wait(lambda: ("r1", "connect") in obs.reasons)
    worker = sender._destinations[("127.0.0.1", a)].thread
    # While a's worker lives, a second destination is refused (the bound holds) ...
    assert not sender.submit_abort("r2", "127.0.0.1", b, "test")
    assert ("r2", "too_many_destinations") in obs.reasons
    # ... and once it has been idle, it is gone and the place is free.
    assert _wait(lambda: not worker.is_alive() and not sender._destinations)
    assert sender.submit_abort("r3", "127.0.0.1", b, "test")
    assert _wait(lambda: ("r3", "connect") in obs.reasons)
    sender.stop()


def test_a_job_for_a_retiring_destination_is_never_stranded():
    """Jobs submitted around each worker's retirement all run: every one ends as a connect failure."""
    sender, obs = _sender(destination_idle_s=0.001)
    port = _closed_port()
    n = 200
    for i in range(n):
        assert sender.submit_abort(f"r{i}", "127.0.0.1", port, "test")
        if i % 7 == 0:
            time.sleep(0.003)  # let the worker go idle and retire between some of them
    assert _wait(lambda: len(obs.reasons) == n, 30), f"{len(obs.reasons)} of {n} jobs ran"
    assert {r for _, r in obs.reasons} == {"connect"}
    sender.stop()
