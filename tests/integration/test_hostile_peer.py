"""Hostile peers against a LIVE express node (the whole stack as real processes, closed as `dev_stack.py up` starts
it: the peer secret, node token and vLLM key it generates; plus a destination allow-list), while an exact express
request is served.

Acceptance of issue 12: garbage bytes, a huge length prefix, an unauthenticated admit, a wrong secret,
replayed frames and 1,000 idle connections are each refused without the node's NIXL metadata leaking; an
express request sent during the attack still equals the single-server reference; a prefill request whose
marker names a destination outside the allow-list is not sent anywhere, is counted, and its outcome says so.

Against the default compose stack too (issue 42): with EXPRESSLANE_HOSTILE_TARGET set to a JSON object (`ctrl`:
the express node's control plane "host:port", `router`, `prefill`: URLs, `vllm_key_file`, `model`, `express_alias`)
the control-port attacks run against that running stack instead, from this host, which reaches the containers'
addresses (.ci/compose-e2e.sh's "hostile peer" step sets it); the allow-list test needs a stack started with an
allow-list and stays on the dev stack.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import time

import httpx
import pytest
from dev_stack import DevStack

from exactness import EXPRESS_ALIAS, MAX_TOKENS, completion, token_prompt
from expresslane.engine.protocol import auth as a
from expresslane.engine.protocol import messages as m
from expresslane.engine.protocol.layout import KVLayoutSpec

TARGET = json.loads(os.environ["EXPRESSLANE_HOSTILE_TARGET"]) if os.environ.get("EXPRESSLANE_HOSTILE_TARGET") else None


class _Running:
    """A running stack described by EXPRESSLANE_HOSTILE_TARGET (the default compose stack)."""

    def __init__(self, t: dict) -> None:
        host, port = t["ctrl"].rsplit(":", 1)
        self.ctrl = (host, int(port))
        self.router_url, self.prefill_url = t["router"], t["prefill"]
        self.model, self.express_alias = t.get("model", "tiny-llama"), t.get("express_alias", EXPRESS_ALIAS)
        with open(t["vllm_key_file"]) as f:
            self._key = f.read().strip()

    def auth_headers(self, name: str) -> dict[str, str]:
        assert name == "VLLM_API_KEY"
        return {"Authorization": f"Bearer {self._key}"}


@pytest.fixture(scope="module")
def secured_stack(request):
    if TARGET is not None:
        yield _Running(TARGET)
        return
    stack = request.getfixturevalue("_dev_secured_stack")
    yield stack


@pytest.fixture(scope="module")
def _dev_secured_stack(tiny_model_dir, tmp_path_factory):
    base = int(os.environ.get("EXPRESSLANE_TEST_PORT_BASE", "20000")) + 300
    ctrl = 5556 + base
    stack = DevStack(model_dir=tiny_model_dir, state_dir=tmp_path_factory.mktemp("secured-stack"), port_base=base,
                     services=("prefill", "decode-express", "router"),  # no native lane: nothing here uses it
                     secure=True,  # the default stack's generated secrets (docs/security.md)
                     extra_env={"EXPRESSLANE_ALLOWED_DESTINATIONS": f"127.0.0.1:{ctrl}"})
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def http(secured_stack):
    """vLLM's generated API key on every call (the reference calls go to the prefill directly; the router, without
    client keys, ignores it)."""
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=5.0), headers=secured_stack.auth_headers("VLLM_API_KEY")) as c:
        yield c


def _ctrl(stack) -> tuple[str, int]:
    """(host, port) of the express node's control plane."""
    if isinstance(stack, _Running):
        return stack.ctrl
    return "127.0.0.1", stack.ports["EXPRESS_CTRL_PORT"]


def _drain(s: socket.socket, limit_s: float = 10.0) -> bytes:
    s.settimeout(limit_s)
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def _assert_only_challenge(data: bytes) -> None:
    (n,) = struct.unpack(">I", data[:4])
    assert isinstance(m.decode_frame(data[: 4 + n]), m.Challenge)
    assert data[4 + n:] == b"" and b"agent_metadata" not in data


def _prompt(stack) -> str | list[int]:
    """The victim request's prompt: token ids of the dev stack's tiny model, or, against a running stack (its
    model is in its own volume, not on this host), plain text that its own tokenizer reads."""
    if isinstance(stack, _Running):
        return "Write three sentences about the sea, the wind and the harbour at dawn."
    return token_prompt(40, salt=11)


def _reference(http, stack, prompt):
    body = {"model": getattr(stack, "model", "tiny-llama"), "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0}
    return completion(http, stack.prefill_url, body)["choices"][0]["text"]


def test_attacks_on_the_control_port_are_refused_while_an_exact_request_is_served(secured_stack, http):
    addr = _ctrl(secured_stack)
    attacks = []
    unauth_admit = m.encode(m.admit(rid="victim", rank=0, world_size=1, head_start=0, num_heads=4, num_tokens=4,
                                    nbytes=1, layout=KVLayoutSpec(4, 4, 32, "float32", 64)))
    for payload in (b"\x00garbage\xff" * 10, struct.pack(">I", 0xFFFFFF00) + b"{", unauth_admit):
        s = socket.create_connection(addr, timeout=5)
        s.sendall(payload)
        attacks.append(s)
    # wrong secret
    s = socket.create_connection(addr, timeout=5)
    first = s.recv(4096)
    (n,) = struct.unpack(">I", first[:4])
    challenge = m.decode_frame(first[: 4 + n])
    nonce = a.new_nonce()
    s.sendall(m.encode(m.Auth(nonce=nonce, proof=a.prefill_proof(b"wrong", challenge.nonce, nonce))))
    assert _drain(s) == b""
    # 1,000 idle connections
    idle = []
    for _ in range(1000):
        try:
            idle.append(socket.create_connection(addr, timeout=5))
        except OSError:
            break
    prompt = _prompt(secured_stack)
    ref = _reference(http, secured_stack, prompt)
    time.sleep(6)  # the idle ones hit the node's handshake deadline (5 s) and free their places
    got = completion(http, secured_stack.router_url,
                     {"model": getattr(secured_stack, "express_alias", EXPRESS_ALIAS), "prompt": prompt,
                      "max_tokens": MAX_TOKENS, "temperature": 0})
    assert got["choices"][0]["text"] == ref
    for s in attacks:
        _assert_only_challenge(_drain(s))
    for s in idle:
        s.close()


def test_marker_outside_the_allow_list_is_not_sent_anywhere(secured_stack, http):
    if isinstance(secured_stack, _Running):
        pytest.skip("needs a stack started with a destination allow-list (the dev stack's fixture)")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(2.0)
    evil_port = listener.getsockname()[1]
    body = {"model": "tiny-llama", "prompt": token_prompt(20, salt=5), "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"expresslane_host": "127.0.0.1", "expresslane_ctrl_port": evil_port,
                                   "expresslane_rid": "rid-ssrf"}}
    r = http.post(f"{secured_stack.prefill_url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    params = r.json().get("kv_transfer_params") or {}
    assert params.get("expresslane_status") == "failed" and params.get("expresslane_error") == "not_allowed"
    with pytest.raises(socket.timeout):
        listener.accept()  # nothing connected to the address the request named
    text = http.get(f"{secured_stack.connector_metrics_url}/metrics").text
    refused = re.search(r"^expresslane_connector_refused_destinations_total ([0-9.e+]+)$", text, re.M)
    assert refused and float(refused.group(1)) >= 1
