"""Bounds on client input, applied in the one place a request body is read and parsed.

- Body size: a `Content-Length` above `limits.max_body_bytes` is refused (413) before one byte is read; a body
  without a length (chunked) is read chunk by chunk and refused as soon as it passes the limit, so a 64 MiB body
  is never held whole.
- JSON nesting depth: measured on the raw bytes before `json.loads` (strings removed, `{}` read as `[]`, then the
  innermost pairs removed one level per pass with bytes.replace, all in C: ~0.1 s for a 16 MiB body), so a deeply nested body is a 400 naming the limit, never a
  RecursionError / 500. Depth 1 is `{"a": 1}`.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.requests import Request
from starlette.types import Receive

from ..errors import BadRequest, ClientGone, PayloadTooLarge
from ..json_codec import client_decoder

__all__ = ["json_depth_exceeds", "loads_object", "read_asgi_body", "read_body"]

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_ONE_KIND = bytes.maketrans(b"{}", b"[]")
_OPENERS = re.compile(rb"\[+")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, or PayloadTooLarge (413) as soon as it is known to exceed `max_bytes`."""
    return await read_asgi_body(request.receive, request.headers.get("content-length"), max_bytes)


async def read_asgi_body(receive: Receive, length: str | None, max_bytes: int) -> bytes:
    """The body of an ASGI request read from `receive` (its `Content-Length` header value, or None), or
    PayloadTooLarge (413) as soon as it is known to exceed `max_bytes`; ClientGone if the client leaves first."""
    if length is not None:
        if not length.strip().isdigit():
            raise BadRequest("Content-Length must be a non-negative integer", param="Content-Length")
        if int(length) > max_bytes:
            raise PayloadTooLarge(f"request body of {int(length)} bytes is larger than the limit of "
                                  f"{max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        kind = message["type"]
        if kind == "http.request":
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > max_bytes:
                    raise PayloadTooLarge(f"request body is larger than the limit of {max_bytes} bytes")
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        elif kind == "http.disconnect":
            raise ClientGone("client disconnected while sending the body")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def json_depth_exceeds(raw: bytes, max_depth: int) -> bool:
    """True when the JSON text nests arrays/objects deeper than `max_depth` (malformed text -> False: the
    parser reports it)."""
    # Brackets only, one kind (depth does not depend on the kind; a mismatch is the parser's to report).
    brackets = _STRING.sub(b"", raw).translate(_ONE_KIND, _NOT_BRACKET)
    for level in range(max_depth + 1):
        if not brackets:
            return False
        if b"[" * (max_depth + 1 - level) in brackets:  # a run of openers this long is too deep already
            return True
        reduced = brackets.replace(b"[]", b"")  # one level per pass: only pairs present before the pass go
        if len(reduced) == len(brackets):  # unbalanced (not JSON): still refuse a run of openers that deep
            run = max((len(m) for m in _OPENERS.findall(brackets)), default=0)
            return level + run > max_depth
        brackets = reduced
    return True


def _no_constants(name: str) -> Any:
    # Python's json accepts NaN / Infinity / -Infinity; JSON does not, and no upstream could be sent them.
    raise ValueError(f"{name} is not a JSON value")


_loads = client_decoder(_no_constants)  # json.loads(raw, parse_constant=_no_constants), its decoder built once


def loads_object(raw: bytes, max_depth: int) -> dict[str, Any]:
    """Parse a client body that must be one JSON object, within the depth limit (400 otherwise)."""
    if json_depth_exceeds(raw, max_depth):
        raise BadRequest(f"request body nests JSON deeper than the limit of {max_depth} levels")
    try:
        body = _loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body
