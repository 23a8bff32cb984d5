"""expresslane KV control plane (prefill connector <-> decode node). See docs/protocol.md."""

from expresslane.engine.protocol.errors import (
    ConnectionClosed,
    LayoutMismatch,
    MagicMismatch,
    MessageTooLarge,
    ProtocolError,
    ProtocolMismatch,
    VersionMismatch,
)
from expresslane.engine.protocol.layout import WIRE_LAYOUT, KVLayoutSpec, dtype_from_name, dtype_name
from expresslane.engine.protocol.messages import (
    MAGIC,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    RETRYABLE_REJECTS,
    check_compat,
    recv_msg,
    send_msg,
)

# Keys in a request's kv_transfer_params that hand it to the express lane (set by the router).
CLAIM_HOST = "expresslane_host"
CLAIM_PORT = "expresslane_ctrl_port"
CLAIM_RID = "expresslane_rid"
CLAIM_KEYS = (CLAIM_HOST, CLAIM_PORT, CLAIM_RID)

__all__ = [
    "CLAIM_HOST",
    "CLAIM_KEYS",
    "CLAIM_PORT",
    "CLAIM_RID",
    "MAGIC",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "RETRYABLE_REJECTS",
    "WIRE_LAYOUT",
    "ConnectionClosed",
    "KVLayoutSpec",
    "LayoutMismatch",
    "MagicMismatch",
    "MessageTooLarge",
    "ProtocolError",
    "ProtocolMismatch",
    "VersionMismatch",
    "check_compat",
    "dtype_from_name",
    "dtype_name",
    "recv_msg",
    "send_msg",
]
