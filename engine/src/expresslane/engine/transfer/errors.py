"""Data-plane errors, shared by the sender (prefill) and the receiver (decode node)."""

from __future__ import annotations


class KVReceiveError(Exception):
    """Base of what KVReceiver.expect / wait_for raise."""


class KVTimeout(KVReceiveError):
    """The KV for a rid did not arrive within the timeout (the decode server maps it to 504)."""


class KVCancelled(KVReceiveError):
    """The rid was cancelled (KVReceiver.cancel) before or while its KV arrived (499)."""


class KVRefused(KVReceiveError):
    """expect(rid) cannot hold a receive slot for the rid (all slots held, or the rid was cancelled).
    ``reason``: ``no_slot`` | ``cancelled``."""

    def __init__(self, message: str, reason: str = "no_slot") -> None:
        super().__init__(message)
        self.reason = reason


class KVTransferFailed(KVReceiveError):
    """The transfer for the rid is known failed. ``reason``: ``aborted:<prefill reason>``,
    ``sender_vanished``, ``checksum_mismatch``, ``checksum_missing``, ``no_notification``, ``bad_nbytes``,
    ``expired``, ``stopped``."""

    def __init__(self, message: str, reason: str = "failed") -> None:
        super().__init__(message)
        self.reason = reason


class SendError(Exception):
    """A send failed. ``reason`` is the metric label (expresslane_connector_send_failures_total)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
