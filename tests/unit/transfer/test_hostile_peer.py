"""Hostile peers against a REAL receiver (real sockets, real NIXL) with a peer secret set.

Each attack is rejected and logged, gets nothing beyond the challenge before it authenticates, and the
receiver's threads and connections stay bounded; a real authenticated transfer still lands byte-exact.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import threading
import time

import pytest
import torch

pytest.importorskip("nixl")

from expresslane.engine.protocol import auth as a  # noqa: E402
from expresslane.engine.protocol import messages as m  # noqa: E402
from expresslane.engine.protocol.layout import KVLayoutSpec  # noqa: E402
from expresslane.engine.transfer import KVReceiver, KVTransferFailed, SendError  # noqa: E402
from expresslane.engine.transfer.channel import open_channel  # noqa: E402
from expresslane.engine.transfer.nixl_transport import NixlEndpoint  # noqa: E402
from expresslane.engine.transfer.sender import KVSender, SenderConfig, SendJob  # noqa: E402
from expresslane.engine.transfer.staging import StagingPool  # noqa: E402

L, H, D, MAX = 2, 4, 8, 32
LAYOUT = KVLayoutSpec(L, H, D, "float32", MAX)
SECRET = b"correct horse battery staple"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def rx():
    r = KVReceiver(L, H, D, torch.float32, "cpu", MAX, "127.0.0.1", ctrl_port=_free_port(), num_slots=1,
                   peer_secret=SECRET, max_connections=16, handshake_timeout_s=1.0, io_timeout_s=2.0,
                   write_deadline_s=1.5)
    r.start()
    yield r
    r.stop()


class _Prefill:
    def __init__(self, secret: bytes | None = SECRET) -> None:
        self.pool = StagingPool(2, LAYOUT.request_nbytes(MAX))
        self.endpoint = NixlEndpoint("hostile-test")
        self.sender = KVSender(self.endpoint, self.endpoint.register(self.pool.buffer), LAYOUT, peer_secret=secret,
                               config=SenderConfig(io_timeout_s=3, busy_retry_s=0.3, connect_retries=0))

    def send(self, rid: str, port: int, T: int = 6):
        slot = self.pool.acquire()
        k, v = slot.dense_kv(L, T, H, D, torch.float32)
        k.copy_(torch.randn(k.shape))
        v.copy_(torch.randn(v.shape))
        kc, vc = k.clone(), v.clone()
        self.sender.send(SendJob(rid=rid, host="127.0.0.1", port=port, num_tokens=T, slot=slot,
                                 nbytes=LAYOUT.request_nbytes(T)))
        return kc, vc


def _raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=3)
    return s


def _read_all(s: socket.socket, limit_s: float = 3.0) -> bytes:
    """Everything the node sends until it closes the connection (fails the test if it never does)."""
    s.settimeout(limit_s)
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:  # the node closed with our bytes unread (an RST): closed all the same
            return out
        if not chunk:
            return out
        out += chunk


def _only_the_challenge(data: bytes) -> None:
    """The node said nothing but its challenge: no hello, no NIXL metadata, no buffer address."""
    (n,) = struct.unpack(">I", data[:4])
    msg = m.decode_frame(data[: 4 + n])
    assert isinstance(msg, m.Challenge) and msg.auth == "hmac-sha256"
    assert data[4 + n:] == b""
    assert b"agent_metadata" not in data and b"region" not in data


def _authed(port: int, secret: bytes = SECRET):
    return open_channel("127.0.0.1", port, secret=secret, connect_timeout_s=2, io_timeout_s=3)


def _admit(rid: str, T: int = 6, **kw) -> m.Admit:
    return m.admit(rid=rid, rank=0, world_size=1, head_start=0, num_heads=H, num_tokens=T,
                   nbytes=LAYOUT.request_nbytes(T), layout=LAYOUT, **kw)


@pytest.mark.parametrize("attack", ["garbage", "huge_length", "unauthenticated_admit", "wrong_secret",
                                    "silence"])
def test_unauthenticated_peers_get_only_the_challenge(rx: KVReceiver, attack: str, caplog) -> None:
    caplog.set_level(logging.INFO, logger="expresslane")
    s = _raw(rx.ctrl_port)
    if attack == "garbage":
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)))
    elif attack == "huge_length":
        s.sendall(struct.pack(">I", 0xFFFFFFF0) + b"{")
    elif attack == "unauthenticated_admit":
        s.sendall(m.encode(_admit("victim")))
    elif attack == "wrong_secret":
        first = s.recv(4096)
        (n,) = struct.unpack(">I", first[:4])
        challenge = m.decode_frame(first[: 4 + n])
        nonce = a.new_nonce()
        s.sendall(m.encode(m.Auth(nonce=nonce, proof=a.prefill_proof(b"guess", challenge.nonce, nonce))))
        rest = _read_all(s)
        assert rest == b""  # no auth_ok, no hello
        assert rx.stats["auth_failures"] == 1
        return
    t0 = time.monotonic()
    data = _read_all(s)
    assert time.monotonic() - t0 < 2.5  # bounded by the handshake deadline (1 s here)
    _only_the_challenge(data)
    deadline = time.monotonic() + 2
    while rx.stats["auth_failures"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rx.stats["auth_failures"] == 1
    assert "not authenticated" in caplog.text


def test_prefill_without_the_secret_is_refused_and_told_why(rx: KVReceiver) -> None:
    rx.expect("r", 5)
    with pytest.raises(SendError) as e:
        _Prefill(secret=None).send("r", rx.ctrl_port)
    assert e.value.reason == "auth" and "EXPRESSLANE_PEER_SECRET" in e.value.detail


def test_prefill_with_a_secret_refuses_an_open_node() -> None:
    open_rx = KVReceiver(L, H, D, torch.float32, "cpu", MAX, "127.0.0.1", ctrl_port=_free_port(), num_slots=1)
    open_rx.start()
    try:
        open_rx.expect("r", 5)
        with pytest.raises(SendError) as e:
            _Prefill().send("r", open_rx.ctrl_port)
        assert e.value.reason == "auth" and "offers no authentication" in e.value.detail
        assert open_rx.stats["accepted"] == 0
    finally:
        open_rx.stop()


def test_wrong_magic_is_a_typed_error_on_both_sides(rx: KVReceiver) -> None:
    # A prefill pointed at something that is not an expresslane control port.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    def fake() -> None:
        c, _ = srv.accept()
        c.sendall(m.encode(m.Challenge(magic="tilert-kv", protocol_version=1, auth="none", nonce="00" * 32)))
        time.sleep(0.5)
        c.close()

    threading.Thread(target=fake, daemon=True).start()
    with pytest.raises(SendError) as e:
        _Prefill().send("r", port)
    assert e.value.reason == "incompatible" and "expresslane_ctrl_port" in e.value.detail
    srv.close()
    # An authenticated peer whose admit carries another magic: rejected incompatible, nothing admitted.
    rx.expect("wm", 5)
    ch, _ = _authed(rx.ctrl_port)
    with ch:
        ch.send(m.Admit(**{**_admit("wm").__dict__, "magic": "tilert-kv"}))
        reply = ch.recv()
    assert isinstance(reply, m.Reject) and reply.reason == "incompatible"
    assert rx.table.state_of("wm").value == "expected"


def test_replayed_and_injected_frames_end_the_connection(rx: KVReceiver) -> None:
    rx.expect("rp", 5)
    ch, _ = _authed(rx.ctrl_port)
    sealed = ch.session.seal(_admit("rp").to_wire())  # a valid authenticated frame, captured
    ch.sock.sendall(m.frame(m.encode_body(sealed)))
    assert isinstance(ch.recv(), m.Accept)
    ch.sock.sendall(m.frame(m.encode_body(sealed)))  # replayed on the same connection: old seq
    assert _read_all(ch.sock) == b""
    ch.close()
    ch2, _ = _authed(rx.ctrl_port)  # replayed into a fresh connection: other nonces, other key
    ch2.sock.sendall(m.frame(m.encode_body(sealed)))
    assert _read_all(ch2.sock) == b""
    ch2.close()
    ch3, _ = _authed(rx.ctrl_port)  # an unauthenticated frame injected into an authenticated stream
    ch3.sock.sendall(m.encode(m.Abort(rid="rp", reason="x")))
    assert _read_all(ch3.sock) == b""
    ch3.close()
    deadline = time.monotonic() + 2
    while rx.stats["auth_failures"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rx.stats["auth_failures"] == 3


async def test_admit_hijack_of_a_live_rid_fails_and_the_real_transfer_lands(rx: KVReceiver) -> None:
    rx.expect("live", 10)
    waiter = asyncio.create_task(rx.wait_for("live", 10))
    # A peer that read the rid somewhere but lacks the secret cannot admit it.
    s = _raw(rx.ctrl_port)
    s.sendall(m.encode(_admit("live")))
    assert _read_all(s) != b"" and rx.table.state_of("live").value == "expected"
    tx = _Prefill()
    k, v = await asyncio.to_thread(tx.send, "live", rx.ctrl_port)
    got = await waiter
    assert torch.equal(got.k, k) and torch.equal(got.v, v)
    got.release()


def test_duplicate_admit_keepalive_cannot_hold_the_slot(rx: KVReceiver) -> None:
    rx.expect("held", 30)
    ch, _ = _authed(rx.ctrl_port)
    ch.send(_admit("held"))
    assert isinstance(ch.recv(), m.Accept)
    t0 = time.monotonic()
    replies = []
    try:
        while time.monotonic() - t0 < 5:
            ch.send(_admit("held"))  # chatter to keep the connection (and the slot) alive
            replies.append(ch.recv())
            time.sleep(0.2)
    except (OSError, Exception):
        pass
    elapsed = time.monotonic() - t0
    assert elapsed < 3  # closed at the write deadline (1.5 s after accept), not kept alive
    if isinstance(replies[-1], m.Error):  # the node says why it hangs up
        assert "write deadline" in replies.pop().detail
    assert replies and all(isinstance(r, m.Reject) and r.reason == "duplicate" for r in replies)
    deadline = time.monotonic() + 2
    while rx.table.state_of("held").value != "failed" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rx.table.state_of("held").value == "failed"
    # The node hung up on a live peer that had been accepted for a WRITE: the slot stays fenced (integrity
    # over liveness) until that write's notification comes; no timer reuses it.
    assert rx.stats["slots_fencing"] == 1
    ch.close()
    with pytest.raises(KVTransferFailed) as e:
        asyncio.run(rx.wait_for("held", 1))
    assert e.value.reason == "sender_vanished"


def _threads() -> int:
    return threading.active_count()


def test_a_thousand_idle_connections_stay_bounded(rx: KVReceiver) -> None:
    threads_before = _threads()
    socks = []
    for _ in range(1000):
        try:
            socks.append(socket.create_connection(("127.0.0.1", rx.ctrl_port), timeout=3))
        except OSError:
            pass
    # The accept loop may lag on a loaded machine: wait (bounded) until it has refused what it will refuse.
    # Up to the listen backlog (128, control_server.start) may still wait in the kernel, not yet accepted
    # (CI under load: 903 refused of 1000 after 10 s with a slack of 64).
    unaccepted = 128
    deadline = time.monotonic() + 30
    while rx.stats["connections_refused"] < len(socks) - 16 - unaccepted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rx.stats["connections_open"] <= 16  # max_connections
    assert rx.stats["connections_refused"] >= len(socks) - 16 - unaccepted
    assert _threads() - threads_before <= 4  # no thread per connection
    # An exact transfer during the attack still lands (once the idle ones hit the handshake deadline).
    rx.expect("during", 10)
    time.sleep(1.2)
    tx = _Prefill()
    k, _ = tx.send("during", rx.ctrl_port)
    got = asyncio.run(rx.wait_for("during", 5))
    assert torch.equal(got.k, k)
    got.release()
    for s in socks:
        s.close()
    deadline = time.monotonic() + 3
    while rx.stats["connections_open"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rx.stats["connections_open"] == 0


def test_tls_channel(tmp_path) -> None:
    """Optional TLS (stdlib ssl) under the same authentication."""
    import ssl
    import subprocess

    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    r = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                        "subjectAltName=IP:127.0.0.1"], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"openssl cannot make a test certificate: {r.stderr[-200:]!r}")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    rx = KVReceiver(L, H, D, torch.float32, "cpu", MAX, "127.0.0.1", ctrl_port=_free_port(), num_slots=1,
                    peer_secret=SECRET, ssl_context=server_ctx)
    rx.start()
    try:
        rx.expect("tls", 5)
        tx = _Prefill()
        tx.sender.ssl_context = client_ctx
        k, _ = tx.send("tls", rx.ctrl_port)
        got = asyncio.run(rx.wait_for("tls", 5))
        assert torch.equal(got.k, k)
        got.release()
        plain = _raw(rx.ctrl_port)  # a plaintext peer gets no challenge at all
        plain.sendall(b"\x00\x00\x00\x02{}")
        assert b"challenge" not in _read_all(plain, 5)
    finally:
        rx.stop()


def test_checksum_mismatch_fails_the_waiter_at_once(rx: KVReceiver) -> None:
    """A done whose checksum does not match the landed bytes: ack not ok, waiter gets checksum_mismatch."""
    from expresslane.engine.transfer.nixl_transport import Region

    rx.expect("crc", 10)
    tx = _Prefill()
    slot = tx.pool.acquire()
    slot.bytes().fill_(3)
    ch, hello = _authed(rx.ctrl_port)
    with ch:
        # The NIXL peer is loaded before the admit: the receiver's write deadline (1.5 s here) runs from the
        # accept, and loading a remote agent took longer than that on a loaded CI host.
        remote = tx.endpoint.ensure_remote(hello.transport["agent_name"], hello.transport["agent_metadata"])
        ch.send(_admit("crc"))
        acc = ch.recv()
        assert isinstance(acc, m.Accept)
        tx.endpoint.write(local=tx.sender.staging_region, local_offset=slot.offset, nbytes=acc.nbytes,
                          remote_agent=remote, remote=Region.from_wire(hello.transport["region"]),
                          remote_offset=acc.dest_offset, notif=acc.notif.encode(), timeout_s=5)
        ch.send(m.Done(rid="crc", rank=0, generation=acc.generation, nbytes=acc.nbytes, checksum="crc32:00000000"))
        ack = ch.recv()
    assert isinstance(ack, m.Ack) and not ack.ok and ack.error == "checksum_mismatch"
    with pytest.raises(KVTransferFailed) as e:
        asyncio.run(rx.wait_for("crc", 1))
    assert e.value.reason == "checksum_mismatch" and rx.stats["checksum_failures"] == 1
    assert rx.stats["slots_in_use"] == 0


def test_abort_frame_fails_a_waiting_request_within_milliseconds(rx: KVReceiver) -> None:
    async def scenario() -> float:
        rx.expect("ab", 30)
        waiter = asyncio.create_task(rx.wait_for("ab", 30))
        await asyncio.sleep(0.05)
        tx = _Prefill()
        t0 = time.monotonic()
        await asyncio.to_thread(tx.sender.submit_abort, "ab", "127.0.0.1", rx.ctrl_port, "rejected_busy", "d")
        with pytest.raises(KVTransferFailed) as e:
            await waiter
        assert e.value.reason == "aborted:rejected_busy"
        tx.sender.stop()
        return time.monotonic() - t0

    elapsed = asyncio.run(scenario())
    print(f"abort -> waiter failed in {elapsed * 1000:.1f} ms")
    assert rx.stats["aborted"] == 1 and rx.stats["slots_in_use"] == 0


def test_json_bomb_and_deep_nesting_are_protocol_errors(rx: KVReceiver) -> None:
    s = _raw(rx.ctrl_port)
    s.settimeout(3)
    first = s.recv(65536)  # the challenge, read before the bomb: the node's close may reset unread bytes away
    body = b"[" * 200000
    try:
        s.sendall(struct.pack(">I", len(body)) + body)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused before we finished sending: the node closed on the oversized frame
    _only_the_challenge(first + _read_all(s))
    assert json  # (imported for the fuzz helpers' symmetry)


def test_a_write_that_may_still_land_fences_the_slot_until_the_sender_is_gone(rx: KVReceiver) -> None:
    """abort{write_final: false} (the sender's WRITE timed out but may still land): the slot is not reused
    while that connection lives, however long; its close is the signal that frees it."""
    from expresslane.engine.transfer import KVRefused

    rx.expect("f1", 30)
    ch, _ = _authed(rx.ctrl_port)
    ch.send(_admit("f1"))
    assert isinstance(ch.recv(), m.Accept)
    ch.send(m.Abort(rid="f1", reason="write_timeout", write_final=False))
    deadline = time.monotonic() + 2
    while rx.table.state_of("f1").value != "failed" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rx.stats["slots_fencing"] == 1
    with pytest.raises(KVRefused):
        rx.expect("f2", 30)
    ch.close()
    deadline = time.monotonic() + 2
    while rx.stats["slots_fencing"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rx.stats["slots_fencing"] == 0
    rx.expect("f2", 30)
