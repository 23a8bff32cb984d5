"""Capability routing: which request features each lane can honour, and where a request that needs more goes.

Feature data, one source for the router's decisions and for docs/api.md's compatibility table:
- native pools: everything the stock vLLM decode serves (`NATIVE`; only `n` > 1 is refused, by the router itself:
  a disaggregated request returns one choice);
- `kind: expresslane` pools: the node's own `GET /capabilities` answer, its `features` map (docs/api.md),
  fetched with the node token, cached `capabilities.refresh_s` (a failed fetch is retried after `retry_s`).
  `EXPRESSLANE_ENGINE` is what our engine's node honours at this commit (a test checks it against the engine's
  sampler); it stands in, with a warning in the log, for a node that cannot be asked or sends no `features`
  (an older node);
- `kind: tilert` pools: the static `TILERT` table (what the router drives through TileRT's /pd/decode contract,
  docs/api.md: sampling {temperature, top_p, top_k, repetition_penalty, presence_penalty,
  ignore_eos}; stop_token_ids enforced by the router).
A feature also has to pass the express lane's own relay check (`lanes.express.check_express_supported`).

Decision (`CapabilityRouter.route`), before any lane work: an express request that asks for a feature its pool
cannot honour is, per the alias's `unsupported` policy, served by the native lane (`native`, the default:
counted in `expresslane_router_capability_reroutes_total{alias,feature}`, the response says so in the
`X-Expresslane-Lane` and `X-Expresslane-Reroute` headers) or refused with a 400 naming the feature (`refuse`).
An explicit `X-Lane: express` is never rerouted: the client asked for that lane, so it gets the 400.

Seats: the same `GET /capabilities` answer says how many requests a `kind: expresslane` node serves at once
(top-level `"seats": S`, S >= 1; absent = 1, an older node). A `kind: tilert` node is one seat (TileRT's contract)
and is never asked. `running(nodes)` asks every expresslane node at start and keeps the answers fresh (refresh_s;
a failed fetch again after retry_s) in the background; `on_seats(callback)` hears every change of a node's known
seats (the express gate's capacity: gate.NodeGate.set_seats). A node not answered yet counts as one seat; a failed
fetch keeps the last known count. `expire(url)` makes the next round ask again (a node that refused a reservation
as busy while the router counted a free seat may have restarted with fewer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import Counter

from ..config import ExpressNode, ExpressPool, RouterConfig
from ..errors import BadRequest, UnsupportedFeature
from ..server.secrets import RouterSecrets

__all__ = ["CapabilityRouter", "EXPRESSLANE_ENGINE", "FEATURES", "NATIVE", "TILERT", "Feature", "Reroute",
           "compat_table", "requested_features", "reroute_counter", "seats_of"]

log = logging.getLogger("expresslane.router.fleet.capabilities")


def _on(v: Any, neutral: Any = 0) -> bool:
    """A field counts as asked for unless absent, null, false or its neutral value (odd types count: vLLM judges)."""
    if v is None or v is False:
        return False
    try:
        return bool(v != neutral)
    except Exception:  # noqa: BLE001  (an exotic value: let the native lane's vLLM judge it)
        return True


def _nonempty(v: Any) -> bool:
    return v is not None and v is not False and v != [] and v != {} and v != ""


def _logprobs(b: dict, chat: bool) -> bool:
    v = b.get("logprobs")
    return v is True if chat else (v is not None and v is not False)


def _top_logprobs(b: dict, chat: bool) -> bool:
    if chat:
        return _on(b.get("top_logprobs"))
    v = b.get("logprobs")
    return v is not True and _on(v)  # completions: logprobs=N > 0 asks for the top N


def _structured(b: dict, chat: bool) -> bool:
    rf = b.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text", "structural_tag"):
        return True
    if rf is not None and not isinstance(rf, dict):
        return True
    # The legacy guided_* fields are not here: vLLM 0.32 ignores them (structured.py), on both lanes alike.
    return _nonempty(b.get("structured_outputs"))


def _tools(b: dict, chat: bool) -> bool:
    return _nonempty(b.get("tools")) and b.get("tool_choice") != "none"


@dataclass(frozen=True)
class Feature:
    name: str
    fields: str  # the request fields, as docs/api.md shows them
    asked: Callable[[dict, bool], bool]
    param: str  # the field a 400 names


FEATURES: tuple[Feature, ...] = (
    Feature("logprobs", "`logprobs`", _logprobs, "logprobs"),
    Feature("top_logprobs", "`top_logprobs` (chat), `logprobs: N` (completions)", _top_logprobs, "top_logprobs"),
    Feature("prompt_logprobs", "`prompt_logprobs`", lambda b, c: b.get("prompt_logprobs") is not None,
            "prompt_logprobs"),
    Feature("echo", "`echo` (completions)", lambda b, c: _on(b.get("echo"), False), "echo"),
    Feature("structured_output", "`response_format` json_object / json_schema, `structured_outputs`",
            _structured, "response_format"),
    Feature("structural_tag", "`response_format` type structural_tag", lambda b, c: isinstance(
        b.get("response_format"), dict) and b["response_format"].get("type") == "structural_tag", "response_format"),
    Feature("tools", "`tools` with `tool_choice` other than `none` (hermes parser)", _tools, "tools"),
    Feature("n", "`n` > 1, `best_of` > 1", lambda b, c: _on(b.get("n"), 1) or _on(b.get("best_of"), 1), "n"),
    Feature("logit_bias", "`logit_bias`", lambda b, c: _nonempty(b.get("logit_bias")), "logit_bias"),
    Feature("min_p", "`min_p` > 0", lambda b, c: _on(b.get("min_p")), "min_p"),
    Feature("stop_token_ids", "`stop_token_ids`", lambda b, c: _nonempty(b.get("stop_token_ids")), "stop_token_ids"),
    Feature("min_tokens", "`min_tokens` > 0", lambda b, c: _on(b.get("min_tokens")), "min_tokens"),
    Feature("repetition_penalty", "`repetition_penalty` != 1", lambda b, c: _on(b.get("repetition_penalty"), 1),
            "repetition_penalty"),
    Feature("presence_penalty", "`presence_penalty` != 0", lambda b, c: _on(b.get("presence_penalty")),
            "presence_penalty"),
    Feature("frequency_penalty", "`frequency_penalty` != 0", lambda b, c: _on(b.get("frequency_penalty")),
            "frequency_penalty"),
    Feature("seed", "`seed`", lambda b, c: b.get("seed") is not None, "seed"),
    Feature("bad_words", "`bad_words`", lambda b, c: _nonempty(b.get("bad_words")), "bad_words"),
    Feature("allowed_token_ids", "`allowed_token_ids`", lambda b, c: _nonempty(b.get("allowed_token_ids")),
            "allowed_token_ids"),
    Feature("logprob_token_ids", "`logprob_token_ids`", lambda b, c: _nonempty(b.get("logprob_token_ids")),
            "logprob_token_ids"),
)
_BY_NAME = {f.name: f for f in FEATURES}
# A node's `features` key -> the router's feature names it covers (docs/api.md, the express node's `/capabilities`).
_NODE_KEYS = {"logprobs": ("logprobs",), "top_logprobs": ("top_logprobs",), "prompt_logprobs": ("prompt_logprobs",),
              "echo": ("echo",), "structured_output": ("structured_output",), "tools": ("tools",), "n": ("n",),
              "logit_bias": ("logit_bias",), "min_p": ("min_p",), "stop_token_ids": ("stop_token_ids",),
              "min_tokens": ("min_tokens",), "seed": ("seed",),
              "allowed_token_ids": ("allowed_token_ids",), "logprob_token_ids": ("logprob_token_ids",),
              "penalties": ("repetition_penalty", "presence_penalty", "frequency_penalty")}
# The relay check's `param` -> feature (lanes.express.check_express_supported names request fields).
_PARAM_FEATURE = {"structured_outputs": "structured_output", "response_format": "structured_output",
                  "best_of": "n"}

NATIVE: dict[str, bool] = {f.name: f.name != "n" for f in FEATURES}
# TileRT's /pd/decode `sampling` as the router sends it (lanes.express.SAMPLING_KEYS["tilert"], seed included);
# stop_token_ids are enforced by the router's detokenizer (TileRT refuses them per request).
TILERT: dict[str, bool] = {f.name: f.name in ("stop_token_ids", "repetition_penalty", "presence_penalty", "seed")
                           for f in FEATURES}


def features_from_node(node_features: dict[str, Any]) -> dict[str, bool]:
    """The router's feature map from a node's `features` (unknown keys ignored; missing keys = not honoured).
    `tools` is the router's work (tools.py parses the output) on top of the node's `structured_output` (the
    grammar of forced calls), so a node with structured output has tools; whether the configured parser is one
    the router speaks is the relay check's (express_options.check_express_supported)."""
    out = {f.name: False for f in FEATURES}
    for key, names in _NODE_KEYS.items():
        if node_features.get(key) is True:
            for n in names:
                out[n] = True
    if out["structured_output"]:
        out["tools"] = True
    return out


# What our engine's node announces at this commit (docs/api.md "The express node's HTTP API").
EXPRESSLANE_ENGINE: dict[str, bool] = features_from_node(
    {"logprobs": True, "top_logprobs": True, "structured_output": True, "tools": False, "n": False,
     "echo": False, "prompt_logprobs": False, "logit_bias": True, "min_p": True, "allowed_token_ids": True,
     "bad_words": False, "stop_token_ids": True, "min_tokens": True, "penalties": True, "seed": True,
     "speculative": False})


def requested_features(body: dict[str, Any], chat: bool) -> list[str]:
    return [f.name for f in FEATURES if f.asked(body, chat)]


@dataclass(frozen=True)
class Reroute:
    lane: str
    pool: str
    features: tuple[str, ...] = ()  # non-empty: served natively because the express pool lacks these

    @property
    def header(self) -> str:
        return "unsupported_feature:" + ",".join(self.features)


@dataclass
class _Entry:
    features: dict[str, bool] | None
    at: float
    why: str = ""
    seats: int | None = None  # None: the fetch failed (the last known count stays)


def seats_of(data: Any) -> tuple[int, str]:
    """(seats, problem) of a /capabilities answer: its top-level integer `seats` (>= 1), 1 when absent (an older
    node), 1 with a problem to log when it is not a positive integer."""
    v = data.get("seats") if isinstance(data, dict) else None
    if v is None:
        return 1, ""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        return 1, f"'seats' is {v!r}, not an integer >= 1: counting one seat"
    return v, ""


class CapabilityRouter:
    """Per-node capability cache plus the routing decision; one per app (built in the lifespan)."""

    def __init__(self, config: RouterConfig, client: httpx.AsyncClient, secrets: RouterSecrets, reroutes: Counter,
                 clock: Callable[[], float], relay_check: Callable[[dict, str], None] | None = None,
                 pool_nodes: Callable[[str], Sequence[ExpressNode]] | None = None):
        self.config = config
        # an express pool's current nodes (its gate's: static and DNS members); default: the configured ones
        self.pool_nodes = pool_nodes or (lambda pool: self.config.pools[pool].nodes)
        self.client = client
        self.secrets = secrets
        self.reroutes = reroutes  # reroute_counter(): built with the app's registry, in the factory
        self.clock = clock
        self.relay_check = relay_check
        self._cache: dict[str, _Entry] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._seats: dict[str, int] = {}  # url -> the last known count (a failed fetch keeps it)
        self._seat_listeners: list[Callable[[ExpressNode, int], None]] = []

    # ---- per-node features ------------------------------------------------------------------------
    @property
    def cached_nodes(self) -> list[str]:
        """The nodes whose answer (or failed fetch) is cached."""
        return sorted(self._cache)

    def forget(self, url: str) -> None:
        """A node left its pool (DNS): its cached answer goes, so a long-lived router's cache holds the current
        members only (a node that comes back at that address is asked again)."""
        self._cache.pop(url, None)
        self._locks.pop(url, None)  # a fetch still holding it keeps its own reference
        self._seats.pop(url, None)

    def expire(self, url: str) -> None:
        """Ask `url` again at the next chance (its cached answer is kept until then)."""
        e = self._cache.get(url)
        if e is not None:
            e.at = float("-inf")

    # ---- seats ----------------------------------------------------------------------------------------
    def node_seats(self, url: str) -> int:
        """The node's seats as last known; 1 until it answered."""
        return self._seats.get(url, 1)

    def on_seats(self, callback: Callable[[ExpressNode, int], None]) -> None:
        self._seat_listeners.append(callback)

    def _note_seats(self, node: ExpressNode, entry: _Entry) -> None:
        if entry.seats is None or self._seats.get(node.url) == entry.seats:
            return
        before = self._seats.get(node.url)
        self._seats[node.url] = entry.seats
        if before is not None or entry.seats != 1:
            log.warning("express node %s: %d seat(s)%s", node.url, entry.seats,
                        f" (was {before})" if before is not None else "")
        for cb in self._seat_listeners:
            cb(node, entry.seats)

    def _expresslane_nodes(self) -> list[ExpressNode]:
        return [n for name, p in self.config.pools.items() if isinstance(p, ExpressPool) and p.kind == "expresslane"
                for n in self.pool_nodes(name)]

    async def refresh(self) -> None:
        """Ask every expresslane node whose answer is not fresh (its features and seats), all at once."""
        await asyncio.gather(*(self.node_features(n) for n in self._expresslane_nodes()))

    @contextlib.asynccontextmanager
    async def running(self):
        """Ask every expresslane node at start (a node that does not answer yet counts as one seat), then keep the
        answers fresh in the background while the body runs."""
        async def loop() -> None:
            while True:
                await asyncio.sleep(min(self.config.capabilities.retry_s, self.config.capabilities.refresh_s))
                try:
                    await self.refresh()
                except Exception:  # a bug must not stop the refresh
                    log.exception("capability refresh failed")

        task = asyncio.create_task(self._first_then(loop))
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _first_then(self, loop: Callable[[], Awaitable[None]]) -> None:
        try:
            await self.refresh()
        except Exception:
            log.exception("capability refresh failed")
        await loop()

    async def node_features(self, node: ExpressNode) -> dict[str, bool] | None:
        entry = self._cache.get(node.url)
        if entry is not None and self._fresh(entry):
            return entry.features
        lock = self._locks.setdefault(node.url, asyncio.Lock())
        async with lock:
            entry = self._cache.get(node.url)
            if entry is None or not self._fresh(entry):
                entry = await self._fetch(node)
                old = self._cache.get(node.url)
                if entry.features is None and (old is None or old.why != entry.why):
                    log.warning("express node %s: capabilities unknown (%s); assuming what this router "
                                "version's expresslane engine honours", node.url, entry.why)
                self._cache[node.url] = entry
                self._note_seats(node, entry)
        return entry.features

    def _fresh(self, e: _Entry) -> bool:
        ttl = self.config.capabilities.refresh_s if e.features is not None else self.config.capabilities.retry_s
        return self.clock() - e.at < ttl

    async def _fetch(self, node: ExpressNode) -> _Entry:
        t = self.config.timeouts.connect_s
        url = node.url + "/capabilities"
        try:
            resp = await self.client.get(url, headers=self.secrets.upstream_headers("express"),
                                         timeout=httpx.Timeout(t, connect=t))
        except httpx.HTTPError as e:
            return _Entry(None, self.clock(), f"GET {url}: {type(e).__name__}")
        if resp.status_code != 200:
            return _Entry(None, self.clock(), f"GET {url} answered {resp.status_code}")
        try:
            data = resp.json()
        except ValueError:
            return _Entry(None, self.clock(), f"GET {url}: not JSON")
        seats, problem = seats_of(data)
        if problem:
            log.warning("express node %s: %s", node.url, problem)
        feats = data.get("features") if isinstance(data, dict) else None
        if not isinstance(feats, dict):
            return _Entry(None, self.clock(), f"GET {url}: no 'features' map (an older node?)", seats)
        return _Entry(features_from_node(feats), self.clock(), seats=seats)

    async def pool_features(self, pool: str) -> dict[str, bool]:
        p = self.config.pools[pool]
        if not isinstance(p, ExpressPool):
            return dict(NATIVE)
        if p.kind == "tilert":
            return dict(TILERT)
        out = {f.name: True for f in FEATURES}
        for node in self.pool_nodes(pool):  # any node may serve the request: a feature needs all of them
            feats = await self.node_features(node) or EXPRESSLANE_ENGINE
            for name in out:
                out[name] = out[name] and feats.get(name, False)
        return out

    # ---- the decision -----------------------------------------------------------------------------
    async def route(self, body: dict[str, Any], chat: bool, alias: str, lane: str, pool: str,
                    *, forced: bool) -> Reroute:
        if lane != "express":
            return Reroute(lane, pool)
        missing: list[str] = []
        if self.relay_check is not None:  # what the router's express lane cannot carry at all (no I/O)
            try:
                self.relay_check(body, self.config.pools[pool].kind)
            except BadRequest as e:
                missing = [getattr(e, "feature", None) or _PARAM_FEATURE.get(e.param or "", e.param or "unknown")]
        asked = requested_features(body, chat)
        if asked and not missing:
            have = await self.pool_features(pool)
            missing = [n for n in asked if not have.get(n, False)]
        if not missing:
            return Reroute(lane, pool)
        a = self.config.aliases.get(alias)
        kind = self.config.pools[pool].kind
        first = _BY_NAME.get(missing[0])
        if forced or a is None or a.unsupported == "refuse":
            how = ("the request sets 'X-Lane: express'" if forced else f"alias {alias!r} has unsupported: refuse")
            names = ", ".join(f"'{_BY_NAME[m].param}' ({m})" if m in _BY_NAME and _BY_NAME[m].param != m else f"'{m}'"
                              for m in missing)
            raise UnsupportedFeature(
                f"{names} {'is' if len(missing) == 1 else 'are'} not supported on the express lane (pool {pool!r}, "
                f"kind {kind}) and {how}; use a native model or send 'X-Lane: native'",
                param=first.param if first else missing[0])
        target = self._native_pool(alias)
        for m in missing:
            self.reroutes.labels(alias, m).inc()
        return Reroute("native", target, tuple(missing))

    def _native_pool(self, alias: str) -> str:
        a = self.config.aliases.get(alias)
        q = a.queue if a is not None else None
        if q is not None and q.spill_to:
            return q.spill_to
        target = self.config.lane_pool("native")
        assert target is not None, "config validation requires a native pool for unsupported: native"
        return target


def reroute_counter(config: RouterConfig, registry) -> Counter:
    """`expresslane_router_capability_reroutes_total{alias,feature}`, zeros created for the express aliases."""
    c = Counter("expresslane_router_capability_reroutes_total",
                "Express requests served by the native lane because their pool cannot honour a feature they ask for",
                ["alias", "feature"], registry=registry)
    for alias, a in config.aliases.items():
        if config.pools[a.pool].lane == "express" and a.unsupported == "native":
            for f in FEATURES:
                c.labels(alias, f.name)
    return c


def compat_table() -> str:
    """docs/api.md's compatibility table, generated from the data above."""
    def cell(v: bool) -> str:
        return "yes" if v else "no"
    rows = ["| feature | request fields | native | express (expresslane engine) | express (TileRT) |",
            "|---|---|---|---|---|"]
    for f in FEATURES:
        rows.append(f"| {f.name} | {f.fields} | {cell(NATIVE[f.name])} | {cell(EXPRESSLANE_ENGINE[f.name])} | "
                    f"{cell(TILERT[f.name])} |")
    return "\n".join(rows) + "\n"
