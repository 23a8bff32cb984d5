"""The app factory: routes, lifespan (one pooled httpx.AsyncClient), lane selection, error rendering.

    app = create_app(config)                       # in-process use: tests, integration harnesses
    async with app.router.lifespan_context(app):   # (uvicorn runs the lifespan itself)
        ...  httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") ...

`secrets` (RouterSecrets.from_env(os.environ), built at the entrypoint): the client API keys (auth.py) and
the headers for upstream calls. None = no secrets (auth off; dev / tests).
Keyword arguments for tests: `transport` (an httpx transport for every upstream call, e.g.
httpx.MockTransport), `registry` (a prometheus CollectorRegistry), `model_text` (a ready tokenizer
bundle instead of loading `tokenizer_dir`), `clock`, `resolver` (the pools' DNS lookups: discovery.Resolver).

Per request (serve): API key (401 / 429 per key) -> body read within limits.max_body_bytes (413) -> parsed
within limits.max_json_depth (400) -> lane: the alias's pool, or an `X-Lane: native|express` header overrides
it with the other lane's default pool (config `lanes`, else that lane's first pool) -> capability routing
(capabilities.py: native or 400 when the express pool cannot honour a field) -> the key's lane permission
(403) -> the lane. The reply says which lane served it: `X-Expresslane-Lane` (+ `X-Expresslane-Reroute`).
Every unknown path or method is an OpenAI-shaped 404 / 405.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CollectorRegistry, make_asgi_app
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope

from .server.auth import ApiKey, ApiKeys
from .fleet.capabilities import CapabilityRouter, reroute_counter
from .config import LANES, ExpressPool, NativePool, RouterConfig
from .openai.detokenizer import ModelText, load_model_text
from .server.endpoints import RESPONSES_API_ERROR, Endpoints
from .errors import (BadRequest, ClientGone, MethodNotAllowed, ModelNotFound, NotFound, RouterError,
                     error_body)
from .fleet.discovery import PREFILL_POOL, Membership, Resolver, resolve_addresses
from .fleet.health import HealthMonitor
from .fleet.pools import PrefillPool, member_serving
from .lanes.base import LaneContext
from .lanes.express import ExpressLane, check_express_supported
from .lanes.native import NativeLane
from .server.fastpath import CompletionsFastPath, RouterApp
from .server.limits import loads_object, read_asgi_body, read_body
from .server.loop_lag import LoopLagMonitor
from .metrics import RequestRecord, RouterMetrics
from .openai.shapes import ClientRequest, Kind, parse_request
from .server.requestlog import RequestIdMiddleware, upstream_request_id_hook
from .server.secrets import RouterSecrets
from .upstream.aiohttp_transport import AiohttpTransport
from .upstream.h1_pool import H1Pool
from .server.http_protocol import ClientWatch, client_watch
from .upstream.calls import HttpxOneShot

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


async def run_until_disconnect(receive: Receive, work: Awaitable[Response],
                               watch: ClientWatch | None = None) -> Response:
    """Run `work` in this task; if the client disconnects first, cancel it (its cleanup runs, here, before this
    returns) and raise ClientGone.

    The disconnect is told by the request's `watch` (http_protocol.ClientWatch: a plain call from the server's
    connection_lost) when the server gives one; otherwise one watcher task reads `receive` (an ASGI
    `http.disconnect`, read after the body). `work` itself runs inline (no task of its own, no asyncio.wait: this
    is the hot path of every completion request)."""
    me = asyncio.current_task()
    assert me is not None
    gone = False

    def client_gone() -> None:
        nonlocal gone
        gone = True
        me.cancel()

    watcher: asyncio.Task | None = None
    if watch is not None:
        watch.subscribe(client_gone)
    else:
        async def watch_receive() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            client_gone()

        watcher = asyncio.get_running_loop().create_task(watch_receive())
    try:
        resp = await work
    except asyncio.CancelledError:
        if gone:
            me.uncancel()
            raise ClientGone("client disconnected") from None
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
        else:
            watch.unsubscribe()  # type: ignore[union-attr]
    if gone:  # the disconnect came in the same instant the work ended: its cancel is pending on this task
        me.uncancel()
        with anyio.CancelScope(shield=True), contextlib.suppress(BaseException):
            if hasattr(resp, "_on_close"):  # a stream was built: clean it up
                await resp._on_close()
        raise ClientGone("client disconnected")
    return resp


class _AsgiEndpoint:
    """Lets a plain ASGI function serve an exact path (Starlette calls bare functions as request handlers)."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


def create_app(config: RouterConfig, *, secrets: RouterSecrets | None = None,
               transport: httpx.AsyncBaseTransport | None = None,
               registry: CollectorRegistry | None = None, model_text: ModelText | None = None,
               clock: Callable[[], float] = time.monotonic, access_log: bool = False,
               fast_path: bool = True, resolver: Resolver = resolve_addresses) -> FastAPI:
    secrets = secrets if secrets is not None else RouterSecrets()
    keys = ApiKeys.from_text(secrets.api_keys_text, clock)  # AuthConfigError names the bad line, never a key
    metrics = RouterMetrics(config, registry)
    reroutes = reroute_counter(config, metrics.registry)
    monitor = HealthMonitor(config, metrics, headers=secrets.upstream_headers, clock=clock)
    membership = Membership(config, metrics, resolver=resolver)  # pools' members: static + DNS (discovery.py)
    membership.on_change(lambda pool, added, removed: _follow_members(config, monitor, metrics, pool, added, removed))
    prefills = PrefillPool(config.prefill.affinity, lambda: membership.urls(PREFILL_POOL),
                           lambda url: member_serving(monitor, url), metrics,
                           retry_after_s=config.resilience.unavailable_retry_after_s)
    needs_tokenizer = any(isinstance(p, ExpressPool) for p in config.pools.values())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        mt = model_text
        if mt is None and needs_tokenizer:
            assert config.tokenizer_dir is not None
            mt = await anyio.to_thread.run_sync(load_model_text, config.tokenizer_dir)
        t = config.timeouts
        saturated = metrics.saturated
        oneshot = probes = None
        if transport is None:  # the router's own clients; a test's transport gets every call through httpx
            oneshot = H1Pool(max_connections=config.upstream.max_connections, keepalive_expiry_s=t.upstream_keepalive_s,
                             on_saturated=saturated.labels("oneshot").inc)
            probes = H1Pool(max_connections=config.health.max_connections, keepalive_expiry_s=t.upstream_keepalive_s,
                            on_saturated=saturated.labels("probe").inc)  # their own budget: traffic cannot starve them
        streams = transport or AiohttpTransport(max_connections=config.upstream.max_connections,
                                                keepalive_expiry_s=t.upstream_keepalive_s,
                                                on_saturated=saturated.labels("stream").inc)
        async with contextlib.AsyncExitStack() as stack, httpx.AsyncClient(
                transport=streams, trust_env=False,
                timeout=httpx.Timeout(t.decode_s, connect=t.connect_s),  # (its pool: upstream/aiohttp_transport.py)
                event_hooks={"request": [upstream_request_id_hook]}) as client:  # X-Request-Id on both legs
            # one-shot calls (JSON legs) and probes on keep-alive pools of their own (upstream/h1_pool.py)
            for pool in (oneshot, probes):
                if pool is not None:
                    stack.push_async_callback(pool.aclose)
            ctx = LaneContext(config=config, client=client, metrics=metrics, clock=clock, health=monitor,
                              headers=secrets.upstream_headers, prefills=prefills, membership=membership,
                              calls=oneshot if oneshot is not None else HttpxOneShot(client))
            native = NativeLane(ctx, {n: p for n, p in config.pools.items() if isinstance(p, NativePool)})
            express = ExpressLane(ctx, {n: p for n, p in config.pools.items() if isinstance(p, ExpressPool)},
                                  native, mt)
            app.state.lanes = Lanes(ctx, native, express)
            if express.pools:
                ctx.background(express.prefetch_model_len())  # before a burst needs it (express.py)
            # ---- front door: capability routing and the endpoints beside completions ----
            app.state.capabilities = CapabilityRouter(
                config, client, secrets, reroutes, clock,
                relay_check=lambda body, kind: check_express_supported(body, kind,
                                                                       tool_parser=config.tool_call_parser),
                pool_nodes=lambda pool: express.gates[pool].nodes)
            caps = app.state.capabilities
            membership.on_change(lambda pool, added, removed: [caps.forget(url) for url in removed])
            caps.on_seats(express.seats_changed)  # each node's seats: its gate's capacity
            express.node_busy = caps.expire
            app.state.endpoints = Endpoints(config, client, secrets, prefills, clock,
                                            report_failure=monitor.report_failure,
                                            report_success=monitor.report_success)
            async with membership.running(), monitor.running(probes or HttpxOneShot(client)), caps.running():
                with LoopLagMonitor(metrics.loop_lag).running():  # server/loop_lag.py
                    yield
            await ctx.drain(t.cancel_s + t.connect_s)  # cancels still in flight reach their nodes
            app.state.lanes = None

    app = RouterApp(title="expresslane router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.router.redirect_slashes = False  # "/v1/completions/" is an unknown path (404 JSON), not a 307
    app.add_middleware(RequestIdMiddleware, access_log=access_log)  # X-Request-Id in and out, access log
    app.state.config = config
    app.state.metrics = metrics
    app.state.health = monitor
    metrics_app = make_asgi_app(registry=metrics.registry)
    app.router.routes.append(Route("/metrics", _AsgiEndpoint(metrics_app), include_in_schema=False))
    app.mount("/metrics", metrics_app)  # /metrics/ too (no redirect for scrapers)

    # ---- errors: every reply is OpenAI-shaped (errors.py), never FastAPI's {"detail": ...} ----
    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            return error_response(NotFound(f"no such endpoint: {where}"))
        if exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "")
            return error_response(MethodNotAllowed(f"method not allowed: {where} (allowed: {allow})",
                                                   headers={"allow": allow} if allow else None))
        err = RouterError(f"{where}: {exc.detail}")
        err.status = exc.status_code if 400 <= exc.status_code < 500 else 500
        err.type = "invalid_request_error" if err.status < 500 else "internal_error"
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(BadRequest(f"invalid request: {exc.errors()[:3]}"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body("internal router error", "internal_error"), status_code=500)

    # ---- auth (server/auth.py): every route but /health, /ready (its details need a key), /metrics ----
    if not keys.enabled:
        where = f"{config.listen.host}:{config.listen.port}"
        log.warning("no client API keys configured (ROUTER_API_KEYS / ROUTER_API_KEY): the router is open to "
                    "anyone who can reach %s. The default stacks publish it on 127.0.0.1 only (compose "
                    "PUBLISH_ADDRESS, the dev stack's BIND_HOST); set ROUTER_API_KEYS before exposing it further",
                    where)
    missing = [n for n, v in (("VLLM_API_KEY", secrets.vllm_api_key), ("EXPRESS_NODE_TOKEN", secrets.express_node_token))
               if not v]
    if missing:
        log.warning("%s not set: the router calls its upstreams without them, so they must be open too (the default "
                    "stacks generate them: docs/security.md)", " and ".join(missing))

    def authenticate(scope: Scope, authorization: str | None) -> ApiKey | None:
        try:
            return keys.authenticate(authorization)
        except RouterError as e:
            client = scope.get("client")
            log.info("%s %s from %s: %d %s", scope["method"], scope["path"], client[0] if client else "?",
                     e.status, e.code)
            raise

    def check_auth(request: Request) -> ApiKey | None:
        return authenticate(request.scope, request.headers.get("authorization"))

    async def json_body(request: Request) -> dict:
        return loads_object(await read_body(request, config.limits.max_body_bytes), config.limits.max_json_depth)

    @app.get("/health")
    async def health(request: Request) -> dict:
        lanes: Lanes | None = getattr(request.app.state, "lanes", None)
        pools = {}
        if lanes is not None:
            for name, gate in lanes.express.gates.items():
                pools[name] = {"nodes": len(gate.nodes), "busy_nodes": gate.busy_nodes, "seats": gate.seats_total,
                               "busy_seats": gate.busy_count, "waiting": gate.waiting}
        return {"status": "ok", "express_pools": pools}

    def may_see_details(request: Request) -> bool:
        """/ready's details (every upstream's address and state) go to a caller with a client API key; a router
        without keys shows them to loopback callers only (the host itself, `docker compose exec`)."""
        if not keys.enabled:
            client = request.client
            return client is not None and _loopback(client.host)
        try:
            return keys.authenticate(request.headers.get("authorization")) is not None
        except RouterError:
            return False

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        ok, details = monitor.readiness()
        body = details if may_see_details(request) else {"status": details["status"]}
        return JSONResponse(body, status_code=200 if ok else 503)

    # ---- endpoints beside completions (endpoints.py) ----
    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_auth(request)
        return await request.app.state.endpoints.list_models()

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(request: Request, model_id: str) -> Response:
        check_auth(request)
        return await request.app.state.endpoints.retrieve_model(model_id)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        check_auth(request)
        return await request.app.state.endpoints.tokenizer_call("/tokenize", await json_body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        check_auth(request)
        return await request.app.state.endpoints.tokenizer_call("/detokenize", await json_body(request))

    @app.get("/version")
    async def version(request: Request) -> Response:
        check_auth(request)
        return await request.app.state.endpoints.version()

    responses_methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]

    @app.api_route("/v1/responses", methods=responses_methods)
    @app.api_route("/v1/responses/{rest:path}", methods=responses_methods)
    async def responses_api(request: Request) -> Response:
        check_auth(request)
        raise BadRequest(RESPONSES_API_ERROR, code="unsupported_endpoint")

    state = app.state

    async def serve(scope: Scope, receive: Receive, kind: Kind) -> Response:
        """One completion request, from its ASGI scope and receive (fastpath.py, or the Starlette routes below)."""
        started = clock()
        record: RequestRecord | None = None
        try:
            headers = _request_headers(scope)
            key = authenticate(scope, headers.get(b"authorization"))
            req = parse_request(await read_asgi_body(receive, headers.get(b"content-length"),
                                                     config.limits.max_body_bytes), kind,
                                max_depth=config.limits.max_json_depth)
            x_lane = headers.get(b"x-lane")
            lane, pool = resolve_lane(config, req.alias, x_lane)
            caps: CapabilityRouter = state.capabilities
            route = await caps.route(req.body, kind == "chat", req.alias, lane, pool,
                                     forced=(x_lane or "").strip().lower() == "express")
            ApiKeys.check_lane(key, route.lane)
            record = RequestRecord(metrics, lane=route.lane, alias=req.alias, started=started, clock=clock)
            lanes: Lanes = state.lanes
            resp = await run_until_disconnect(receive, lanes.dispatch(req, route.lane, route.pool, record),
                                              client_watch(scope))
            resp.headers["x-expresslane-lane"] = record.lane
            if route.features:
                resp.headers["x-expresslane-reroute"] = route.header
            return resp
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

    async def completions(request: Request) -> Response:
        return await serve(request.scope, request.receive, "completion")

    async def chat_completions(request: Request) -> Response:
        return await serve(request.scope, request.receive, "chat")

    # The hot path: answered below Starlette (fastpath.py); these routes answer other methods on the two paths
    # (405), and everything with fast_path=False (the old path, for the byte-identity tests).
    app.router.routes[0:0] = [Route("/v1/completions", completions, methods=["POST"]),
                              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    if fast_path:
        app.fast_path = CompletionsFastPath(serve, error_response, access_log=access_log)
    return app


def _follow_members(config: RouterConfig, monitor: HealthMonitor, metrics: RouterMetrics, pool: str,
                    added: list[str], removed: list[str]) -> None:
    """A pool's members changed (DNS): the health monitor probes the new ones and forgets the gone ones. A new
    express node takes traffic only once a probe found it healthy (its /health covers engine, control plane and
    NIXL agent); a new vLLM member serves until a probe or a request says otherwise. (The express lane's gate
    adds and drains its nodes itself: lanes/express.py.)"""
    lane = "prefill" if pool == PREFILL_POOL else config.pools[pool].lane
    for url in added:
        monitor.track(lane, url, "express" if lane == "express" else "vllm", pool, proven=lane != "express")
        metrics.member_joined(pool, url)
    for url in removed:
        monitor.forget(url, pool)
        metrics.member_left(pool, url)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_SERVE_HEADERS = frozenset((b"authorization", b"content-length", b"x-lane"))


def _request_headers(scope: Scope) -> dict[bytes, str]:
    """The request headers `serve` reads, the first of each name, decoded as Starlette's Headers.get does."""
    out: dict[bytes, str] = {}
    for k, v in scope["headers"]:
        if k in _SERVE_HEADERS and k not in out:
            out[k] = v.decode("latin-1")
    return out
