"""One mapping of an upstream's failure to the router's typed errors (errors.py), for every client and leg.

connect refused / DNS                  -> UpstreamUnavailable (503)
the router's own pool had no free slot -> RouterSaturated (503, kind router_saturated: never the node's fault)
read/write/connect timeout             -> UpstreamTimeout (504)
4xx                                    -> UpstreamRejected (relayed unchanged)
503                                    -> UpstreamUnavailable
other non-2xx, non-JSON 2xx, bad shape -> UpstreamError (502)

`map_transport_error` maps a transport failure (httpx's exception types name it, whichever client raised it);
`status_error` and `json_object` are the one mapping of a reply.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from ..errors import RouterSaturated, UpstreamError, UpstreamRejected, UpstreamTimeout, UpstreamUnavailable

__all__ = ["check_status", "json_object", "map_transport_error", "read_json", "status_error", "total_timeout_error"]


def map_transport_error(exc: httpx.HTTPError, *, stage: str, url: str) -> UpstreamError:
    if isinstance(exc, httpx.PoolTimeout):
        return RouterSaturated(f"{stage}: the router has no free upstream connection now ({exc}); retry later",
                               stage=stage)
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"{stage}: {url} did not answer in time ({type(exc).__name__})",
                               stage=stage, kind="timeout")
    if isinstance(exc, httpx.ConnectError):
        return UpstreamUnavailable(f"{stage}: cannot connect to {url} ({exc or type(exc).__name__})",
                                   stage=stage, kind="connect")
    return UpstreamError(f"{stage}: {url} failed: {type(exc).__name__}: {exc}", stage=stage, kind="transport")


def status_error(status: int, content: bytes, content_type: str | None, *, stage: str) -> UpstreamError | None:
    """The mapped error of a reply's status, None for a 2xx."""
    if 200 <= status < 300:
        return None
    if 400 <= status < 500:
        return UpstreamRejected(status, content, content_type, stage=stage)
    detail = content[:300].decode("utf-8", "replace")
    cls = UpstreamUnavailable if status == 503 else UpstreamError
    return cls(f"{stage}: upstream answered {status}: {detail}", stage=stage, kind=f"http_{status}")


async def check_status(resp: httpx.Response, *, stage: str) -> None:
    """Raise the mapped error for a non-2xx reply (reads the body of a streamed reply first)."""
    if resp.is_success:
        return
    content = await resp.aread()
    err = status_error(resp.status_code, content, resp.headers.get("content-type"), stage=stage)
    if err is not None:
        raise err


def json_object(content: bytes, *, stage: str) -> dict[str, Any]:
    """A reply body that must be one JSON object (UpstreamError otherwise)."""
    try:
        data = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        raise UpstreamError(f"{stage}: upstream reply is not JSON", stage=stage) from None
    if not isinstance(data, dict):
        raise UpstreamError(f"{stage}: upstream reply is not a JSON object", stage=stage)
    return data


def read_json(resp: httpx.Response, *, stage: str) -> dict[str, Any]:
    return json_object(resp.content, stage=stage)


def total_timeout_error(url: str, total: float | None, *, stage: str) -> UpstreamTimeout:
    return UpstreamTimeout(f"{stage}: {url} did not answer within {total:g}s", stage=stage, kind="timeout")
