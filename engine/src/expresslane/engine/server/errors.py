"""The decode server's exception hierarchy, drawn once: each class is one HTTP status and one body.

    DecodeServerError (500 internal_error)
    +-- BadRequest (400 bad_request)
    |   +-- InvalidParameter (400 invalid_parameter)  e.g. a structured_outputs spec that does not compile
    +-- Unauthorized (401 unauthorized)     missing / wrong bearer token (EXPRESS_NODE_TOKEN)
    +-- Busy (429 busy, Retry-After)        every seat is held (or the rid is already being served)
    +-- NotReserved (409 not_reserved)      /pd/decode of a rid without a live /pd/reserve
    +-- NotReady (503 not_ready)            engine / control plane / NIXL agent unhealthy, or draining
    +-- Cancelled (499 cancelled)           /pd/cancel or client gone, before or during decode
    +-- Unsupported (501 unsupported)       e.g. structured_outputs on a node without the model's tokenizer
    +-- KVTransferTimeout (504 kv_transfer_timeout)
    +-- KVTransferFailed (502 kv_transfer_failed)  the prefill side aborted / vanished / bad checksum: at once
    +-- DecodeStalled (504 decode_stalled)  no token for stall_timeout_s (error_type "stall" mid-stream)
    +-- DeadlineExceeded (504 deadline_exceeded)  the request ran past request_deadline_s ("deadline")

Body: ``{"error": <code>, "message": <detail>}`` (TileRT's decode node answers ``{"error": "busy"}`` etc.), plus
``reason`` for kv_transfer_failed and ``detail`` for not_ready. After a streaming 200 the same failure is one NDJSON
line ``{"error": <stream_error>, "error_type": <error_type>}``.
"""

from __future__ import annotations


class DecodeServerError(Exception):
    status = 500
    code = "internal_error"
    error_type = "internal"  # the NDJSON error_type when this ends a stream after its 200
    stream_error: str | None = None  # the NDJSON "error" text (None: the message)

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.code)
        self.message = message or self.code

    def body(self) -> dict[str, str]:
        return {"error": self.code, "message": self.message}

    def stream_line(self) -> dict[str, str]:
        return {"error": self.stream_error or self.message, "error_type": self.error_type}


class BadRequest(DecodeServerError):
    status, code = 400, "bad_request"


class InvalidParameter(BadRequest):
    """Body ``{"error": "invalid_parameter", "message": <detail>, "detail": <detail>}``."""

    code = "invalid_parameter"

    def body(self) -> dict[str, str]:
        return {**super().body(), "detail": self.message}


class Unauthorized(DecodeServerError):
    status, code = 401, "unauthorized"


class Busy(DecodeServerError):
    status, code = 429, "busy"


class NotReserved(DecodeServerError):
    status, code = 409, "not_reserved"


class NotReady(DecodeServerError):
    """Body ``{"error": "not_ready", "detail": {check: why}, "message": ...}``."""

    status, code = 503, "not_ready"

    def __init__(self, detail: dict[str, str]) -> None:
        failing = ", ".join(f"{k}: {v}" for k, v in detail.items() if v != "ok") or "draining"
        super().__init__(f"node not ready ({failing})")
        self.detail = detail

    def body(self) -> dict:
        return {**super().body(), "detail": self.detail}


class Cancelled(DecodeServerError):
    status, code = 499, "cancelled"
    error_type = "cancelled"


class Unsupported(DecodeServerError):
    status, code = 501, "unsupported"


class KVTransferTimeout(DecodeServerError):
    status, code = 504, "kv_transfer_timeout"


class KVTransferFailed(DecodeServerError):
    status, code = 502, "kv_transfer_failed"
    error_type = "kv_transfer_failed"

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message or f"the KV transfer failed: {reason}")
        self.reason = reason

    def body(self) -> dict:
        return {"error": self.code, "reason": self.reason, "message": self.message, "detail": self.message}


class DecodeStalled(DecodeServerError):
    status, code = 504, "decode_stalled"
    stream_error, error_type = "decode stalled", "stall"


class DeadlineExceeded(DecodeServerError):
    status, code = 504, "deadline_exceeded"
    stream_error, error_type = "deadline exceeded", "deadline"
