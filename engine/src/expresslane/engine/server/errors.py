"""The decode server's exception hierarchy, drawn once: each class is one HTTP status and one body.

    DecodeServerError (500 internal_error)
    +-- BadRequest (400 bad_request)
    +-- Busy (429 busy)                     another request is in flight (ONE request per node)
    +-- Cancelled (499 cancelled)           /pd/cancel or client gone, before or during decode
    +-- Unsupported (501 unsupported)       e.g. top_logprobs
    +-- KVTransferTimeout (504 kv_transfer_timeout)
    +-- KVTransferFailed (500 kv_transfer_failed)

Body: ``{"error": <code>, "message": <detail>}`` (TileRT's decode node answers ``{"error": "busy"}`` etc.).
"""

from __future__ import annotations


class DecodeServerError(Exception):
    status = 500
    code = "internal_error"

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.code)
        self.message = message or self.code

    def body(self) -> dict[str, str]:
        return {"error": self.code, "message": self.message}


class BadRequest(DecodeServerError):
    status, code = 400, "bad_request"


class Busy(DecodeServerError):
    status, code = 429, "busy"


class Cancelled(DecodeServerError):
    status, code = 499, "cancelled"


class Unsupported(DecodeServerError):
    status, code = 501, "unsupported"


class KVTransferTimeout(DecodeServerError):
    status, code = 504, "kv_transfer_timeout"


class KVTransferFailed(DecodeServerError):
    status, code = 500, "kv_transfer_failed"
