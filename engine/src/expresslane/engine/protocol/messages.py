"""Control-plane messages: length-prefixed JSON frames over TCP (docs/protocol.md).

Frame = 4-byte big-endian unsigned length N, then N bytes of UTF-8 JSON holding one object with a
"type" field. N is capped (MAX_MESSAGE_BYTES) on both encode and decode, before anything is allocated.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from expresslane.engine.protocol.errors import (
    ConnectionClosed,
    LayoutMismatch,
    MagicMismatch,
    MessageTooLarge,
    ProtocolError,
    VersionMismatch,
)
from expresslane.engine.protocol.layout import KVLayoutSpec

MAGIC = "expresslane-kv"
PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_HEADER = struct.Struct(">I")

# Message types.
HELLO = "hello"    # decode -> prefill, first frame on every connection
ADMIT = "admit"    # prefill -> decode
ACCEPT = "accept"  # decode -> prefill
REJECT = "reject"  # decode -> prefill
DONE = "done"      # prefill -> decode, after the one-sided WRITE completed
ACK = "ack"        # decode -> prefill
ERROR = "error"    # either way, then close: the peer sent something unusable
MESSAGE_TYPES = frozenset({HELLO, ADMIT, ACCEPT, REJECT, DONE, ACK, ERROR})

# Reject reasons. Retryable ones are retried by the sender with bounded backoff.
REJECT_BUSY = "busy"                # no free receive slot, or the node said set_busy(True)
REJECT_CANCELLING = "cancelling"    # a cancelled transfer still drains a slot
REJECT_CANCELLED = "cancelled"      # this rid was cancelled on the decode node
REJECT_TOO_LONG = "too_long"        # num_tokens > the node's max_seq_len
REJECT_INCOMPATIBLE = "incompatible"  # protocol/layout mismatch found at admit time
REJECT_DUPLICATE = "duplicate"      # this (rid, rank) was already admitted
REJECT_BAD_REQUEST = "bad_request"  # admit fields inconsistent (nbytes, heads, ...)
RETRYABLE_REJECTS = frozenset({REJECT_BUSY, REJECT_CANCELLING})


def encode(msg: dict[str, Any], max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    if msg.get("type") not in MESSAGE_TYPES:
        raise ProtocolError(f"unknown message type {msg.get('type')!r}")
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > max_bytes:
        raise MessageTooLarge(f"{msg['type']} message is {len(body)} bytes, cap is {max_bytes}")
    return _HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(body.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"control frame is not UTF-8 JSON: {e}") from e
    if not isinstance(msg, dict):
        raise ProtocolError(f"control frame must be a JSON object, got {type(msg).__name__}")
    if msg.get("type") not in MESSAGE_TYPES:
        raise ProtocolError(f"unknown message type {msg.get('type')!r}")
    return msg


def _recv_exact(sock: socket.socket, n: int, *, at_boundary: bool) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            if at_boundary and not buf:
                raise ConnectionClosed("peer closed the control connection")
            raise ConnectionClosed(f"peer closed the control connection mid-frame ({len(buf)}/{n} bytes)")
        buf += chunk
    return bytes(buf)


def send_msg(sock: socket.socket, msg: dict[str, Any], max_bytes: int = MAX_MESSAGE_BYTES) -> None:
    sock.sendall(encode(msg, max_bytes))


def recv_msg(sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Read one frame. Socket timeouts propagate as ``socket.timeout`` (TimeoutError)."""
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, at_boundary=True))
    if n > max_bytes:
        raise MessageTooLarge(
            f"peer announced a {n}-byte control frame, cap is {max_bytes}: not an expresslane peer, "
            "or a corrupted stream"
        )
    return decode_body(_recv_exact(sock, n, at_boundary=False))


def expect(msg: dict[str, Any], *types: str) -> dict[str, Any]:
    if msg["type"] == ERROR:
        raise ProtocolError(f"peer reported an error: {msg.get('code')}: {msg.get('detail')}")
    if msg["type"] not in types:
        raise ProtocolError(f"expected {'/'.join(types)}, got {msg['type']}")
    return msg


# ---------------------------------------------------------------------------------------------------
# Builders


def hello(layout: KVLayoutSpec, transport: dict[str, Any], busy: bool, node_id: str) -> dict[str, Any]:
    return {
        "type": HELLO,
        "magic": MAGIC,
        "protocol_version": PROTOCOL_VERSION,
        "layout_hash": layout.compat_hash(),
        "layout": layout.to_wire(),
        "transport": transport,
        "busy": bool(busy),
        "node_id": node_id,
    }


def admit(
    *,
    rid: str,
    rank: int,
    world_size: int,
    head_start: int,
    num_heads: int,
    num_tokens: int,
    nbytes: int,
    layout: KVLayoutSpec,
) -> dict[str, Any]:
    return {
        "type": ADMIT,
        "magic": MAGIC,
        "protocol_version": PROTOCOL_VERSION,
        "layout_hash": layout.compat_hash(),
        "layout": layout.to_wire(),
        "rid": rid,
        "rank": rank,
        "world_size": world_size,
        "head_start": head_start,
        "num_heads": num_heads,
        "num_tokens": num_tokens,
        "nbytes": nbytes,
    }


def accept(*, rid: str, rank: int, generation: int, dest_offset: int, nbytes: int, notif: str) -> dict[str, Any]:
    return {
        "type": ACCEPT, "rid": rid, "rank": rank, "generation": generation,
        "dest_offset": dest_offset, "nbytes": nbytes, "notif": notif,
    }


def reject(*, rid: str, reason: str, detail: str = "") -> dict[str, Any]:
    return {"type": REJECT, "rid": rid, "reason": reason, "retryable": reason in RETRYABLE_REJECTS, "detail": detail}


def done(*, rid: str, rank: int, generation: int, nbytes: int, timings: dict[str, float]) -> dict[str, Any]:
    return {"type": DONE, "rid": rid, "rank": rank, "generation": generation, "nbytes": nbytes, "timings": timings}


def ack(*, rid: str, generation: int, ok: bool, error: str = "") -> dict[str, Any]:
    return {"type": ACK, "rid": rid, "generation": generation, "ok": bool(ok), "error": error}


def error(code: str, detail: str) -> dict[str, Any]:
    return {"type": ERROR, "code": code, "detail": detail}


# ---------------------------------------------------------------------------------------------------
# Compatibility checks: magic, then protocol version, then layout hash, before any other field is read.


def check_compat(msg: dict[str, Any], local: KVLayoutSpec, *, peer: str) -> KVLayoutSpec:
    """Validate magic, protocol version and layout hash of a hello/admit. Returns the peer's layout."""
    if msg.get("magic") != MAGIC:
        raise MagicMismatch(
            f"{peer} sent magic {msg.get('magic')!r}, expected {MAGIC!r}: the address is not an expresslane "
            "KV control port. Check expresslane_host/expresslane_ctrl_port in kv_transfer_params (router "
            "config) and that the decode node's --ctrl-port matches; a TileRT node uses tilert_* keys instead."
        )
    version = msg.get("protocol_version")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"{peer} speaks expresslane KV protocol version {version}, this side speaks {PROTOCOL_VERSION}: "
            "the prefill and decode images were built from different expresslane releases. Deploy the same "
            "expresslane-engine version on the prefill (connector) and the decode node."
        )
    try:
        remote = KVLayoutSpec.from_wire(msg["layout"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"{peer} sent an unreadable layout: {e}") from e
    if msg.get("layout_hash") != local.compat_hash() or remote.compat_hash() != local.compat_hash():
        diffs = [
            f"{name}: {peer}={getattr(remote, name)} local={getattr(local, name)}"
            for name in ("num_layers", "num_kv_heads", "head_dim", "dtype", "wire_layout")
            if getattr(remote, name) != getattr(local, name)
        ]
        raise LayoutMismatch(
            f"KV layout compatibility hash mismatch with {peer} ({msg.get('layout_hash')} != "
            f"{local.compat_hash()}); differing: {'; '.join(diffs) or 'hash only (corrupted peer?)'}. "
            "Likely causes: the prefill and decode nodes load different models or checkpoints, a different "
            "--dtype / --kv-cache-dtype (the wire carries the prefill's KV cache dtype), or a different "
            "expresslane wire layout. Fix: serve the same model with the same dtype on both, e.g. the "
            "decode node's --dtype must equal the prefill's KV cache dtype."
        )
    return remote
