"""Control-plane errors. Every mismatch error names the likely cause and the fix."""

from __future__ import annotations


class ProtocolError(Exception):
    """A malformed, oversized or unexpected control-plane message."""


class MessageTooLarge(ProtocolError):
    """A frame announced (or an encoder produced) more bytes than the cap allows."""


class ConnectionClosed(ProtocolError):
    """The peer closed the control connection (cleanly between frames, or mid-frame)."""


class ProtocolMismatch(ProtocolError):
    """The two ends cannot talk: wrong peer, protocol version or KV layout. Never retried."""


class MagicMismatch(ProtocolMismatch):
    pass


class VersionMismatch(ProtocolMismatch):
    pass


class LayoutMismatch(ProtocolMismatch):
    pass


class ModelMismatch(LayoutMismatch):
    """Same KV shapes, different checkpoints (model fingerprints differ); names both sides."""


class BadMessage(ProtocolError):
    """A frame that decoded to JSON but is not a valid message (unknown type, missing or odd fields)."""


class AuthError(ProtocolError):
    """The peer failed (or refused) control-plane authentication, or a frame's MAC/sequence is wrong."""
