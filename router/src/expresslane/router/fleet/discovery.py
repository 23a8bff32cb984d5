"""Pool membership: the member URLs of the prefill pool and of each native and express pool, from a static list
and/or DNS. An express pool's DNS member is one node: `scheme://address:port` for its /pd/* contract, its control
plane at `address:ctrl_port` (config.ExpressPool.dns_node); the express lane adds and drains its gate's nodes as
members come and go (lanes/express.py).

A DNS pool (config `dns: {name, port, scheme, refresh_s}`) is every address `name` resolves to (a Kubernetes
headless Service answers one A record per ready pod), as `scheme://address:port`, resolved with the event loop's
`getaddrinfo` (never blocking the loop) before the router serves and again every `refresh_s`, so scaling a pool is
a scale command, not a router restart. Static `nodes` are always members.

What a resolution can end in (`DnsState`):
    RESOLVED   the answer replaced the DNS members (sorted, de-duplicated)
    EMPTY      the name exists no more or has no address (EAI_NONAME / EAI_NODATA): the DNS members are none. A
               headless Service without a ready pod answers so: the pool is truly empty, and says so (/ready)
    FAILED     any other failure (resolver down, timeout): the last answer is kept, a warning is logged and
               `expresslane_router_pool_dns_failures_total{pool}` counts it (a resolver hiccup must not empty a
               serving pool); before any answer there is nothing to keep, so the pool has its static nodes only

Every change of membership calls the listeners with (pool, added, removed): the health monitor starts / stops
probing those URLs. `expresslane_router_pool_members{pool}` is the current member count.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable

from typing import TYPE_CHECKING

from ..config import DnsMembers, ExpressPool, NativePool, RouterConfig
from ..metrics import PREFILL_POOL

if TYPE_CHECKING:
    from prometheus_client import Counter

    from ..metrics import RouterMetrics

__all__ = ["DnsState", "Membership", "PoolMembers", "PREFILL_POOL", "Resolver", "resolve_addresses"]

log = logging.getLogger("expresslane.router.fleet.discovery")


# (host, port) -> addresses; the default asks the event loop's getaddrinfo.
Resolver = Callable[[str, int], Awaitable[list[str]]]
Listener = Callable[[str, list[str], list[str]], None]

_NO_ADDRESS = {getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, n)}


class DnsState(enum.Enum):
    UNRESOLVED = "unresolved"
    RESOLVED = "resolved"
    EMPTY = "empty"
    FAILED = "failed"


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address of `host` (A and AAAA records), sorted; [] when the name has no address."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        if e.errno in _NO_ADDRESS:
            return []
        raise
    return sorted({info[4][0] for info in infos})


def member_url(scheme: str, address: str, port: int) -> str:
    try:
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    except ValueError:
        host = address
    return f"{scheme}://{host}:{port}"


class PoolMembers:
    """The current members of one pool. `urls()` is a plain read (the hot path); `refresh()` resolves once."""

    def __init__(self, pool: str, static: Iterable[str], dns: DnsMembers | None, *, resolver: Resolver,
                 on_change: Callable[[list[str], list[str]], None], failures: "Counter | None" = None) -> None:
        self.pool = pool
        self.static = list(dict.fromkeys(static))
        self.dns = dns
        self.state = DnsState.UNRESOLVED if dns is not None else DnsState.RESOLVED
        self._resolver = resolver
        self._on_change = on_change
        self._failures = failures
        self._dns_urls: list[str] = []
        self._urls = list(self.static)

    def urls(self) -> list[str]:
        return self._urls

    async def refresh(self) -> DnsState:
        """Resolve the DNS name once and apply the answer (see the module docstring for the outcomes)."""
        dns = self.dns
        if dns is None:
            return self.state
        try:
            addresses = await self._resolver(dns.name, dns.port)
        except (OSError, UnicodeError) as e:  # socket.gaierror is an OSError
            self.state = DnsState.FAILED
            if self._failures is not None:
                self._failures.labels(self.pool).inc()
            log.warning("pool %s: resolving %s failed (%s); keeping its %d member(s)", self.pool, dns.name, e,
                        len(self._urls))
            return self.state
        before, self.state = self.state, DnsState.RESOLVED if addresses else DnsState.EMPTY
        if self.state is DnsState.EMPTY and before is not DnsState.EMPTY:
            log.warning("pool %s: %s has no address (no ready member?)", self.pool, dns.name)
        self._apply([member_url(dns.scheme, a, dns.port) for a in addresses])
        return self.state

    def _apply(self, dns_urls: list[str]) -> None:
        new = list(dict.fromkeys(self.static + sorted(set(dns_urls))))
        added = [u for u in new if u not in self._urls]
        removed = [u for u in self._urls if u not in new]
        self._dns_urls = dns_urls
        if added or removed:
            log.warning("pool %s: members now %s (added %s, removed %s)", self.pool, new, added, removed)
            self._urls = new
            self._on_change(added, removed)

    async def run(self) -> None:
        """Re-resolve every refresh_s, forever (the owner cancels it)."""
        assert self.dns is not None
        while True:
            await asyncio.sleep(self.dns.refresh_s)
            try:
                await self.refresh()
            except Exception:  # a bug must not stop discovery
                log.exception("pool %s: discovery round failed", self.pool)


class Membership:
    """Every pool's members: the prefill pool (key PREFILL_POOL) and each native and express pool (its config
    name; an express pool's members are its nodes' URLs)."""

    def __init__(self, config: RouterConfig, metrics: "RouterMetrics", *,
                 resolver: Resolver = resolve_addresses) -> None:
        self._listeners: list[Listener] = []
        self.gauge = metrics.pool_members  # (the app's one registry: metrics.py)
        failures = metrics.pool_dns_failures
        specs: dict[str, tuple[list[str], DnsMembers | None]] = {
            PREFILL_POOL: (config.prefill.static_nodes, config.prefill.dns)}
        for name, pool in config.pools.items():
            if isinstance(pool, NativePool):
                specs[name] = (pool.nodes, pool.dns)
            elif isinstance(pool, ExpressPool):
                specs[name] = ([n.url for n in pool.nodes], pool.dns)
        self.pools: dict[str, PoolMembers] = {}
        for name, (static, dns) in specs.items():
            self.pools[name] = PoolMembers(name, static, dns, resolver=resolver, failures=failures,
                                           on_change=self._changed(name))
            self.gauge.labels(name).set(len(self.pools[name].urls()))

    def urls(self, pool: str) -> list[str]:
        return self.pools[pool].urls()

    def on_change(self, listener: Listener) -> None:
        """listener(pool, added, removed) after every membership change."""
        self._listeners.append(listener)

    def _changed(self, pool: str) -> Callable[[list[str], list[str]], None]:
        def changed(added: list[str], removed: list[str]) -> None:
            self.gauge.labels(pool).set(len(self.pools[pool].urls()))
            for listener in self._listeners:
                listener(pool, added, removed)
        return changed

    async def refresh_all(self) -> None:
        await asyncio.gather(*(p.refresh() for p in self.pools.values() if p.dns is not None))

    @contextlib.asynccontextmanager
    async def running(self):
        """Resolve every DNS pool once (so the first request has members), then keep them fresh in the background."""
        await self.refresh_all()
        tasks = [asyncio.create_task(p.run()) for p in self.pools.values() if p.dns is not None]
        try:
            yield self
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
