"""Express-lane gating with real processes: as many requests per node as it has seats (its /decode_status `seats`; 1
for a node that does not say); one more waits, spills to the native lane, or gets 429 + Retry-After, as its alias is
configured; a client disconnect frees its seat.

A second router process is started here with aliases for each policy, pointing at the live stack's
prefill, native decode and express decode servers (the shipped router keeps its own config).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from exactness import token_prompt

HOLD_TOKENS = 3000  # long enough to keep the single express node busy for a few seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gate_router(live_stack, tmp_path_factory):
    port = _free_port()
    cfg = tmp_path_factory.mktemp("gate-router") / "router.yaml"
    cfg.write_text(f"""
listen: {{host: 127.0.0.1, port: {port}}}
prefill: {{url: "{live_stack.prefill_url}", model: tiny-llama}}
tokenizer_dir: "{live_stack.model_dir}"
max_model_len: 4096
timeouts: {{connect_s: 5, prefill_s: 300, decode_s: 600, kv_wait_s: 60, cancel_s: 1}}
pools:
  native: {{kind: native, nodes: ["{live_stack.native_url}"]}}
  express:
    kind: expresslane
    nodes: [{{url: "{live_stack.express_url}", ctrl_host: 127.0.0.1, ctrl_port: {live_stack.ports['EXPRESS_CTRL_PORT']}}}]
    queue: {{max_waiting: 4, max_wait_s: 60, when_full: reject, retry_after_s: 1}}
aliases:
  tiny-llama: {{pool: native}}
  x-wait: {{pool: express, queue: {{max_waiting: 4, max_wait_s: 120, when_full: reject, retry_after_s: 1}}}}
  x-spill: {{pool: express, queue: {{max_waiting: 4, max_wait_s: 0.3, when_full: spill, spill_to: native}}}}
  x-reject: {{pool: express, queue: {{max_waiting: 4, max_wait_s: 0.3, when_full: reject, retry_after_s: 2}}}}
""")
    log = open(cfg.parent / "router.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "expresslane.router", "--config", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, Path(cfg.parent / "router.log").read_text()
        assert time.monotonic() < deadline, "gate router did not start"
        time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def _status(live_stack) -> str:
    return httpx.get(f"{live_stack.express_url}/decode_status", timeout=5).json()["state"]


def _seats(live_stack) -> tuple[int, int]:
    """(seats, busy seats) of the node: its /decode_status `seats` / `seats_busy`, or one seat busy or idle."""
    st = httpx.get(f"{live_stack.express_url}/decode_status", timeout=5).json()
    seats = st.get("seats") if isinstance(st.get("seats"), int) else 1
    busy = st.get("seats_busy") if isinstance(st.get("seats_busy"), int) else int(st.get("state") == "busy")
    return seats, busy


def _wait_state(live_stack, state: str, timeout: float) -> float:
    t0 = time.monotonic()
    while _status(live_stack) != state:
        assert time.monotonic() - t0 < timeout, f"express node not {state} after {timeout}s"
        time.sleep(0.02)
    return time.monotonic() - t0


class Holder(threading.Thread):
    """Keeps the express node busy with one long streaming request through the gate router."""

    def __init__(self, url: str, salt: int = 77):
        super().__init__(daemon=True)
        self.url, self.status, self.text, self.salt = url, None, "", salt
        self.client = httpx.Client(timeout=300)

    def run(self):
        body = {"model": "x-wait", "prompt": token_prompt(8, salt=self.salt), "max_tokens": HOLD_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with self.client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                self.status = r.status_code
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass  # stop() closed the connection

    def stop(self):
        """Disconnect (the router cancels the request and frees the node), so a failed test does not leave the
        node busy for the tests after it."""
        self.client.close()


def _metric(url: str, name: str, **labels) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_busy_node_waits_spills_or_rejects_as_configured(live_stack, gate_router):
    _wait_state(live_stack, "idle", 30)
    seats, _ = _seats(live_stack)
    holders = [Holder(gate_router, salt=77 + i) for i in range(seats)]  # every seat held
    for h in holders:
        h.start()
    try:
        _check_policies(live_stack, gate_router, holders)
    finally:
        for h in holders:
            if h.is_alive():
                h.stop()


def _check_policies(live_stack, gate_router, holders: list[Holder]) -> None:
    _wait_state(live_stack, "busy", 60)  # ("busy": every seat held)
    small = {"prompt": token_prompt(20, salt=78), "max_tokens": 6, "temperature": 0}

    # reject: 429 with Retry-After and an OpenAI-style body, after the alias's short wait.
    r = httpx.post(f"{gate_router}/v1/completions", json=dict(small, model="x-reject"), timeout=30)
    assert r.status_code == 429, r.text
    assert r.headers.get("retry-after") == "2"
    assert r.json()["error"]["type"]

    # spill: served by the native lane instead, counted.
    spills = _metric(gate_router, "expresslane_router_spillover_total")
    r = httpx.post(f"{gate_router}/v1/completions", json=dict(small, model="x-spill"), timeout=120)
    assert r.status_code == 200, r.text
    assert _metric(gate_router, "expresslane_router_spillover_total") == spills + 1
    assert _status(live_stack) == "busy", "the holders should still own every seat"

    # wait: queued until a seat is free, then served by the express node.
    t0 = time.monotonic()
    r = httpx.post(f"{gate_router}/v1/completions", json=dict(small, model="x-wait"), timeout=300)
    assert r.status_code == 200, r.text
    for h in holders:
        h.join(timeout=300)
        assert h.status == 200
    assert time.monotonic() - t0 > 0.2


def test_client_disconnect_frees_the_node_within_a_second(live_stack, gate_router):
    _wait_state(live_stack, "idle", 60)
    body = {"model": "x-wait", "prompt": token_prompt(8, salt=79), "max_tokens": HOLD_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", f"{gate_router}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(5):
                next(lines)
            assert _seats(live_stack)[1] == 1  # its seat
        # leaving the block closes the connection mid-stream
        freed_after = _wait_state(live_stack, "idle", 5)
    assert freed_after < 1.0, f"node freed {freed_after:.2f}s after the client left"
