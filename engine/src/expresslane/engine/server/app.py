"""The express decode node's HTTP app: TileRT's decode-node contract plus reservations, health and auth
(docs/api.md, "The express node's HTTP API").

    POST /pd/reserve  {rid, ttl_s} -> {rid, reserved: true, ttl_s, seat}      (429 busy: every seat held, 503 not_ready)
    POST /pd/decode   {rid, first_token_id, max_tokens, sampling:{...}, stream, timeout_s, top_logprobs,
                       structured_outputs}
                      -> {rid, token_ids, seq_len, finish_reason, timing_ms[, logprobs, top_logprobs]} or NDJSON
                         {"t":[..][, "lp":[..], "tp":[..]]} ... {"done":..}
                      (400 bad_request / invalid_parameter, 409 not_reserved, 502 kv_transfer_failed,
                       503 not_ready, 504 kv_transfer_timeout/...)
    POST /pd/cancel   {rid} -> {rid, cancelled}
    GET  /health, /ready, /metrics (open); /capabilities, /decode_status (bearer token when configured)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from prometheus_client import CollectorRegistry, make_asgi_app
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..decode import DecodeEngine, SamplingParams
from ..decode.grammar import BACKEND as GRAMMAR_BACKEND
from ..decode.grammar import GrammarCompiler, GrammarError, RequestGrammar
from ..decode.logprobs import MAX_TOP_LOGPROBS
from .auth import BearerAuth
from .config import ServerConfig
from .errors import BadRequest, Busy, Cancelled, DecodeServerError, InvalidParameter, KVTransferFailed, NotReady, Unsupported
from .health import HealthMonitor
from .kv_source import KVSource, ReceivedKVLike
from .metrics import DecodeMetrics, SpeculationCollector
from .runner import ActiveRequest, DecodeResult, DecodeRunner
from .schemas import CancelRequest, DecodeRequest, ReserveRequest, parse_body

log = logging.getLogger(__name__)

# requests_total{status} label of each error code
_CODE_LABEL = {"bad_request": "bad_request", "invalid_parameter": "bad_request", "busy": "busy",
               "not_reserved": "not_reserved", "not_ready": "not_ready",
               "cancelled": "cancelled", "unsupported": "unsupported", "kv_transfer_timeout": "kv_timeout",
               "kv_transfer_failed": "kv_transfer_failed", "decode_stalled": "stalled",
               "deadline_exceeded": "deadline"}

# What this node really honours (the front door routes on it). Everything else is refused (400/501) or absent.
# + "speculative": the engine's; "structured_output" is false on a node whose model directory has no tokenizer.
FEATURES = {"logprobs": True, "top_logprobs": True, "structured_output": True, "tools": False, "n": False,
            "echo": False, "prompt_logprobs": False, "logit_bias": True, "min_p": True, "allowed_token_ids": True,
            "bad_words": False, "stop_token_ids": True, "min_tokens": True, "penalties": True, "seed": True}


class _ASGIEndpoint:
    """Makes Starlette's Route treat a plain ASGI function as an ASGI app, not a request handler."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


def error_response(err: DecodeServerError) -> JSONResponse:
    headers = {"retry-after": "1"} if isinstance(err, Busy) else None  # a seat frees within a request's time
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _label(err: DecodeServerError) -> str:
    return _CODE_LABEL.get(err.code, "error")


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _ndjson(obj: dict) -> bytes:
    return (json.dumps(obj) + "\n").encode()


# vLLM's OpenAI layer clamps every logprob to >= -9999.0; the node sends masked tokens' -inf the same way
# (JSON has no infinity).
LOGPROB_FLOOR = -9999.0


def _lp(x: float | None) -> float | None:
    return None if x is None else max(x, LOGPROB_FLOOR)


def _tp(top: list[tuple[int, float]] | None) -> list[list] | None:
    return None if top is None else [[i, max(v, LOGPROB_FLOOR)] for i, v in top]


def _token_fields(items: list, with_logprobs: bool, ids: str = "t", lps: str = "lp", tps: str = "tp") -> dict:
    """A batch from the runner -> {"t": ids} or {"t": ids, "lp": [...], "tp": [...]}."""
    if not with_logprobs:
        return {ids: items}
    return {ids: [it[0] for it in items], lps: [_lp(it[1]) for it in items], tps: [_tp(it[2]) for it in items]}


def load_grammar_compiler(config: ServerConfig, vocab_size: int) -> GrammarCompiler | None:
    """The node's xgrammar compiler from the model directory's tokenizer; None (logged, and announced as
    structured_output false in /capabilities) when the directory has no tokenizer or xgrammar is not installed."""
    try:
        return GrammarCompiler.from_model_dir(config.model, vocab_size)
    except ImportError as e:
        log.warning("no structured outputs on this node: xgrammar is not installed (%s)", e)
    except (OSError, ValueError, TypeError) as e:
        log.warning("no structured outputs on this node: the model directory's tokenizer does not load (%s)", e)
    return None


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
               registry: CollectorRegistry | None = None,
               grammar_compiler: GrammarCompiler | None | bool = True) -> Starlette:
    """grammar_compiler: True (default) = built from config.model's tokenizer; None/False = no structured outputs."""
    registry = registry if registry is not None else CollectorRegistry()
    compiler = (load_grammar_compiler(config, engine.vocab_size) if grammar_compiler is True
                else grammar_compiler or None)
    metrics = DecodeMetrics(registry)
    registry.register(SpeculationCollector(lambda: engine.spec_stats,
                                           engine.speculation.k if engine.speculation else 0,
                                           lambda: engine.default_step_costs,
                                           lambda: dict(engine.family_requests)))
    runner = DecodeRunner(engine, receiver, metrics, reservation_ttl_s=config.reservation_ttl_s,
                          request_deadline_s=config.request_deadline_s, stall_timeout_s=config.stall_timeout_s)
    monitor = HealthMonitor(runner, receiver, metrics, interval_s=config.health_interval_s,
                            probe_timeout_s=config.health_probe_timeout_s)
    vocab = engine.vocab_size

    def require_healthy() -> None:
        report = monitor.current()
        if not report.ok or monitor.draining:
            raise NotReady(report.checks)

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
        runner.finish(state.active, ok=status == "ok")

    def fail(state: _Request, err: DecodeServerError) -> None:
        if isinstance(err, KVTransferFailed):
            metrics.kv_transfer_failures.labels(err.reason.split(":", 1)[0]).inc()
            log.warning("KV transfer for a request failed: %s", err.reason)
        elif err.code in ("decode_stalled", "deadline_exceeded"):
            log.warning("request ended by the node's watchdog: %s", err.message)
        settle(state, _label(err))

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

    def compile_grammar(req: DecodeRequest, params: SamplingParams) -> RequestGrammar | None:
        """Compile the request's structured output (engine-free, bounded) and check that the grammar allows the
        first token; runs in a worker thread before the KV wait."""
        if req.structured_outputs is None:
            return None
        spec = req.structured_outputs.spec()
        if compiler is None:
            raise Unsupported("structured_outputs: this node has no tokenizer for its model, so no grammar backend")
        try:
            compiled = compiler.compile(spec)
        except GrammarError as e:
            raise InvalidParameter(str(e)) from None
        stop = set(params.stop_token_ids) | set(engine.eos_token_ids)  # vLLM's all_stop_token_ids
        grammar = compiler.matcher(compiled, stop)
        if not grammar.matcher.accept_token(req.first_token_id):
            raise InvalidParameter(f"first_token_id={req.first_token_id} is not allowed by the structured_outputs "
                                   f"grammar (the prefill must sample it under the same constraint)")
        grammar.matcher.rollback(1)
        return grammar

    async def watch_disconnect(request: Request, state: _Request) -> None:
        """Cancel the request when the client goes away (the body has been read: only disconnect is left).
        Runs until the request is settled, so a stream abandoned before its first byte still frees the node."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                break
        if not state.settled:
            log.info("client of a request disconnected: cancelling")
            runner.cancel(state.req.rid)
            if state.streaming:
                settle(state, "cancelled")

    async def reserve(request: Request) -> Response:
        try:
            body = parse_body(ReserveRequest, await request.body())
            try:
                require_healthy()
            except NotReady:
                metrics.reservations.labels("not_ready").inc()
                raise
            ttl_s = runner.reserve(body.rid, body.ttl_s if body.ttl_s is not None else config.reservation_ttl_s)
        except DecodeServerError as e:
            return error_response(e)
        return JSONResponse({"rid": body.rid, "reserved": True, "ttl_s": ttl_s,
                             "seat": runner.seats.seat_of(body.rid)})

    async def decode(request: Request) -> Response:
        try:
            req, params, timeout_s = validate(await request.body())
            try:
                require_healthy()
                grammar = (await asyncio.to_thread(compile_grammar, req, params)
                           if req.structured_outputs is not None else None)
            except (NotReady, BadRequest, Unsupported):
                runner.cancel_reservation(req.rid)  # the caller goes elsewhere: hold nothing for it
                raise
            active = runner.acquire(req.rid, timeout_s)
        except DecodeServerError as e:
            metrics.requests.labels(_label(e)).inc()
            return error_response(e)
        state = _Request(req, params, active)
        state.watcher = asyncio.create_task(watch_disconnect(request, state))
        try:
            state.received = await runner.wait_kv(active, timeout_s)
            metrics.record_handoff(state.received.nbytes, state.received.transfer_s)
            state.inject_s = await runner.inject(active, state.received)
            batches = runner.start_decode(active, req.first_token_id, state.received.num_tokens, params,
                                          grammar=grammar)
            if req.stream:
                state.streaming = True
                return StreamingResponse(stream_body(state, batches), media_type="application/x-ndjson")
            items = [t async for batch in batches for t in batch]
            result: DecodeResult = active.job.result()
            if result.finish_reason == "abort":
                raise Cancelled(f"rid {req.rid} was cancelled after {len(items)} tokens")
            settle(state, "ok", result)
            fields = _token_fields(items, req.top_logprobs is not None, "token_ids", "logprobs", "top_logprobs")
            return JSONResponse({"rid": req.rid, **fields, "seq_len": result.seq_len,
                                 "finish_reason": result.finish_reason, "timing_ms": state.timing_ms(result)})
        except DecodeServerError as e:
            fail(state, e)
            return error_response(e)
        except asyncio.CancelledError:
            runner.cancel(req.rid)
            settle(state, "cancelled")
            state.streaming = False
            raise
        except Exception as e:  # the engine failed: never a traceback to the client
            log.exception("decode of a request failed")
            settle(state, "error")
            return error_response(DecodeServerError(f"{type(e).__name__}: {e}"))
        finally:
            if not state.streaming:
                settle(state, "error")  # no-op when already settled

    async def stream_body(state: _Request, batches: AsyncIterator[list]) -> AsyncIterator[bytes]:
        n = 0
        with_logprobs = state.req.top_logprobs is not None
        try:
            try:
                async for batch in batches:
                    n += len(batch)
                    yield _ndjson(_token_fields(batch, with_logprobs))
            except DecodeServerError as e:  # the stall watchdog or the deadline
                runner.cancel(state.req.rid)
                fail(state, e)
                yield _ndjson({**e.stream_line(), "n": n})
                return
            try:
                result: DecodeResult = state.active.job.result()
            except Exception as e:
                log.exception("decode of a request failed mid-stream")
                settle(state, "error")
                yield _ndjson({"error": f"{type(e).__name__}: {e}", "error_type": "internal", "n": n})
                return
            if result.finish_reason == "abort":
                settle(state, "cancelled", result)
                yield _ndjson({"error": "cancelled", "error_type": "cancelled", "n": n})
                return
            settle(state, "ok", result)
            yield _ndjson({"done": True, "n": n, "seq_len": result.seq_len, "finish_reason": result.finish_reason,
                           "timing_ms": state.timing_ms(result)})
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
        report = await monitor.check()
        return JSONResponse(report.body(), status_code=200 if report.ok else 503)

    async def ready(_: Request) -> Response:
        report = monitor.current()
        ok = report.ok and not monitor.draining
        body = {**report.body(), "ready": ok, "draining": monitor.draining}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def capabilities(_: Request) -> Response:
        caps = engine.capabilities()
        caps.update({"model": config.model_name, "model_dir": config.model, "max_seq_len": engine.max_seq_len,
                     "stream": True, "seats": engine.seats, "max_concurrent_requests": engine.seats,
                     "default_timeout_s": config.kv_timeout_s,
                     "max_timeout_s": config.max_timeout_s, "reservations": True,
                     "max_reservation_ttl_s": config.reservation_ttl_s,
                     "max_top_logprobs": MAX_TOP_LOGPROBS,
                     "structured_output_backend": GRAMMAR_BACKEND if compiler is not None else None,
                     "features": {**FEATURES, "structured_output": compiler is not None,
                                  "speculative": bool(caps.get("speculative"))}})
        return JSONResponse(caps)

    async def decode_status(_: Request) -> Response:
        return JSONResponse(runner.status())

    @asynccontextmanager
    async def lifespan(app: Starlette):
        receiver.start()
        await monitor.check()
        probe = asyncio.create_task(monitor.run(), name="expresslane-health")
        try:
            yield
        finally:
            monitor.draining = True
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe
            runner.shutdown()
            receiver.stop()
            if compiler is not None:
                compiler.close()

    middleware = [Middleware(BearerAuth, token=config.node_token)] if config.node_token else []
    app = Starlette(
        routes=[
            Route("/pd/reserve", reserve, methods=["POST"]),
            Route("/pd/decode", decode, methods=["POST"]),
            Route("/pd/cancel", cancel, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/capabilities", capabilities, methods=["GET"]),
            Route("/decode_status", decode_status, methods=["GET"]),
        ],
        middleware=middleware,
        lifespan=lifespan,
    )
    # The library's ASGI app served at exactly /metrics (a Mount would answer /metrics with a 307 to /metrics/).
    app.router.routes.append(Route("/metrics", _ASGIEndpoint(make_asgi_app(registry=registry))))
    app.state.config = config
    app.state.metrics = metrics
    app.state.runner = runner
    app.state.health = monitor
    return app
