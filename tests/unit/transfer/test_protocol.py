"""Control-plane framing, caps and compatibility checks."""

from __future__ import annotations

import socket
import struct

import pytest

from expresslane.engine.protocol import messages as m
from expresslane.engine.protocol.errors import (
    ConnectionClosed,
    LayoutMismatch,
    MagicMismatch,
    MessageTooLarge,
    ProtocolError,
    VersionMismatch,
)
from expresslane.engine.protocol.layout import KVLayoutSpec

LAYOUT = KVLayoutSpec(4, 4, 32, "float32", 4096)


def _pair():
    a, b = socket.socketpair()
    a.settimeout(2)
    b.settimeout(2)
    return a, b


def test_roundtrip_every_message() -> None:
    a, b = _pair()
    msgs = [
        m.hello(LAYOUT, {"name": "nixl"}, busy=False, node_id="n"),
        m.admit(rid="r", rank=0, world_size=1, head_start=0, num_heads=4, num_tokens=3, nbytes=10, layout=LAYOUT),
        m.accept(rid="r", rank=0, generation=7, dest_offset=0, nbytes=10, notif="r|7|0"),
        m.reject(rid="r", reason=m.REJECT_BUSY, detail="x"),
        m.done(rid="r", rank=0, generation=7, nbytes=10, timings={"write_s": 0.1}),
        m.ack(rid="r", generation=7, ok=True),
        m.error("protocol", "bad"),
    ]
    for msg in msgs:
        m.send_msg(a, msg)
        assert m.recv_msg(b) == msg
    assert msgs[3]["retryable"] is True
    assert m.reject(rid="r", reason=m.REJECT_TOO_LONG)["retryable"] is False


def test_frame_is_big_endian_length_prefixed_json() -> None:
    frame = m.encode(m.ack(rid="r", generation=1, ok=True))
    (n,) = struct.unpack(">I", frame[:4])
    assert n == len(frame) - 4 and frame[4:5] == b"{"


def test_size_cap_on_encode_and_decode() -> None:
    big = m.error("x", "y" * 2000)
    with pytest.raises(MessageTooLarge):
        m.encode(big, max_bytes=1000)
    a, b = _pair()
    a.sendall(struct.pack(">I", m.MAX_MESSAGE_BYTES + 1))  # announced size alone is refused
    with pytest.raises(MessageTooLarge):
        m.recv_msg(b)


def test_malformed_frames() -> None:
    for body in (b"not json", b"[1, 2]", b'{"type": "nope"}', b"\xff\xfe"):
        a, b = _pair()
        a.sendall(struct.pack(">I", len(body)) + body)
        with pytest.raises(ProtocolError):
            m.recv_msg(b)
    a, b = _pair()
    a.sendall(struct.pack(">I", 100) + b"{")
    a.close()
    with pytest.raises(ConnectionClosed, match="mid-frame"):
        m.recv_msg(b)
    a, b = _pair()
    a.close()
    with pytest.raises(ConnectionClosed):
        m.recv_msg(b)


def test_compat_checks_magic_then_version_then_layout() -> None:
    good = m.hello(LAYOUT, {}, False, "n")
    assert m.check_compat(good, LAYOUT, peer="p") == LAYOUT
    with pytest.raises(MagicMismatch, match="expresslane_ctrl_port"):
        m.check_compat({**good, "magic": "tilert", "protocol_version": 99}, LAYOUT, peer="p")
    with pytest.raises(VersionMismatch, match="same expresslane-engine version"):
        m.check_compat({**good, "protocol_version": 99, "layout_hash": "x"}, LAYOUT, peer="p")
    other = KVLayoutSpec(4, 4, 32, "bfloat16", 4096)
    with pytest.raises(LayoutMismatch, match=r"dtype: p=bfloat16 local=float32.*--dtype"):
        m.check_compat(m.hello(other, {}, False, "n"), LAYOUT, peer="p")
    with pytest.raises(LayoutMismatch, match="num_layers"):
        m.check_compat(m.hello(KVLayoutSpec(8, 4, 32, "float32", 4096), {}, False, "n"), LAYOUT, peer="p")
    # max_seq_len is not part of the compatibility hash
    assert m.check_compat(m.hello(KVLayoutSpec(4, 4, 32, "float32", 128), {}, False, "n"), LAYOUT, peer="p")


def test_layout_nbytes_and_hash() -> None:
    assert LAYOUT.request_nbytes(10) == 2 * 4 * 10 * 4 * 32 * 4
    assert LAYOUT.request_nbytes(10, num_heads=2) == LAYOUT.request_nbytes(10) // 2
    assert LAYOUT.compat_hash() == KVLayoutSpec(4, 4, 32, "torch.float32", 1).compat_hash()
    assert LAYOUT.compat_hash() != KVLayoutSpec(4, 4, 64, "float32", 4096).compat_hash()
    with pytest.raises(ValueError):
        KVLayoutSpec(4, 4, 32, "int3", 4096)
