"""The two completion routes below Starlette: `POST /v1/completions` and `POST /v1/chat/completions` answered by a
plain ASGI call, every other request (and every other method on those two paths) through the Starlette app.

Why: these two routes are the router's hot path, and on this project's small hosts the router's own CPU per request
is the number that matters (docs/bench/2026-12-02-router-fast-path/). Through Starlette a request
passes uvicorn's proxy-headers layer, then FastAPI, Starlette's error middleware, the request-id middleware,
Starlette's exception middleware, FastAPI's exit-stack middleware, the router's route matching (a regex per route)
and the route's request/response wrapper, each with its own coroutine frame and, for the reply, its own wrapped
`send`. `RouterApp` answers the two routes itself and does what those layers did for them, with the same bytes:

- the request id and the access line (requestlog.py: the same functions the middleware uses), the id bound for
  the request's logs and upstream calls, `X-Request-Id` appended to the reply's headers;
- the handler (`serve(scope, receive, kind)`, app.py) returns a Response or raises; a RouterError raised while
  the Response itself runs, before its first byte, is rendered by the same error_response as Starlette's
  exception handler; any other exception is logged and answered with the same 500 JSON that Starlette's error
  middleware sends (outside the request-id layer, so without `X-Request-Id`), then re-raised for uvicorn to
  log, as before.

The Starlette routes of the two paths stay: they answer the other methods (405 with `Allow: POST`), and with
`fast_path=False` (create_app) all of it, the old path the byte-identity tests compare with
(tests/unit/router/test_router_fastpath.py).

Measured 2026-12-04 (docs/bench/2026-12-04-one-client, confounded: see 2026-12-07): this module and http_protocol.py together save about 0.3 ms of
router CPU per non-streaming request (1.63 ms with them, 1.94 ms with Starlette's routing and stock uvicorn: +19 %,
per round +8 to +31 %; streams: no difference). Fair re-run 2026-12-07 (docs/bench/2026-12-07-one-client: the
tick removal and gc.freeze in both variants, c = 1 / 32): without them +18 % / +22 % router CPU per one-shot request,
+17 % / +9 % per streamed one, 0.6-0.9x the throughput: kept at about the 20 % bar; a run where the gain falls
clearly below it deletes them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from ..errors import RouterError, error_body
from ..openai.shapes import Kind
from .requestlog import RequestTrace

__all__ = ["FAST_ROUTES", "CompletionsFastPath", "RouterApp"]

log = logging.getLogger("expresslane.router")

FAST_ROUTES: dict[str, Kind] = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}

Handler = Callable[[Scope, Receive, Kind], Awaitable[Response]]


class CompletionsFastPath:
    """Serves one request of a fast route: request id, handler, reply, access line."""

    def __init__(self, serve: Handler, error_response: Callable[[RouterError], Response], *,
                 access_log: bool) -> None:
        self.serve = serve
        self.error_response = error_response
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send, kind: Kind) -> None:
        trace = RequestTrace(scope)
        send_with_id = trace.wrap(send)
        try:
            try:
                resp = await self.serve(scope, receive, kind)
                await resp(scope, receive, send_with_id)
            except Exception as exc:
                if trace.status:  # the reply had begun: nothing can be sent any more (Starlette re-raises too)
                    raise
                if isinstance(exc, RouterError):
                    await self.error_response(exc)(scope, receive, send_with_id)
                    return
                log.exception("unhandled error on %s", scope["path"])
                await JSONResponse(error_body("internal router error", "internal_error"),
                                   status_code=500)(scope, receive, send)
                raise
        finally:
            trace.finish(scope, self.access_log)


class RouterApp(FastAPI):
    """The router's FastAPI app, with the two completion routes answered by `fast_path` (when set) before
    Starlette's stack. Lifespan, state, the other routes and their errors are FastAPI's as ever."""

    fast_path: CompletionsFastPath | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        fast = self.fast_path
        if fast is not None and scope["type"] == "http" and scope["method"] == "POST":
            kind = FAST_ROUTES.get(scope["path"])
            if kind is not None:
                await fast(scope, receive, send, kind)
                return
        await super().__call__(scope, receive, send)
