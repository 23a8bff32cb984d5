"""The express decode node's HTTP app: TileRT's decode-node contract (docs: /work/shared/TILERT.md).

    POST /pd/decode   {rid, first_token_id, max_tokens, sampling:{...}, stream, timeout_s}
                      -> {rid, token_ids, seq_len, finish_reason, timing_ms} or NDJSON {"t":[..]} ... {"done":..}
    POST /pd/cancel   {rid} -> {rid, cancelled}
    GET  /health, /capabilities, /decode_status, /metrics
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from prometheus_client import CollectorRegistry, make_asgi_app
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..decode import DecodeEngine, SamplingParams
from .config import ServerConfig
from .errors import BadRequest, Cancelled, DecodeServerError
from .kv_source import KVSource, ReceivedKVLike
from .metrics import DecodeMetrics
from .runner import ActiveRequest, DecodeResult, DecodeRunner
from .schemas import CancelRequest, DecodeRequest, parse_body

log = logging.getLogger(__name__)

_STATUS_LABEL = {400: "bad_request", 429: "busy", 499: "cancelled", 501: "unsupported", 504: "kv_timeout"}


class _ASGIEndpoint:
    """Makes Starlette's Route treat a plain ASGI function as an ASGI app, not a request handler."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


def error_response(err: DecodeServerError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _label(err: DecodeServerError) -> str:
    return "kv_transfer_failed" if err.code == "kv_transfer_failed" else _STATUS_LABEL.get(err.status, "error")


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


class _Request:
    """State of one admitted /pd/decode request, from KV wait to the last byte."""

    def __init__(self, req: DecodeRequest, params: SamplingParams, active: ActiveRequest) -> None:
        self.req, self.params, self.active = req, params, active
        self.received: ReceivedKVLike | None = None
        self.inject_s = 0.0
        self.settled = False
        self.streaming = False  # the StreamingResponse owns the outcome from here on
        self.watcher: asyncio.Task | None = None

    def timing_ms(self, result: DecodeResult | None) -> dict[str, float]:
        r = self.received
        return {
            "wire_wait": _ms(r.wire_wait_s) if r else 0.0,
            "transfer": _ms(r.transfer_s) if r else 0.0,
            "convert": _ms(r.convert_s) if r else 0.0,
            "inject": _ms(self.inject_s),
            "decode": _ms(result.decode_s) if result else 0.0,
            "total": _ms(time.perf_counter() - self.active.t0),
        }


def create_app(config: ServerConfig, engine: DecodeEngine, receiver: KVSource,
               registry: CollectorRegistry | None = None) -> Starlette:
    registry = registry if registry is not None else CollectorRegistry()
    metrics = DecodeMetrics(registry)
    runner = DecodeRunner(engine, receiver, metrics)
    vocab = engine.vocab_size

    def settle(state: _Request, status: str, result: DecodeResult | None = None) -> None:
        """Count the request's outcome exactly once and free the slot (now or when the engine job stops)."""
        if state.settled:
            return
        state.settled = True
        if state.watcher is not None:
            state.watcher.cancel()
        metrics.requests.labels(status).inc()
        if status == "cancelled":
            metrics.cancellations.inc()
        elif status == "kv_timeout":
            metrics.kv_timeouts.inc()
        r = state.received
        if r is not None:
            metrics.phase_seconds.labels("wire_wait").observe(r.wire_wait_s)
            metrics.phase_seconds.labels("convert").observe(r.convert_s)
            metrics.phase_seconds.labels("inject").observe(state.inject_s)
        if result is not None:
            metrics.phase_seconds.labels("decode").observe(result.decode_s)
            generated = max(result.num_tokens - 1, 0)
            metrics.generated_tokens.inc(generated)
            if generated and result.decode_s > 0:
                metrics.tokens_per_second.observe(generated / result.decode_s)
        runner.finish(state.active)

    def validate(raw: bytes) -> tuple[DecodeRequest, SamplingParams, float]:
        req = parse_body(DecodeRequest, raw)
        if req.first_token_id >= vocab:
            raise BadRequest(f"first_token_id={req.first_token_id} outside the vocabulary [0, {vocab})")
        params = req.sampling_params()
        try:
            params.check_vocab(vocab)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        timeout_s = req.timeout_s if req.timeout_s is not None else config.kv_timeout_s
        if timeout_s > config.max_timeout_s:
            raise BadRequest(f"timeout_s={timeout_s} exceeds the node's limit {config.max_timeout_s}")
        return req, params, timeout_s

    async def watch_disconnect(request: Request, state: _Request) -> None:
        """Cancel the request when the client goes away (the body has been read: only disconnect is left).
        Runs until the request is settled, so a stream abandoned before its first byte still frees the node."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                break
        if not state.settled:
            log.info("client of rid %s disconnected: cancelling", state.req.rid)
            runner.cancel(state.req.rid)
            if state.streaming:
                settle(state, "cancelled")

    async def decode(request: Request) -> Response:
        try:
            req, params, timeout_s = validate(await request.body())
            active = runner.acquire(req.rid)
        except DecodeServerError as e:
            metrics.requests.labels(_label(e)).inc()
            return error_response(e)
        state = _Request(req, params, active)
        state.watcher = asyncio.create_task(watch_disconnect(request, state))
        try:
            state.received = await runner.wait_kv(active, timeout_s)
            metrics.record_handoff(state.received.nbytes, state.received.transfer_s)
            state.inject_s = await runner.inject(active, state.received)
            batches = runner.start_decode(active, req.first_token_id, state.received.num_tokens, params)
            if req.stream:
                state.streaming = True
                return StreamingResponse(stream_body(state, batches), media_type="application/x-ndjson")
            token_ids = [t async for batch in batches for t in batch]
            result: DecodeResult = active.job.result()
            if result.finish_reason == "abort":
                raise Cancelled(f"rid {req.rid} was cancelled after {len(token_ids)} tokens")
            settle(state, "ok", result)
            return JSONResponse({"rid": req.rid, "token_ids": token_ids, "seq_len": result.seq_len,
                                 "finish_reason": result.finish_reason, "timing_ms": state.timing_ms(result)})
        except DecodeServerError as e:
            settle(state, _label(e))
            return error_response(e)
        except asyncio.CancelledError:
            runner.cancel(req.rid)
            settle(state, "cancelled")
            state.streaming = False
            raise
        except Exception as e:  # the engine failed: never a traceback to the client
            log.exception("decode of rid %s failed", req.rid)
            settle(state, "error")
            return error_response(DecodeServerError(f"{type(e).__name__}: {e}"))
        finally:
            if not state.streaming:
                settle(state, "error")  # no-op when already settled

    async def stream_body(state: _Request, batches: AsyncIterator[list[int]]) -> AsyncIterator[bytes]:
        n = 0
        try:
            async for batch in batches:
                n += len(batch)
                yield (json.dumps({"t": batch}) + "\n").encode()
            try:
                result: DecodeResult = state.active.job.result()
            except Exception as e:
                log.exception("decode of rid %s failed mid-stream", state.req.rid)
                settle(state, "error")
                yield (json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n").encode()
                return
            if result.finish_reason == "abort":
                settle(state, "cancelled", result)
                yield (json.dumps({"error": "cancelled", "n": n}) + "\n").encode()
                return
            settle(state, "ok", result)
            yield (json.dumps({"done": True, "n": n, "seq_len": result.seq_len,
                               "finish_reason": result.finish_reason,
                               "timing_ms": state.timing_ms(result)}) + "\n").encode()
        finally:
            if not state.settled:  # the client went away mid-stream (Starlette cancelled us)
                runner.cancel(state.req.rid)
                settle(state, "cancelled")

    async def cancel(request: Request) -> Response:
        try:
            body = parse_body(CancelRequest, await request.body())
        except DecodeServerError as e:
            return error_response(e)
        return JSONResponse({"rid": body.rid, "cancelled": runner.cancel(body.rid)})

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def capabilities(_: Request) -> Response:
        caps = engine.capabilities()
        caps.update({"model": config.model_name, "model_dir": config.model, "max_seq_len": engine.max_seq_len,
                     "stream": True, "max_concurrent_requests": 1, "default_timeout_s": config.kv_timeout_s})
        return JSONResponse(caps)

    async def decode_status(_: Request) -> Response:
        return JSONResponse(runner.status())

    @asynccontextmanager
    async def lifespan(app: Starlette):
        receiver.start()
        try:
            yield
        finally:
            runner.shutdown()
            receiver.stop()

    app = Starlette(
        routes=[
            Route("/pd/decode", decode, methods=["POST"]),
            Route("/pd/cancel", cancel, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/capabilities", capabilities, methods=["GET"]),
            Route("/decode_status", decode_status, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    # The library's ASGI app served at exactly /metrics (a Mount would answer /metrics with a 307 to /metrics/).
    app.router.routes.append(Route("/metrics", _ASGIEndpoint(make_asgi_app(registry=registry))))
    app.state.config = config
    app.state.metrics = metrics
    app.state.runner = runner
    return app
