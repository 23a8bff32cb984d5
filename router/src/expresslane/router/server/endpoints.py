"""The API surface beside completions: model cards, tokenizer passthrough, version, and the Responses API answer.

  GET  /v1/models            every alias, with `lane` and, when the prefill reports it, `max_model_len`
  GET  /v1/models/{id}       one alias (404 model_not_found otherwise); `max_model_len` as vLLM reports it
  POST /tokenize             passed to the prefill with `model` rewritten to its served name; reply relayed
  POST /detokenize           same
  GET  /version              the prefill's vLLM version, plus the router's own
  *    /v1/responses[/...]   400 unsupported_endpoint: the Responses API is not served (use chat completions)

"The prefill" is a serving member of the prefill pool, chosen and failed over as for a prefill leg (pools.py: the
body's affinity key, the next member when one fails as a node does); none serving = a typed 503 with Retry-After.
Upstream calls carry `RouterSecrets.upstream_headers("vllm")` (the vLLM servers' --api-key) and are bounded:
`timeouts.connect_s` to connect, and for the reply `timeouts.connect_s` (GET /v1/models, /version: metadata) or
`timeouts.prefill_s` (/tokenize, /detokenize: a long prompt takes a while).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any

import httpx
from starlette.responses import JSONResponse, Response

from ..config import RouterConfig
from ..errors import BadRequest, ModelNotFound, RouterError, UpstreamError
from ..fleet.pools import PrefillPool, member_failed
from .secrets import RouterSecrets
from ..upstream.errors import check_status, map_transport_error, read_json

__all__ = ["Endpoints", "RESPONSES_API_ERROR"]

log = logging.getLogger("expresslane.router.server.endpoints")

RESPONSES_API_ERROR = ("The Responses API (/v1/responses) is not served by this router: use /v1/chat/completions "
                       "(the same models, tools and structured outputs)")


def router_version() -> str:
    try:
        return metadata.version("expresslane-router")
    except metadata.PackageNotFoundError:
        return "unknown"


class Endpoints:
    """Handlers that need the pooled client; built once in the lifespan."""

    def __init__(self, config: RouterConfig, client: httpx.AsyncClient, secrets: RouterSecrets,
                 prefills: PrefillPool, clock: Callable[[], float] = time.monotonic,
                 report_failure: Callable[[str, str, str], None] = lambda url, kind, cause: None,
                 report_success: Callable[[str], None] = lambda url: None):
        self.config = config
        self.client = client
        self.secrets = secrets
        self.prefills = prefills
        self.report_failure = report_failure  # HealthMonitor.report_failure: outlier detection keeps the node's
        self.report_success = report_success  # HealthMonitor.report_success
        self.clock = clock
        self._model_card: dict[str, Any] | None = None
        self._model_card_at = 0.0

    def _timeout(self) -> httpx.Timeout:
        t = self.config.timeouts
        return httpx.Timeout(t.prefill_s, connect=t.connect_s)

    async def _on_member(self, path: str, body: dict[str, Any],
                         send: Callable[[str], Awaitable[httpx.Response]]) -> httpx.Response:
        """`send(member_url + path)` on a serving prefill member (the next one when it fails as a node does)."""
        async def attempt(base: str) -> httpx.Response:
            url = base + path
            try:
                try:
                    resp = await send(url)
                except httpx.HTTPError as e:
                    raise map_transport_error(e, stage="prefill", url=url) from None
                await check_status(resp, stage="prefill")
            except UpstreamError as e:
                self.report_failure(base, e.kind, e.message)  # outlier detection keeps only the node's failures
                raise
            self.report_success(base)
            return resp

        return await self.prefills.run(body, attempt, retry=member_failed, leg=False)

    async def _get(self, path: str) -> httpx.Response:
        t = self.config.timeouts.connect_s
        return await self._on_member(path, {}, lambda url: self.client.get(
            url, headers=self.secrets.upstream_headers("vllm"), timeout=httpx.Timeout(t, connect=t)))

    # ---- models -----------------------------------------------------------------------------------
    async def served_model_card(self) -> dict[str, Any]:
        """The prefill's own /v1/models entry for the served model (cached `capabilities.refresh_s`)."""
        if self._model_card is not None and self.clock() - self._model_card_at < self.config.capabilities.refresh_s:
            return self._model_card
        data = read_json(await self._get("/v1/models"), stage="prefill")
        for m in data.get("data") or []:
            if isinstance(m, dict) and m.get("id") == self.config.prefill.model:
                self._model_card, self._model_card_at = m, self.clock()
                return m
        raise UpstreamError(f"the prefill's /v1/models does not list {self.config.prefill.model!r} "
                            "(prefill.model in the router config must be its --served-model-name)", stage="prefill")

    def _card(self, alias: str, served: dict[str, Any] | None, created: int) -> dict[str, Any]:
        cfg = self.config
        card: dict[str, Any] = {"id": alias, "object": "model", "created": created, "owned_by": "expresslane",
                                "root": cfg.prefill.model, "parent": None, "lane": cfg.pools[cfg.aliases[alias].pool].lane}
        if served is not None and isinstance(served.get("max_model_len"), int):
            card["max_model_len"] = served["max_model_len"]
        return card

    async def list_models(self) -> Response:
        try:
            served = await self.served_model_card()
        except RouterError as e:  # the listing itself needs no upstream; the card's length is left out
            log.warning("GET /v1/models: max_model_len unknown: %s", e.message)
            served = None
        created = int(time.time())
        return JSONResponse({"object": "list", "data": [self._card(a, served, created) for a in self.config.aliases]})

    async def retrieve_model(self, model_id: str) -> Response:
        if model_id not in self.config.aliases:
            raise ModelNotFound(f"The model `{model_id}` does not exist. Known models: "
                                f"{', '.join(self.config.aliases)}", param="model")
        return JSONResponse(self._card(model_id, await self.served_model_card(), int(time.time())))

    # ---- passthrough ------------------------------------------------------------------------------
    async def tokenizer_call(self, path: str, body: dict[str, Any]) -> Response:
        """/tokenize or /detokenize on the prefill, `model` = the served name (an alias, or absent)."""
        model = body.get("model")
        if model is not None:
            if not isinstance(model, str):
                raise BadRequest("'model' must be a string", param="model")
            if model not in self.config.aliases:
                raise ModelNotFound(f"The model `{model}` does not exist. Known models: "
                                    f"{', '.join(self.config.aliases)}", param="model")
        out = dict(body, model=self.config.prefill.model)
        resp = await self._on_member(path, out, lambda url: self.client.post(
            url, json=out, headers=self.secrets.upstream_headers("vllm"), timeout=self._timeout()))
        return JSONResponse(read_json(resp, stage="prefill"))

    async def version(self) -> Response:
        data = read_json(await self._get("/version"), stage="prefill")
        return JSONResponse({**data, "router_version": router_version()})
