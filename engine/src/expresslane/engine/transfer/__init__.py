"""expresslane KV data plane: NIXL one-sided WRITEs driven by the control plane (docs/protocol.md).

Decode side: ``KVReceiver`` / ``ReceivedKV``. Prefill side: ``KVSender`` (used by the connector).
"""

from expresslane.engine.transfer.errors import (
    KVCancelled,
    KVReceiveError,
    KVRefused,
    KVTimeout,
    KVTransferFailed,
    SendError,
)
from expresslane.engine.transfer.receiver import KVReceiver, ReceivedKV

__all__ = [
    "KVCancelled",
    "KVReceiveError",
    "KVReceiver",
    "KVRefused",
    "KVTimeout",
    "KVTransferFailed",
    "ReceivedKV",
    "SendError",
]
