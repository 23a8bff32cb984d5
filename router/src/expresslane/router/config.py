"""The router's one typed configuration, loaded from YAML with `${VAR:-default}` interpolation.

The environment is read in exactly one place: the entrypoint passes `os.environ` to `load_config`.
Everything below that works on the typed `RouterConfig`.

Interpolation (applied to the raw YAML text before parsing, so unquoted values keep their YAML type:
`port: ${PORT:-8080}` is an int, `"${HOST:-x}"` a string; full-line `#` comments are left alone):
  `${VAR}`            value of VAR; an error if VAR is unset (fail loudly, not with an empty string)
  `${VAR:-default}`   VAR if set and non-empty, else `default`
  `${VAR-default}`    VAR if set (even empty), else `default`
  `$$`                a literal `$`

Schema (see compose/config/router.yaml for a commented example):
  listen:        {host, port}
                 (client API keys are NOT in this file: ROUTER_API_KEYS / ROUTER_API_KEY(_FILE), see auth.py)
  limits:        {max_body_bytes, max_json_depth}: 413 / 400 beyond them (limits.py)
  capabilities:  {refresh_s, retry_s}: how long an express node's GET /capabilities answer is cached, and how
                 soon a failed fetch is tried again (capabilities.py)
  prefill:       {url | nodes? dns?, model, affinity?}   the stock vLLM prefill server(s) and the model name they
                 serve. `url` alone = one prefill. A pool (instead of url): `nodes` (static URLs) and/or `dns`
                 ({name, port, scheme, refresh_s}: every A record of `name`, re-resolved every refresh_s,
                 discovery.py). Side calls (/v1/models, /tokenize, /version) go to a serving member, chosen as for
                 requests (endpoints.py). `affinity` ({prefix_chars, max_imbalance}): how a member is chosen per
                 request (pools.py)
  tokenizer_dir: model directory (tokenizer.json, generation_config.json); needed by express pools
  max_model_len: optional; default max_tokens on the express lane = max_model_len - prompt_tokens.
                 Unset = asked once from the prefill's /v1/models.
  tool_call_parser: the vLLM servers' --tool-call-parser (default hermes; null = off), see tools.py
  return_tokens_as_token_ids: the native decode servers' --return-tokens-as-token-ids (logprobs token names)
  timeouts:      {connect_s, prefill_s, decode_s, kv_wait_s, cancel_s, upstream_keepalive_s}
  pools:         name -> native pool {kind: native, nodes: [url...], dns?: {name, port, ...}, model?}
                      | express pool {kind: expresslane|tilert, nodes: [{url, ctrl_host, ctrl_port}],
                                      dns?: {name, port, ctrl_port, scheme, refresh_s} (each address one node:
                                      /pd/* at address:port, control plane at address:ctrl_port),
                                      queue: {max_waiting, max_wait_s, when_full, spill_to, retry_after_s},
                                      busy_retries}
  aliases:       alias -> {pool, queue?, unsupported?}   (the alias is the `model` clients send; `queue`
                 overrides the pool's queue policy for this alias; `unsupported: native | refuse` (default
                 native) says what an express request asking for a feature its node cannot do gets: served by
                 the native lane, or a 400 naming the feature)
  lanes:         optional {native: pool, express: pool}: the pool an `X-Lane` header override uses when
                 the alias's own pool is of the other lane (default: the first pool of that lane).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal, Union
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .fleet.outlier import OutlierConfig  # ejection by the request path's outcomes (fleet/outlier.py)
from .resilience import HealthConfig, ResilienceConfig  # probes, panic, deadlines, retries (fleet/health.py, lanes/)

__all__ = [
    "Affinity",
    "ConfigError",
    "DnsMembers",
    "ExpressDns",
    "ExpressNode",
    "ExpressPool",
    "Lane",
    "NativePool",
    "QueueConfig",
    "Limits",
    "RouterConfig",
    "UpstreamPools",
    "interpolate",
    "load_config",
    "parse_config",
]

Lane = Literal["native", "express"]
LANES: tuple[str, ...] = ("native", "express")


class ConfigError(ValueError):
    """The router configuration is unusable; the message says which key and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _strip_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not re.match(r"^https?://[^/\s]+", url):
        raise ValueError(f"{url!r} is not an http(s) URL")
    return url


class Listen(_Strict):
    host: str = "0.0.0.0"
    port: int = Field(8080, ge=0, le=65535)
    # How long an idle client connection is kept open (uvicorn's timeout_keep_alive; never a connection with a
    # request in flight). Longer than any client's own idle expiry (httpx and the openai SDK: 5 s), as load
    # balancers do (nginx 75 s, AWS ALB 60 s): a client reusing an idle connection never races the server's close.
    keepalive_timeout_s: float = Field(75.0, ge=1)


class UpstreamPools(_Strict):
    """The router's own upstream connections: at most `max_connections` open per client (the one-shot calls; the
    streams); a call that finds none free within timeouts.connect_s is refused by the router itself (503
    router_saturated, `expresslane_router_upstream_pool_saturated_total`), never counted against a node. The
    health probes have their own pool (health.max_connections)."""

    max_connections: int = Field(512, ge=1)


class DnsMembers(_Strict):
    """A pool's members from DNS: every address `name` resolves to (a Kubernetes headless Service gives one A record
    per ready pod), as `scheme://address:port`, re-resolved every `refresh_s` (discovery.py)."""

    name: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    scheme: Literal["http", "https"] = "http"
    refresh_s: float = Field(10.0, gt=0)


class Affinity(_Strict):
    """How the prefill pool picks a member (pools.py): a consistent hash of the prompt's first `prefix_chars`
    characters names the preferred member (a conversation's next turn finds its prefix in that member's cache);
    it is passed over for the least loaded one when it is down or has `max_imbalance` more prefills in flight."""

    prefix_chars: int = Field(256, ge=1)
    max_imbalance: int = Field(4, ge=0)


class Prefill(_Strict):
    url: str | None = None
    model: str = Field(min_length=1)
    nodes: list[str] = Field(default_factory=list)
    dns: DnsMembers | None = None
    affinity: Affinity = Affinity()

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return None if v is None else _strip_url(v)

    @model_validator(mode="after")
    def _has_members(self) -> "Prefill":
        pool = bool(self.nodes) or self.dns is not None
        if self.url is None and not pool:
            raise ValueError("prefill needs url (one server), nodes (a list of URLs) or dns (a name to resolve)")
        if self.url is not None and pool:
            raise ValueError("prefill: url is the one prefill server; a pool (nodes and/or dns) lists every member "
                             "there instead (side calls such as /v1/models go to a serving member): remove url, "
                             "or put it under nodes")
        return self

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, v: list[str]) -> list[str]:
        return [_strip_url(u) for u in v]

    @property
    def static_nodes(self) -> list[str]:
        """The pool's fixed members: `nodes`, else `url` alone when no DNS name is given either."""
        if self.nodes or self.dns is not None:
            return list(self.nodes)
        assert self.url is not None
        return [self.url]


class Timeouts(_Strict):
    connect_s: float = Field(5.0, gt=0)
    prefill_s: float = Field(300.0, gt=0)
    decode_s: float = Field(600.0, gt=0)
    # `timeout_s` sent to an express node: how long it waits for the KV to arrive.
    kv_wait_s: float = Field(15.0, gt=0)  # router-path: was 120 (a prefill failure now reaches the node at once)
    # Budget for POST /pd/cancel on client disconnect (the node is released after it either way).
    cancel_s: float = Field(1.0, gt=0)
    # An idle upstream connection is reused only this long (both clients). It must stay well under the upstreams'
    # own idle close (uvicorn's timeout_keep_alive: 5 s in vLLM and the express node): the router's idle clock
    # starts when it has READ a reply, the server's when it SENT it, so a busy router sees a connection younger
    # than the server does; at equal values (as before) a POST went out on a connection the server was closing
    # and failed with "Server disconnected" (docs/operations.md, "Transport errors under bursts").
    upstream_keepalive_s: float = Field(2.0, gt=0, le=4.0)


class QueueConfig(_Strict):
    """What an express request does while every node of its pool is busy."""

    max_waiting: int = Field(16, ge=0)
    max_wait_s: float = Field(10.0, ge=0)
    when_full: Literal["spill", "reject"] = "reject"
    spill_to: str | None = None
    retry_after_s: int = Field(1, ge=0)

    @model_validator(mode="after")
    def _spill_needs_target(self) -> "QueueConfig":
        if self.when_full == "spill" and not self.spill_to:
            raise ValueError("when_full: spill needs spill_to (a native pool)")
        return self


class NativePool(_Strict):
    kind: Literal["native"]
    nodes: list[str] = Field(default_factory=list)
    dns: DnsMembers | None = None  # members from DNS as well (discovery.py)
    model: str | None = None  # the name the decode nodes serve; default: prefill.model

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, v: list[str]) -> list[str]:
        return [_strip_url(u) for u in v]

    @model_validator(mode="after")
    def _has_members(self) -> "NativePool":
        if not self.nodes and self.dns is None:
            raise ValueError("a native pool needs nodes (a list of URLs) or dns (a name to resolve), or both")
        return self

    @property
    def lane(self) -> Lane:
        return "native"


class ExpressNode(_Strict):
    url: str  # HTTP base of the node's /pd/* contract
    ctrl_host: str = Field(min_length=1)  # where the prefill's connector reaches its control plane
    ctrl_port: int = Field(ge=1, le=65535)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _strip_url(v)

    @property
    def name(self) -> str:
        return self.url.split("://", 1)[1]


class ExpressDns(DnsMembers):
    """An express pool's nodes from DNS: every address `name` resolves to is one node, its /pd/* contract at
    `scheme://address:port` and its control plane at `address:ctrl_port` (what the router tells the prefill)."""

    ctrl_port: int = Field(ge=1, le=65535)


class ExpressPool(_Strict):
    kind: Literal["expresslane", "tilert"]
    nodes: list[ExpressNode] = Field(default_factory=list)
    dns: ExpressDns | None = None  # nodes from DNS as well (discovery.py); each A record is one node
    queue: QueueConfig = QueueConfig()
    busy_retries: int = Field(3, ge=0)  # node answered 429: requeue at most this many times

    @model_validator(mode="after")
    def _has_members(self) -> "ExpressPool":
        if not self.nodes and self.dns is None:
            raise ValueError("an express pool needs nodes (url, ctrl_host, ctrl_port each) or dns (a name to "
                             "resolve, with port and ctrl_port), or both")
        return self

    @property
    def lane(self) -> Lane:
        return "express"

    def dns_node(self, url: str) -> ExpressNode:
        """The node behind a DNS member URL (`scheme://address:port`): its control plane at address:ctrl_port."""
        assert self.dns is not None
        host = urlsplit(url).hostname
        assert host is not None, url
        return ExpressNode(url=url, ctrl_host=host, ctrl_port=self.dns.ctrl_port)


Pool = Annotated[Union[NativePool, ExpressPool], Field(discriminator="kind")]


class Alias(_Strict):
    pool: str
    queue: QueueConfig | None = None
    unsupported: Literal["native", "refuse"] = "native"


class Limits(_Strict):
    """Bounds on what a client may send (enforced before anything is parsed)."""

    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    max_json_depth: int = Field(64, ge=2, le=1000)


class CapabilityRefresh(_Strict):
    refresh_s: float = Field(60.0, gt=0)  # a node's /capabilities answer is reused this long
    retry_s: float = Field(5.0, gt=0)  # after a failed fetch, the next request tries again after this


class RouterConfig(_Strict):
    listen: Listen = Listen()
    limits: Limits = Limits()
    capabilities: CapabilityRefresh = CapabilityRefresh()
    prefill: Prefill
    tokenizer_dir: str | None = None
    max_model_len: int | None = Field(None, gt=0)
    # The vLLM servers' --tool-call-parser (scripts/launch/common.sh VLLM_TOOL_CALL_PARSER, default hermes; null =
    # tool calling off): the express lane parses tool calls as that parser does (tools.py supports hermes; any
    # other name = the express lane lacks `tools`, capability routing sends such requests native).
    tool_call_parser: str | None = "hermes"
    # Whether the native decode servers run with --return-tokens-as-token-ids: express logprobs then name tokens
    # `token_id:N` as they do (a request's own return_tokens_as_token_ids wins, as in vLLM).
    return_tokens_as_token_ids: bool = False
    timeouts: Timeouts = Timeouts()
    upstream: UpstreamPools = UpstreamPools()
    pools: dict[str, Pool] = Field(min_length=1)
    aliases: dict[str, Alias] = Field(min_length=1)
    lanes: dict[Lane, str] = Field(default_factory=dict)
    health: HealthConfig = HealthConfig()  # active health checking, panic routing (resilience.py, fleet/health.py)
    outlier: OutlierConfig = OutlierConfig()  # outlier detection (fleet/outlier.py)
    resilience: ResilienceConfig = ResilienceConfig()  # router-path (resilience.py)

    @field_validator("tool_call_parser")
    @classmethod
    def _no_empty_parser(cls, v: str | None) -> str | None:
        return v.strip() or None if isinstance(v, str) else v  # VLLM_TOOL_CALL_PARSER="" turns tool calling off

    @model_validator(mode="after")
    def _check_references(self) -> "RouterConfig":
        for name, alias in self.aliases.items():
            if alias.pool not in self.pools:
                raise ValueError(f"alias {name!r}: unknown pool {alias.pool!r} (pools: {sorted(self.pools)})")
            if alias.queue is not None and self.pools[alias.pool].lane != "express":
                raise ValueError(f"alias {name!r}: a queue policy only applies to an express pool")
            if (alias.unsupported == "native" and self.pools[alias.pool].lane == "express"
                    and self.lane_pool("native") is None):
                raise ValueError(f"alias {name!r}: unsupported: native needs a native pool (or write "
                                 "unsupported: refuse)")
        for lane, pool in self.lanes.items():
            if pool not in self.pools or self.pools[pool].lane != lane:
                raise ValueError(f"lanes.{lane}: {pool!r} is not a configured {lane} pool")
        queues = [(f"pools.{n}.queue", p.queue) for n, p in self.pools.items() if isinstance(p, ExpressPool)]
        queues += [(f"aliases.{n}.queue", a.queue) for n, a in self.aliases.items() if a.queue is not None]
        for where, q in queues:
            if q.spill_to is not None:
                target = self.pools.get(q.spill_to)
                if target is None or target.lane != "native":
                    raise ValueError(f"{where}.spill_to: {q.spill_to!r} is not a configured native pool")
        if any(p.lane == "express" for p in self.pools.values()) and not self.tokenizer_dir:
            raise ValueError("an express pool needs tokenizer_dir (the router detokenizes the express lane)")
        return self

    # ---- lookups used by the app ------------------------------------------------------------
    def lane_pool(self, lane: str) -> str | None:
        """The pool an `X-Lane: <lane>` override lands on when the alias's own pool is the other lane."""
        if lane in self.lanes:
            return self.lanes[lane]
        return next((n for n, p in self.pools.items() if p.lane == lane), None)

    def queue_for(self, alias: str | None, pool: str) -> QueueConfig:
        a = self.aliases.get(alias) if alias else None
        if a is not None and a.queue is not None and a.pool == pool:
            return a.queue
        p = self.pools[pool]
        return p.queue if isinstance(p, ExpressPool) else QueueConfig()

    def native_model(self, pool: str) -> str:
        p = self.pools[pool]
        return (p.model if isinstance(p, NativePool) and p.model else None) or self.prefill.model


_VAR = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose-style `${VAR}`, `${VAR:-default}`, `${VAR-default}` and `$$` substitution."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group("name"), m.group("op"), m.group("default")
        value = env.get(name)
        if op == ":-":
            return value if value else default
        if op == "-":
            return value if value is not None else default
        if value is None:
            raise ConfigError(f"${{{name}}} is not set (write ${{{name}:-default}} to give a default)")
        return value

    return "".join(line if line.lstrip().startswith("#") else _VAR.sub(sub, line)
                   for line in text.splitlines(keepends=True))


def parse_config(data: object, *, source: str = "<config>") -> RouterConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    if "api_key" in data:
        raise ConfigError(f"{source}: api_key is no longer read from the config file (a secret must not be "
                          "pasted into YAML text): remove it and set ROUTER_API_KEYS or ROUTER_API_KEYS_FILE "
                          "(one key per line; ROUTER_API_KEY still works) in the router's environment")
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"  {loc}: {err['msg']}")
        raise ConfigError(f"{source}: invalid router config:\n" + "\n".join(lines)) from None


def load_config(path: str | Path, env: Mapping[str, str]) -> RouterConfig:
    """Read `path`, interpolate it with `env`, validate it. Errors name the file and the key."""
    path = Path(path)
    try:
        raw = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read router config {path}: {e}") from None
    text = interpolate(raw, env)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML after interpolation: {e}") from None
    return parse_config(data, source=str(path))
