"""The router's exception hierarchy, drawn once: each class is one HTTP status and one OpenAI-style body.

    RouterError (500 internal_error)
    +-- BadRequest (400 invalid_request_error)
    |   +-- UnsupportedFeature (400 unsupported_feature: the lane cannot honour a request field)
    |   +-- VllmValidation (400 BadRequestError: a vLLM limit checked by the router, in vLLM's words)
    +-- Unauthorized (401 authentication_error)
    +-- PermissionDenied (403 permission_error: the API key may not use that lane)
    +-- NotFound (404 invalid_request_error / not_found: no such path)
    |   +-- ModelNotFound (404 invalid_request_error / model_not_found)
    +-- MethodNotAllowed (405 invalid_request_error / method_not_allowed, with Allow)
    +-- PayloadTooLarge (413 invalid_request_error / request_too_large)
    +-- LaneBusy (429 rate_limit_error / express_lane_busy, with Retry-After)
    +-- RateLimited (429 rate_limit_error / rate_limit_exceeded: the API key's rps, with Retry-After)
    +-- UpstreamRejected (the upstream's own 4xx, relayed byte for byte)
    +-- UpstreamError (502 upstream_error: the upstream answered, but not usefully)
    |   +-- UpstreamUnavailable (503 service_unavailable: connect refused, upstream 503)
    |   |   +-- RouterSaturated (503 router_saturated: the router's own connection pool is full; not the node's fault)
    |   +-- UpstreamTimeout (504 timeout: no answer in time, KV never reached the node)
    +-- ClientGone (the client disconnected; nothing is sent)

Body: `{"error": {"message", "type", "param", "code"}}` like OpenAI and vLLM. A message a client sees names no
internal address: URLs, `host:port` pairs and IP addresses in it (the router's own words or a library's exception
text) read `<upstream>` (`public_text`); the full text stays in the router's logs. An upstream's own 4xx reply
(UpstreamRejected) is relayed unchanged.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = [
    "BadRequest",
    "ClientGone",
    "LaneBusy",
    "MethodNotAllowed",
    "ModelNotFound",
    "NotFound",
    "PayloadTooLarge",
    "PermissionDenied",
    "RateLimited",
    "RouterError",
    "RouterSaturated",
    "Unauthorized",
    "UnsupportedFeature",
    "UpstreamError",
    "UpstreamRejected",
    "UpstreamTimeout",
    "UpstreamUnavailable",
    "VllmValidation",
    "error_body",
    "public_text",
]

_ADDRESS = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>()\[\]]+"  # a URL
                      r"|\[[0-9a-fA-F:.]+\](?::\d+)?"  # [IPv6]:port
                      r"|\b\d{1,3}(?:\.\d{1,3}){3}\b(?::\d+)?"  # IPv4[:port]
                      r"|(?<![\w.:/-])[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?:\d{2,5}\b")  # host:port


def public_text(text: str) -> str:
    """`text` with every internal address in it (URL, host:port, IP address) replaced by `<upstream>`."""
    return _ADDRESS.sub("<upstream>", text)


def error_body(message: str, type_: str, *, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class RouterError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: Any = None

    def __init__(self, message: str, *, param: str | None = None, code: Any = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(public_text(self.message), self.type, param=self.param, code=self.code)

    def render(self) -> tuple[int, bytes, dict[str, str]]:
        """(status, body bytes, headers) of the HTTP reply for this error."""
        return self.status, json.dumps(self.body()).encode(), {"content-type": "application/json", **self.headers}


class BadRequest(RouterError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(RouterError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class UnsupportedFeature(BadRequest):
    """The request asks for something its lane cannot do and the alias's policy is `unsupported: refuse`."""

    code = "unsupported_feature"


class PermissionDenied(RouterError):
    status = 403
    type = "permission_error"
    code = "lane_not_allowed"


class NotFound(RouterError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(RouterError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(RouterError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class LaneBusy(RouterError):
    """Every express node is busy and the queue is full or waited too long (policy `reject`)."""

    status = 429
    type = "rate_limit_error"
    code = "express_lane_busy"

    def __init__(self, message: str, *, retry_after_s: int, reason: str):
        super().__init__(message, headers={"retry-after": str(retry_after_s)})
        self.reason = reason


class RateLimited(RouterError):
    """The API key's own request rate (`rps=`) is used up."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int):
        super().__init__(message, headers={"retry-after": str(retry_after_s)})


class UpstreamRejected(RouterError):
    """vLLM (or a node) refused the request with a 4xx: the client gets that reply unchanged."""

    def __init__(self, status: int, content: bytes, content_type: str | None, *, stage: str):
        super().__init__(f"{stage} upstream answered {status}")
        self.status = status
        self.content = content
        self.content_type = content_type or "application/json"
        self.stage = stage

    def body(self) -> dict:
        try:
            parsed = json.loads(self.content)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            return parsed
        return error_body(self.content.decode("utf-8", "replace") or self.message, "invalid_request_error")

    def render(self) -> tuple[int, bytes, dict[str, str]]:
        return self.status, self.content, {"content-type": self.content_type}


class UpstreamError(RouterError):
    status = 502
    type = "upstream_error"

    def __init__(self, message: str, *, stage: str, kind: str = "bad_reply", **kw: Any):
        super().__init__(message, **kw)
        self.stage = stage  # prefill | decode | express_decode | ...
        self.kind = kind  # metric label: bad_reply | connect | timeout | http_5xx | ...


class UpstreamUnavailable(UpstreamError):
    status = 503
    type = "service_unavailable"


class RouterSaturated(UpstreamUnavailable):
    """The router's own upstream connection pool had no free connection in time: the router is overloaded, the
    node is not at fault (outlier detection never counts it)."""

    code = "router_saturated"

    def __init__(self, message: str, *, stage: str, retry_after_s: int = 1):
        super().__init__(message, stage=stage, kind="router_saturated", headers={"retry-after": str(retry_after_s)})


class UpstreamTimeout(UpstreamError):
    status = 504
    type = "timeout"


class ClientGone(RouterError):
    """The client went away; the reply is never seen (status 499 in metrics, like nginx)."""

    status = 499
    type = "client_closed_request"


class VllmValidation(BadRequest):
    """A limit the router checks itself where vLLM would (the express lane's prefill leg runs with max_tokens=1),
    in vLLM 0.32's words and body: VLLMValidationError -> 400 {"type": "BadRequestError", "param", "code": 400},
    the message suffixed with `(parameter=..., value=...)` as its __str__ writes it."""

    type = "BadRequestError"
    code = 400

    def __init__(self, message: str, *, param: str | None = None, value: Any = None):
        extras = [f"parameter={param}"] if param is not None else []
        if value is not None:
            extras.append(f"value={value}")
        super().__init__(f"{message} ({', '.join(extras)})" if extras else message, param=param)
