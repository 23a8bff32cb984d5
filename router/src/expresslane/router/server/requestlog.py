"""Request ids and access logs.

- `RequestIdMiddleware` (ASGI): each HTTP request gets an internal id, unique per request: the client's
  `X-Request-Id` (when it is a sane token: 1-128 characters of `A-Za-z0-9._:-`) followed by `-` and 16 random hex
  digits, else a fresh uuid4 hex. Two clients that send the same `X-Request-Id` never share an internal id (vLLM
  names its request after it, and a `kind: tilert` node its rid). The internal id is put on every upstream call
  made while serving the request (`upstream_request_id_hook`, an httpx request hook, and the one-shot client: the
  prefill leg and the decode leg of both lanes) and attached to every log record (`RequestIdFilter`: `request_id`,
  and the client's own as `client_request_id`). The reply's `X-Request-Id` is the client's own when it sent a sane
  one, else the internal id. With `access_log=True`, one access line per request (method, path, status, lane,
  duration, client, both ids; never headers or bodies).
- `JsonFormatter`: one JSON object per log line (`--log-format json`).
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
import uuid

import httpx
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["JsonFormatter", "RequestIdFilter", "RequestIdMiddleware", "bind_request_id", "client_request_id_of",
           "current_request_id", "internal_request_id", "log_access", "request_id_of", "reply_start",
           "unbind_request_id", "upstream_request_id_hook"]

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("expresslane_request_id", default=None)
_client_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("expresslane_client_request_id",
                                                                               default=None)
_SANE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
access_log = logging.getLogger("expresslane.router.access")


def current_request_id() -> str | None:
    return _request_id.get()


def bind_request_id(rid: str) -> contextvars.Token:
    """Make `rid` the current request's id (logs, upstream calls); `unbind_request_id(token)` when it ends."""
    return _request_id.set(rid)


def unbind_request_id(token: contextvars.Token) -> None:
    _request_id.reset(token)


async def upstream_request_id_hook(request: httpx.Request) -> None:
    rid = _request_id.get()
    if rid is not None:
        request.headers["X-Request-Id"] = rid


def client_request_id_of(scope: Scope) -> str | None:
    """The client's `X-Request-Id` (the first one) when it is a sane token, else None."""
    for k, v in scope.get("headers") or ():
        if k == b"x-request-id":
            given = v.decode("latin-1")
            return given if _SANE.fullmatch(given) else None
    return None


def internal_request_id(client_rid: str | None) -> str:
    """The request's internal id: the client's id with 16 random hex digits after it, else a uuid4 hex."""
    return f"{client_rid}-{uuid.uuid4().hex[:16]}" if client_rid else uuid.uuid4().hex


def request_id_of(scope: Scope) -> str:
    """A new internal id for the request `scope` (internal_request_id of the client's id)."""
    return internal_request_id(client_request_id_of(scope))


def reply_start(message: Message, rid: bytes) -> tuple[Message, str]:
    """An `http.response.start` message with `X-Request-Id: rid` as its only request id (appended last), and the
    lane its `X-Expresslane-Lane` names ("" when none)."""
    lane = ""
    headers = []
    for k, v in message.get("headers", []):
        lk = k.lower()
        if lk == b"x-request-id":
            continue
        if lk == b"x-expresslane-lane":
            lane = v.decode("latin-1")
        headers.append((k, v))
    headers.append((b"x-request-id", rid))
    return {**message, "headers": headers}, lane


def log_access(scope: Scope, status: int, lane: str, started: float) -> None:
    """The access line of one request (never headers or bodies); status 0 (no reply sent) is logged as 499."""
    client = scope.get("client")
    access_log.info("%s %s %d lane=%s %.1fms client=%s client_request_id=%s", scope.get("method"), scope.get("path"),
                    status or 499, lane or "-", (time.monotonic() - started) * 1000,
                    client[0] if client else "-", _client_request_id.get() or "-")


class RequestTrace:
    """One HTTP request's id, bound for its logs, and what its reply said: `wrap(send)` adds `X-Request-Id` to
    the reply's start and notes its status and lane; `finish` writes the access line (if on) and unbinds the id.
    Shared by RequestIdMiddleware and the completion routes' fast path (fastpath.py)."""

    __slots__ = ("rid", "client_rid", "_rid_bytes", "_token", "_client_token", "started", "status", "lane")

    def __init__(self, scope: Scope) -> None:
        self.client_rid = client_request_id_of(scope)
        self.rid = internal_request_id(self.client_rid)
        self._rid_bytes = (self.client_rid or self.rid).encode()  # the reply names the client's own id
        self._token = bind_request_id(self.rid)
        self._client_token = _client_request_id.set(self.client_rid)
        self.started = time.monotonic()
        self.status, self.lane = 0, ""

    def wrap(self, send: Send) -> Send:
        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
                message, self.lane = reply_start(message, self._rid_bytes)
            await send(message)
        return send_with_id

    def finish(self, scope: Scope, access_log: bool) -> None:
        if access_log:
            log_access(scope, self.status, self.lane, self.started)
        _client_request_id.reset(self._client_token)
        unbind_request_id(self._token)


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp, *, access_log: bool = False) -> None:
        self.app = app
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        trace = RequestTrace(scope)
        try:
            await self.app(scope, receive, trace.wrap(send))
        finally:
            trace.finish(scope, self.access_log)


class RequestIdFilter(logging.Filter):
    """Adds `request_id` and `client_request_id` (or "-") to every record, for formats that show them."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _request_id.get() or "-"
        record.client_request_id = _client_request_id.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    converter = time.gmtime

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        rid = getattr(record, "request_id", None) or _request_id.get()
        if rid and rid != "-":
            out["request_id"] = rid
        crid = getattr(record, "client_request_id", None) or _client_request_id.get()
        if crid and crid != "-":
            out["client_request_id"] = crid
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)
