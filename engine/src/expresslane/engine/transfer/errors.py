"""Data-plane errors, shared by the sender (prefill) and the receiver (decode node)."""

from __future__ import annotations


class KVReceiveError(Exception):
    """Base of what KVReceiver.wait_for raises."""


class KVTimeout(KVReceiveError):
    """The KV for a rid did not arrive within the timeout (the decode server maps it to 504)."""


class KVCancelled(KVReceiveError):
    """The rid was cancelled (KVReceiver.cancel) before or while its KV arrived (499)."""


class KVTransferFailed(KVReceiveError):
    """The sender started a transfer for the rid and then failed or vanished mid-transfer."""


class SendError(Exception):
    """A send failed. ``reason`` is the metric label (expresslane_connector_send_failures_total)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
