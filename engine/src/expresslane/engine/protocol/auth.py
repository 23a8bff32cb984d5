"""Control-plane peer authentication: shared-secret challenge-response, then a MAC on every frame.

Handshake (before the node says anything about itself):

1. decode -> prefill ``challenge{magic, protocol_version, auth, nonce_d}`` (32 fresh random bytes);
2. prefill -> decode ``auth{nonce_p, proof = HMAC(secret, "expresslane-auth-prefill" | nonce_d | nonce_p)}``;
3. decode -> prefill ``auth_ok{proof = HMAC(secret, "expresslane-auth-decode" | nonce_p | nonce_d)}``.

Both ends then derive ``key = HMAC(secret, "expresslane-session" | nonce_d | nonce_p)`` and every later
frame carries ``seq`` (0, 1, 2, ... per direction) and ``mac = HMAC(key, direction | canonical JSON of
the frame without mac)``. A frame replayed from another connection fails (other nonces, other key), one
replayed or reordered within a connection fails (seq), an injected or altered one fails (mac). With no
secret on either side the handshake is ``auth: "none"`` and frames carry no MAC; a side WITH a secret
refuses a peer without one (a rogue node cannot harvest KV by claiming to be open).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets as _random
from dataclasses import dataclass
from typing import Any

from expresslane.engine.protocol.errors import AuthError

AUTH_HMAC = "hmac-sha256"
AUTH_NONE = "none"
NONCE_BYTES = 32

TO_PREFILL = b"d2p"  # frames the decode node sends
TO_DECODE = b"p2d"   # frames the prefill sends


def new_nonce() -> str:
    return _random.token_hex(NONCE_BYTES)


def _mac(key: bytes, *parts: str | bytes) -> str:
    msg = b"|".join(p.encode() if isinstance(p, str) else p for p in parts)
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def prefill_proof(secret: bytes, nonce_d: str, nonce_p: str) -> str:
    return _mac(secret, b"expresslane-auth-prefill", nonce_d, nonce_p)


def decode_proof(secret: bytes, nonce_d: str, nonce_p: str) -> str:
    return _mac(secret, b"expresslane-auth-decode", nonce_p, nonce_d)


def verify(expected: str, got: str) -> bool:
    return hmac.compare_digest(expected.encode(), got.encode() if isinstance(got, str) else b"")


def check_nonce(nonce: Any) -> str:
    if not isinstance(nonce, str) or len(nonce) != 2 * NONCE_BYTES:
        raise AuthError("peer nonce must be 64 hex characters")
    try:
        bytes.fromhex(nonce)
    except ValueError:
        raise AuthError("peer nonce is not hex") from None
    return nonce


@dataclass
class Session:
    """Per-connection frame sealing. ``key=None``: unauthenticated (open) mode, frames pass as they are."""

    key: bytes | None
    send_dir: bytes
    recv_dir: bytes
    send_seq: int = 0
    recv_seq: int = 0

    @classmethod
    def derive(cls, secret: bytes, nonce_d: str, nonce_p: str, *, side: str) -> "Session":
        key = hmac.new(secret, b"|".join([b"expresslane-session", nonce_d.encode(), nonce_p.encode()]),
                       hashlib.sha256).digest()
        if side == "decode":
            return cls(key, TO_PREFILL, TO_DECODE)
        return cls(key, TO_DECODE, TO_PREFILL)

    @classmethod
    def open(cls, *, side: str) -> "Session":
        return cls(None, TO_PREFILL if side == "decode" else TO_DECODE,
                   TO_DECODE if side == "decode" else TO_PREFILL)

    @property
    def authenticated(self) -> bool:
        return self.key is not None

    def seal(self, obj: dict[str, Any]) -> dict[str, Any]:
        if self.key is None:
            return obj
        sealed = {**obj, "seq": self.send_seq}
        sealed["mac"] = _mac(self.key, self.send_dir, _canonical(sealed))
        self.send_seq += 1
        return sealed

    def unseal(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Check seq and mac of a received frame object; returns it without them. Raises AuthError."""
        if self.key is None:
            obj.pop("seq", None)
            obj.pop("mac", None)
            return obj
        mac = obj.pop("mac", None)
        if not isinstance(mac, str):
            raise AuthError("frame without MAC on an authenticated connection")
        if not verify(_mac(self.key, self.recv_dir, _canonical(obj)), mac):
            raise AuthError("frame MAC does not verify (injected, altered or replayed from another connection)")
        seq = obj.pop("seq", None)
        if seq != self.recv_seq:
            raise AuthError(f"frame sequence {str(seq)[:20]} where {self.recv_seq} was due (replayed or reordered)")
        self.recv_seq += 1
        return obj


def _canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
