"""Request ids and access logs.

- `RequestIdMiddleware` (ASGI): each HTTP request gets an id: the client's `X-Request-Id` when it is a sane token
  (1-128 characters of `A-Za-z0-9._:-`), else a fresh uuid4 hex. The id is returned in the reply's
  `X-Request-Id`, put on every upstream call made while serving the request (`upstream_request_id_hook`, an httpx
  request hook: the prefill leg and the decode leg of both lanes), attached to every log record
  (`RequestIdFilter`), and, with `access_log=True`, written in one access line per request
  (method, path, status, lane, duration, client, request id; never headers or bodies).
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

__all__ = ["JsonFormatter", "RequestIdFilter", "RequestIdMiddleware", "current_request_id",
           "upstream_request_id_hook"]

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("expresslane_request_id", default=None)
_SANE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
access_log = logging.getLogger("expresslane.router.access")


def current_request_id() -> str | None:
    return _request_id.get()


async def upstream_request_id_hook(request: httpx.Request) -> None:
    rid = _request_id.get()
    if rid is not None:
        request.headers["X-Request-Id"] = rid


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp, *, access_log: bool = False) -> None:
        self.app = app
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = None
        for k, v in scope.get("headers") or ():
            if k == b"x-request-id":
                given = v.decode("latin-1")
                break
        rid = given if given is not None and _SANE.fullmatch(given) else uuid.uuid4().hex
        token = _request_id.set(rid)
        started = time.monotonic()
        status, lane = 0, ""

        async def send_with_id(message: Message) -> None:
            nonlocal status, lane
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                for k, v in headers:
                    if k.lower() == b"x-expresslane-lane":
                        lane = v.decode("latin-1")
                message = {**message, "headers": headers + [(b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.access_log:
                client = scope.get("client")
                access_log.info("%s %s %d lane=%s %.1fms client=%s", scope.get("method"), scope.get("path"),
                                status or 499, lane or "-", (time.monotonic() - started) * 1000,
                                client[0] if client else "-")
            _request_id.reset(token)


class RequestIdFilter(logging.Filter):
    """Adds `request_id` (or "-") to every record, for formats that show it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _request_id.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    converter = time.gmtime

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        rid = getattr(record, "request_id", None) or _request_id.get()
        if rid and rid != "-":
            out["request_id"] = rid
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)
