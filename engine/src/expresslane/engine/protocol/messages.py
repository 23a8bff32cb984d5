"""Control-plane messages: typed, validated dataclasses carried in length-prefixed JSON frames.

Frame = 4-byte big-endian unsigned length N, then N bytes of UTF-8 JSON holding one object with a
"type" field. N is capped (MAX_MESSAGE_BYTES) on both encode and decode, before anything is allocated.
``parse`` turns a decoded object into one of the message classes below or raises ``BadMessage``
(a ``ProtocolError``): a field of the wrong type or out of range never reaches the state machines.
On an authenticated connection every frame after the handshake also carries ``seq`` and ``mac``
(protocol/auth.py); they are stripped before ``parse``.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from expresslane.engine.protocol.errors import (
    BadMessage,
    ConnectionClosed,
    LayoutMismatch,
    MagicMismatch,
    MessageTooLarge,
    ModelMismatch,
    ProtocolError,
    VersionMismatch,
)
from expresslane.engine.protocol.layout import KVLayoutSpec

MAGIC = "expresslane-kv"
PROTOCOL_VERSION = 2
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_RID_CHARS = 256
_HEADER = struct.Struct(">I")

# Reject reasons. Retryable ones are retried by the sender with bounded, jittered backoff.
REJECT_BUSY = "busy"                # the expected rid's slot is still fencing an abandoned write
REJECT_UNKNOWN = "unknown_rid"      # no reservation for this rid (never expected, or already finished)
REJECT_EXPIRED = "expired"          # the reservation's ttl passed
REJECT_CANCELLED = "cancelled"      # this rid was cancelled on the decode node
REJECT_FAILED = "failed"            # this rid's transfer already failed
REJECT_TOO_LONG = "too_long"        # num_tokens > the node's max_seq_len
REJECT_INCOMPATIBLE = "incompatible"  # protocol/layout/model mismatch found at admit time
REJECT_DUPLICATE = "duplicate"      # this (rid, rank) was already admitted
REJECT_BAD_REQUEST = "bad_request"  # admit fields inconsistent (nbytes, heads, ...)
RETRYABLE_REJECTS = frozenset({REJECT_BUSY})


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise BadMessage(what)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _rid(v: Any) -> str:
    _check(isinstance(v, str) and 0 < len(v) <= MAX_RID_CHARS, f"rid must be a non-empty string <= "
           f"{MAX_RID_CHARS} chars, got {str(v)[:40]!r}")
    return v


def _nonneg(name: str, v: Any, upper: int = 1 << 62) -> int:
    _check(_is_int(v) and 0 <= v <= upper, f"{name} must be an integer in [0, {upper}], got {str(v)[:40]!r}")
    return v


def _text(name: str, v: Any, limit: int = 4096) -> str:
    _check(isinstance(v, str) and len(v) <= limit, f"{name} must be a string <= {limit} chars")
    return v


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, **asdict(self)}

    def validate(self) -> None:  # overridden; raises BadMessage
        pass


@dataclass(frozen=True)
class Challenge(Message):
    """decode -> prefill, first frame: nothing about the node before the peer authenticated."""

    TYPE: ClassVar[str] = "challenge"
    magic: str
    protocol_version: int
    auth: str       # "hmac-sha256" | "none"
    nonce: str      # hex, fresh per connection

    def validate(self) -> None:
        _text("magic", self.magic, 64)
        _check(_is_int(self.protocol_version), "protocol_version must be an integer")
        _check(self.auth in ("hmac-sha256", "none"), f"unknown auth {str(self.auth)[:20]!r}")
        _text("nonce", self.nonce, 128)


@dataclass(frozen=True)
class Auth(Message):
    """prefill -> decode: the prefill's nonce and its proof of the secret over both nonces."""

    TYPE: ClassVar[str] = "auth"
    nonce: str
    proof: str

    def validate(self) -> None:
        _text("nonce", self.nonce, 128)
        _text("proof", self.proof, 128)


@dataclass(frozen=True)
class AuthOk(Message):
    """decode -> prefill: the node's proof of the secret (mutual authentication)."""

    TYPE: ClassVar[str] = "auth_ok"
    proof: str

    def validate(self) -> None:
        _text("proof", self.proof, 128)


@dataclass(frozen=True)
class Hello(Message):
    TYPE: ClassVar[str] = "hello"
    magic: str
    protocol_version: int
    layout_hash: str
    layout: dict
    transport: dict
    busy: bool
    node_id: str
    model_fingerprint: str = ""

    def validate(self) -> None:
        _check(isinstance(self.layout, dict) and isinstance(self.transport, dict), "layout/transport: objects")
        _check(isinstance(self.busy, bool), "busy must be a boolean")
        _text("node_id", self.node_id, 256)
        _text("model_fingerprint", self.model_fingerprint, 128)


@dataclass(frozen=True)
class Admit(Message):
    TYPE: ClassVar[str] = "admit"
    magic: str
    protocol_version: int
    layout_hash: str
    layout: dict
    rid: str
    rank: int
    world_size: int
    head_start: int
    num_heads: int
    num_tokens: int
    nbytes: int
    model_fingerprint: str = ""

    def validate(self) -> None:
        _rid(self.rid)
        _check(isinstance(self.layout, dict), "layout must be an object")
        _nonneg("rank", self.rank, 4096)
        _check(_is_int(self.world_size) and 1 <= self.world_size <= 4096, "world_size must be in [1, 4096]")
        _check(self.rank < self.world_size, "rank must be < world_size")
        _nonneg("head_start", self.head_start, 1 << 20)
        _check(_is_int(self.num_heads) and self.num_heads >= 1, "num_heads must be >= 1")
        _check(_is_int(self.num_tokens) and self.num_tokens >= 1, "num_tokens must be >= 1")
        _nonneg("nbytes", self.nbytes)
        _text("model_fingerprint", self.model_fingerprint, 128)


@dataclass(frozen=True)
class Accept(Message):
    TYPE: ClassVar[str] = "accept"
    rid: str
    rank: int
    generation: int
    dest_offset: int
    nbytes: int
    notif: str

    def validate(self) -> None:
        _rid(self.rid)
        for name in ("rank", "generation", "dest_offset", "nbytes"):
            _nonneg(name, getattr(self, name))
        _text("notif", self.notif, 512)


@dataclass(frozen=True)
class Reject(Message):
    TYPE: ClassVar[str] = "reject"
    rid: str
    reason: str
    retryable: bool = False
    detail: str = ""

    def validate(self) -> None:
        _text("rid", self.rid, MAX_RID_CHARS + 8)
        _text("reason", self.reason, 64)
        _check(isinstance(self.retryable, bool), "retryable must be a boolean")
        _text("detail", self.detail, 8192)


@dataclass(frozen=True)
class Done(Message):
    """prefill -> decode after the WRITE completed: byte count and checksum of the staged bytes."""

    TYPE: ClassVar[str] = "done"
    rid: str
    rank: int
    generation: int
    nbytes: int
    checksum: str = ""    # "crc32:<8 hex>" of the nbytes written, "" = not computed
    timings: dict = field(default_factory=dict)

    def validate(self) -> None:
        _rid(self.rid)
        for name in ("rank", "generation", "nbytes"):
            _nonneg(name, getattr(self, name))
        _text("checksum", self.checksum, 64)
        _check(isinstance(self.timings, dict) and len(self.timings) <= 16, "timings must be a small object")


@dataclass(frozen=True)
class Ack(Message):
    TYPE: ClassVar[str] = "ack"
    rid: str
    generation: int
    ok: bool
    error: str = ""

    def validate(self) -> None:
        _rid(self.rid)
        _nonneg("generation", self.generation)
        _check(isinstance(self.ok, bool), "ok must be a boolean")
        _text("error", self.error, 256)


@dataclass(frozen=True)
class Abort(Message):
    """prefill -> decode: the sender gave up on rid; the node's waiter fails at once with the reason.

    ``write_final`` is true when no WRITE of this connection into the node can still land (never posted,
    or its NIXL handle reached a final state): the node may then reuse the slot at once."""

    TYPE: ClassVar[str] = "abort"
    rid: str
    reason: str
    detail: str = ""
    write_final: bool = True

    def validate(self) -> None:
        _rid(self.rid)
        _text("reason", self.reason, 64)
        _text("detail", self.detail, 8192)
        _check(isinstance(self.write_final, bool), "write_final must be a boolean")


@dataclass(frozen=True)
class Error(Message):
    TYPE: ClassVar[str] = "error"
    code: str
    detail: str = ""

    def validate(self) -> None:
        _text("code", self.code, 64)
        _text("detail", self.detail, 8192)


MESSAGE_CLASSES: dict[str, type[Message]] = {c.TYPE: c for c in (
    Challenge, Auth, AuthOk, Hello, Admit, Accept, Reject, Done, Ack, Abort, Error)}
MESSAGE_TYPES = frozenset(MESSAGE_CLASSES)


def parse(obj: dict[str, Any]) -> Message:
    """A decoded frame object -> its typed message. Raises BadMessage (unknown type, missing/odd fields)."""
    cls = MESSAGE_CLASSES.get(obj.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise BadMessage(f"unknown message type {str(obj.get('type'))[:40]!r}")
    names = {f.name for f in fields(cls)}
    try:
        msg = cls(**{k: v for k, v in obj.items() if k in names})
    except TypeError as e:
        raise BadMessage(f"{cls.TYPE}: {e}") from None
    msg.validate()
    return msg


# ---------------------------------------------------------------------------------------------------
# Framing


def encode_body(obj: dict[str, Any], max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    body = json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
    if len(body) > max_bytes:
        raise MessageTooLarge(f"{obj.get('type')} message is {len(body)} bytes, cap is {max_bytes}")
    return body


def frame(body: bytes) -> bytes:
    return _HEADER.pack(len(body)) + body


def encode(msg: Message | dict[str, Any], max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    obj = msg.to_wire() if isinstance(msg, Message) else msg
    if obj.get("type") not in MESSAGE_TYPES:
        raise ProtocolError(f"unknown message type {obj.get('type')!r}")
    return frame(encode_body(obj, max_bytes))


def frame_length(header: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> int:
    (n,) = _HEADER.unpack(header)
    if n > max_bytes:
        raise MessageTooLarge(
            f"peer announced a {n}-byte control frame, cap is {max_bytes}: not an expresslane peer, "
            "or a corrupted stream"
        )
    return n


HEADER_BYTES = _HEADER.size


def decode_object(body: bytes) -> dict[str, Any]:
    """Frame body -> JSON object with a string "type" (not yet validated as a message)."""
    try:
        obj = json.loads(body.decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ProtocolError(f"control frame is not UTF-8 JSON: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"control frame must be a JSON object, got {type(obj).__name__}")
    if obj.get("type") not in MESSAGE_TYPES:
        raise ProtocolError(f"unknown message type {str(obj.get('type'))[:40]!r}")
    return obj


def decode_frame(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """One whole frame (header + body) -> typed message. Raises ProtocolError subclasses only."""
    if len(data) < HEADER_BYTES:
        raise ConnectionClosed(f"frame shorter than its {HEADER_BYTES}-byte header")
    n = frame_length(data[:HEADER_BYTES], max_bytes)
    if len(data) - HEADER_BYTES != n:
        raise ProtocolError(f"frame announces {n} bytes, carries {len(data) - HEADER_BYTES}")
    obj = decode_object(data[HEADER_BYTES:])
    obj.pop("seq", None)
    obj.pop("mac", None)
    return parse(obj)


def recv_exact(sock: socket.socket, n: int, *, at_boundary: bool) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            if at_boundary and not buf:
                raise ConnectionClosed("peer closed the control connection")
            raise ConnectionClosed(f"peer closed the control connection mid-frame ({len(buf)}/{n} bytes)")
        buf += chunk
    return bytes(buf)


def recv_body(sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """Read one frame's body. Socket timeouts propagate as ``socket.timeout`` (TimeoutError)."""
    n = frame_length(recv_exact(sock, HEADER_BYTES, at_boundary=True), max_bytes)
    return recv_exact(sock, n, at_boundary=False)


def send_msg(sock: socket.socket, msg: Message | dict[str, Any], max_bytes: int = MAX_MESSAGE_BYTES) -> None:
    sock.sendall(encode(msg, max_bytes))


def recv_msg(sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    obj = decode_object(recv_body(sock, max_bytes))
    obj.pop("seq", None)
    obj.pop("mac", None)
    return parse(obj)


def expect(msg: Message, *types: type[Message]) -> Message:
    if isinstance(msg, Error):
        raise ProtocolError(f"peer reported an error: {msg.code}: {msg.detail}")
    if not isinstance(msg, types):
        raise ProtocolError(f"expected {'/'.join(t.TYPE for t in types)}, got {msg.TYPE}")
    return msg


# ---------------------------------------------------------------------------------------------------
# Builders


def hello(layout: KVLayoutSpec, transport: dict[str, Any], busy: bool, node_id: str,
          model_fingerprint: str = "") -> Hello:
    return Hello(magic=MAGIC, protocol_version=PROTOCOL_VERSION, layout_hash=layout.compat_hash(),
                 layout=layout.to_wire(), transport=transport, busy=bool(busy), node_id=node_id,
                 model_fingerprint=model_fingerprint)


def admit(*, rid: str, rank: int, world_size: int, head_start: int, num_heads: int, num_tokens: int,
          nbytes: int, layout: KVLayoutSpec, model_fingerprint: str = "") -> Admit:
    return Admit(magic=MAGIC, protocol_version=PROTOCOL_VERSION, layout_hash=layout.compat_hash(),
                 layout=layout.to_wire(), rid=rid, rank=rank, world_size=world_size, head_start=head_start,
                 num_heads=num_heads, num_tokens=num_tokens, nbytes=nbytes, model_fingerprint=model_fingerprint)


def reject(*, rid: str, reason: str, detail: str = "") -> Reject:
    return Reject(rid=rid, reason=reason, retryable=reason in RETRYABLE_REJECTS, detail=detail)


# ---------------------------------------------------------------------------------------------------
# Compatibility checks: magic, then protocol version, then layout hash, then model, before anything else.


def check_magic_version(magic: Any, version: Any, *, peer: str) -> None:
    if magic != MAGIC:
        raise MagicMismatch(
            f"{peer} sent magic {str(magic)[:40]!r}, expected {MAGIC!r}: the address is not an expresslane "
            "KV control port. Check expresslane_host/expresslane_ctrl_port in kv_transfer_params (router "
            "config) and that the decode node's --ctrl-port matches; a TileRT node uses tilert_* keys instead."
        )
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"{peer} speaks expresslane KV protocol version {str(version)[:20]}, this side speaks "
            f"{PROTOCOL_VERSION}: the prefill and decode images were built from different expresslane "
            "releases. Deploy the same expresslane-engine version on the prefill (connector) and the decode node."
        )


def check_compat(msg: Hello | Admit, local: KVLayoutSpec, *, peer: str,
                 local_fingerprint: str = "") -> KVLayoutSpec:
    """Validate magic, protocol version, layout hash and model fingerprint of a hello/admit."""
    check_magic_version(msg.magic, msg.protocol_version, peer=peer)
    try:
        remote = KVLayoutSpec.from_wire(msg.layout)
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"{peer} sent an unreadable layout: {e}") from e
    if msg.layout_hash != local.compat_hash() or remote.compat_hash() != local.compat_hash():
        diffs = [
            f"{name}: {peer}={getattr(remote, name)} local={getattr(local, name)}"
            for name in ("num_layers", "num_kv_heads", "head_dim", "dtype", "wire_layout")
            if getattr(remote, name) != getattr(local, name)
        ]
        raise LayoutMismatch(
            f"KV layout compatibility hash mismatch with {peer} ({str(msg.layout_hash)[:32]} != "
            f"{local.compat_hash()}); differing: {'; '.join(diffs) or 'hash only (corrupted peer?)'}. "
            "Likely causes: the prefill and decode nodes load different models or checkpoints, a different "
            "--dtype / --kv-cache-dtype (the wire carries the prefill's KV cache dtype), or a different "
            "expresslane wire layout. Fix: serve the same model with the same dtype on both, e.g. the "
            "decode node's --dtype must equal the prefill's KV cache dtype."
        )
    remote_fp = msg.model_fingerprint
    if remote_fp and local_fingerprint and remote_fp != local_fingerprint:
        raise ModelMismatch(
            f"model fingerprint mismatch: {peer}={remote_fp} local={local_fingerprint}. The two ends load "
            "different checkpoints (architecture, shapes, RoPE config, config.json, tokenizer or weights "
            "differ) even though the KV shapes agree. Fix: point the prefill (vLLM --model) and the decode "
            "node (--model-dir) at copies of the same checkpoint directory."
        )
    return remote
