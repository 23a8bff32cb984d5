"""The connector's typed config, built once at construction from kv_connector_extra_config (unknown keys
are an error) and the process environment (the peer secret and the destination allow-list; read only
here, never from the per-request params)."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from expresslane.engine.secrets import PEER_SECRET, read_secret

logger = logging.getLogger(__name__)

ALLOWED_DESTINATIONS_ENV = "EXPRESSLANE_ALLOWED_DESTINATIONS"


class BadDestination(ValueError):
    """An entry of the destination allow-list that is not ``host:port`` or ``CIDR:port``."""


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_destinations(value: str | list | tuple) -> frozenset[tuple[str | Network, int]]:
    """``"host:port,10.244.0.0/16:port,[fd00::/64]:port"`` (or a list of them) -> {(host or network, port)}.
    A host with a ``/`` is a network (strict: no host bits set). Raises BadDestination naming the entry."""
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else [str(v).strip() for v in value]
    out: set[tuple[str | Network, int]] = set()
    for item in filter(None, items):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise BadDestination(f"bad destination {item!r} in the express-lane allow-list: want host:port "
                                 "or CIDR:port")
        host = host.strip("[]")
        if "/" in host:
            try:
                out.add((ipaddress.ip_network(host, strict=True), int(port)))
            except ValueError as e:
                raise BadDestination(f"bad destination {item!r} in the express-lane allow-list: {e}") from None
        else:
            out.add((host, int(port)))
    return frozenset(out)


@dataclass(frozen=True)
class ExpressLaneConnectorConfig:
    metrics_port: int | None = None     # Prometheus endpoint of the worker: port + global rank; None: off
    metrics_host: str = "0.0.0.0"
    staging_slots: int = 2              # requests that may be in flight (staged, not yet acked) per rank
    staging_max_tokens: int | None = None  # longest shippable prompt; None: the model's max_model_len
    staging_device: str = "cpu"         # "cpu" (pinned when the KV cache is on CUDA) or "device"
    nixl_backends: tuple[str, ...] = ("UCX",)
    connect_timeout_s: float = 3.0
    connect_retries: int = 2
    io_timeout_s: float = 10.0
    write_timeout_s: float = 30.0
    busy_retry_s: float = 10.0
    checksum: bool = True               # crc32 of the staged bytes in every done (the node verifies it)
    # host:port (or network:port) of the express nodes this prefill may send KV to; empty: any (warned at start)
    expresslane_allowed_destinations: frozenset[tuple[str | Network, int]] = frozenset()
    # CPU backend: put the forward thread back on its OpenMP core after NixlConnector moved it (cpu_affinity.py)
    restore_omp_affinity: bool = True
    peer_secret: bytes | None = field(default=None, repr=False)  # from the environment only

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None,
                          env: Mapping[str, str] | None = None) -> "ExpressLaneConnectorConfig":
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)} - {"peer_secret"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"ExpressLaneConnector: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(known)}")
        if "nixl_backends" in extra:
            extra["nixl_backends"] = tuple(extra["nixl_backends"])
        allowed = parse_destinations(extra.pop("expresslane_allowed_destinations", ()))
        if env is not None and env.get(ALLOWED_DESTINATIONS_ENV):
            allowed |= parse_destinations(env[ALLOWED_DESTINATIONS_ENV])
        cfg = cls(**extra, expresslane_allowed_destinations=allowed)
        if env is not None:
            secret = read_secret(PEER_SECRET, env)
            cfg = replace(cfg, peer_secret=secret.encode() if secret else None)
        if cfg.staging_slots < 1:
            raise ValueError("ExpressLaneConnector: staging_slots must be >= 1")
        if cfg.staging_device not in ("cpu", "device"):
            raise ValueError("ExpressLaneConnector: staging_device must be 'cpu' or 'device'")
        if cfg.metrics_port is not None and not 0 < int(cfg.metrics_port) < 65536:
            raise ValueError(f"ExpressLaneConnector: bad metrics_port {cfg.metrics_port}")
        return cfg

    def allows(self, host: str, port: int) -> bool:
        """An exact host:port entry, or an IP address inside a network entry (a hostname never matches a
        network: no DNS lookup here)."""
        allowed = self.expresslane_allowed_destinations
        if not allowed or (host, port) in allowed:
            return True
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return False
        return any(p == port and not isinstance(h, str) and ip in h for h, p in allowed)

    def warn_if_open(self) -> None:
        if not self.expresslane_allowed_destinations:
            logger.warning("expresslane connector: no destination allow-list (%s / kv_connector_extra_config "
                           "expresslane_allowed_destinations): KV may be sent to any host:port a request names",
                           ALLOWED_DESTINATIONS_ENV)
        if self.peer_secret is None:
            logger.warning("expresslane connector: %s is not set: the KV control plane is unauthenticated",
                           PEER_SECRET)
