"""The app factory: routes, lifespan (one pooled httpx.AsyncClient), lane selection, error rendering.

    app = create_app(config)                       # in-process use: tests, integration harnesses
    async with app.router.lifespan_context(app):   # (uvicorn runs the lifespan itself)
        ...  httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") ...

Keyword arguments for tests: `transport` (an httpx transport for every upstream call, e.g.
httpx.MockTransport), `registry` (a prometheus CollectorRegistry), `model_text` (a ready tokenizer
bundle instead of loading `tokenizer_dir`), `clock`.

Lane per request: the alias's pool decides; an `X-Lane: native|express` header overrides it with the
other lane's default pool (config `lanes`, else that lane's first pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
import httpx
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, make_asgi_app
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .config import LANES, ExpressPool, NativePool, RouterConfig
from .detokenizer import ModelText, load_model_text
from .health import HealthMonitor
from .secrets import RouterSecrets
from .errors import BadRequest, ClientGone, ModelNotFound, RouterError, Unauthorized, error_body
from .lanes.base import LaneContext
from .lanes.express import ExpressLane
from .lanes.native import NativeLane
from .metrics import RequestRecord, RouterMetrics
from .openai_shapes import ClientRequest, Kind, parse_request

__all__ = ["create_app", "Lanes", "resolve_lane"]

log = logging.getLogger("expresslane.router")


def resolve_lane(config: RouterConfig, alias: str, x_lane: str | None) -> tuple[str, str]:
    """(lane, pool) for a request: the alias's pool, or the X-Lane override's default pool."""
    a = config.aliases.get(alias)
    if a is None:
        raise ModelNotFound(f"The model `{alias}` does not exist. Known models: {', '.join(config.aliases)}",
                            param="model")
    pool = a.pool
    lane = config.pools[pool].lane
    if x_lane is not None and x_lane.strip():
        want = x_lane.strip().lower()
        if want not in LANES:
            raise BadRequest(f"X-Lane must be one of {', '.join(LANES)}, got {x_lane!r}", param="X-Lane")
        if want != lane:
            other = config.lane_pool(want)
            if other is None:
                raise BadRequest(f"X-Lane: {want}: no {want} pool is configured", param="X-Lane")
            lane, pool = want, other
    return lane, pool


@dataclass
class Lanes:
    ctx: LaneContext
    native: NativeLane
    express: ExpressLane

    async def dispatch(self, req: ClientRequest, lane: str, pool: str, record: RequestRecord) -> Response:
        if lane == "express":
            return await self.express.handle(req, pool, record, self.ctx.config.queue_for(req.alias, pool))
        return await self.native.handle(req, pool, record)


def error_response(err: RouterError) -> Response:
    status, content, headers = err.render()
    return Response(content=content, status_code=status, headers=headers)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run `work`; if the client disconnects first, cancel it (its cleanup runs) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with anyio.CancelScope(shield=True), contextlib.suppress(BaseException):
            resp = await task
            if hasattr(resp, "_on_close"):  # a stream was built in the same instant: clean it up
                await resp._on_close()
        raise ClientGone("client disconnected")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


class _AsgiEndpoint:
    """Lets a plain ASGI function serve an exact path (Starlette calls bare functions as request handlers)."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


def create_app(config: RouterConfig, *, transport: httpx.AsyncBaseTransport | None = None,
               registry: CollectorRegistry | None = None, model_text: ModelText | None = None,
               clock: Callable[[], float] = time.monotonic, secrets: RouterSecrets | None = None) -> FastAPI:
    metrics = RouterMetrics(config, registry)
    secrets = secrets or RouterSecrets()
    monitor = HealthMonitor(config, metrics, headers=secrets.upstream_headers, clock=clock)
    needs_tokenizer = any(isinstance(p, ExpressPool) for p in config.pools.values())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        mt = model_text
        if mt is None and needs_tokenizer:
            assert config.tokenizer_dir is not None
            mt = await anyio.to_thread.run_sync(load_model_text, config.tokenizer_dir)
        t = config.timeouts
        async with httpx.AsyncClient(
                transport=transport, trust_env=False,
                timeout=httpx.Timeout(t.decode_s, connect=t.connect_s),
                limits=httpx.Limits(max_connections=512, max_keepalive_connections=64)) as client:
            ctx = LaneContext(config=config, client=client, metrics=metrics, clock=clock, health=monitor,
                              headers=secrets.upstream_headers)
            native = NativeLane(ctx, {n: p for n, p in config.pools.items() if isinstance(p, NativePool)})
            express = ExpressLane(ctx, {n: p for n, p in config.pools.items() if isinstance(p, ExpressPool)},
                                  native, mt)
            app.state.lanes = Lanes(ctx, native, express)
            async with monitor.running(client):
                yield
            await ctx.drain(t.cancel_s + t.connect_s)  # cancels still in flight reach their nodes
            app.state.lanes = None

    app = FastAPI(title="expresslane router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config = config
    app.state.metrics = metrics
    app.state.health = monitor
    metrics_app = make_asgi_app(registry=metrics.registry)
    app.router.routes.append(Route("/metrics", _AsgiEndpoint(metrics_app), include_in_schema=False))
    app.mount("/metrics", metrics_app)  # /metrics/ too (no redirect for scrapers)

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> Response:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body("internal router error", "internal_error"), status_code=500)

    def check_auth(request: Request) -> None:
        if not config.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise Unauthorized("missing or invalid API key (Authorization: Bearer <key>)")

    @app.get("/health")
    async def health(request: Request) -> dict:
        lanes: Lanes | None = getattr(request.app.state, "lanes", None)
        pools = {}
        if lanes is not None:
            for name, gate in lanes.express.gates.items():
                pools[name] = {"busy_nodes": gate.busy_count, "nodes": len(gate.nodes), "waiting": gate.waiting}
        return {"status": "ok", "express_pools": pools}

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        ok, body = monitor.readiness()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_auth(request)
        created = int(time.time())
        data = [{"id": alias, "object": "model", "created": created, "owned_by": "expresslane",
                 "root": config.prefill.model, "parent": None, "lane": config.pools[a.pool].lane}
                for alias, a in config.aliases.items()]
        return {"object": "list", "data": data}

    async def serve(request: Request, kind: Kind) -> Response:
        started = clock()
        record: RequestRecord | None = None
        try:
            check_auth(request)
            req = parse_request(await request.body(), kind)
            lane, pool = resolve_lane(config, req.alias, request.headers.get("x-lane"))
            record = RequestRecord(metrics, lane=lane, alias=req.alias, started=started, clock=clock)
            lanes: Lanes = request.app.state.lanes
            return await run_until_disconnect(request, lanes.dispatch(req, lane, pool, record))
        except RouterError as e:
            if record is not None:
                record.finish(e.status)
            else:
                metrics.requests.labels("none", "", str(e.status)).inc()
            if isinstance(e, ClientGone):
                return Response(status_code=499)
            return error_response(e)
        except Exception:
            if record is not None:
                record.finish(500)
            raise

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, "chat")

    return app
