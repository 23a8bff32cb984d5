"""The router's JSON on the request path, with the standard library's exact results, made once per process.

`json.loads(raw, parse_constant=...)` and `json.dumps(obj, ensure_ascii=False, ...)` build a new JSONDecoder /
JSONEncoder (and its C scanner setup) on every call, since only the all-defaults forms are cached; on the hot path
that is three such builds per request (the client body; each upstream leg's body; the reply through Starlette's
JSONResponse.render). These are the same objects, built once:

- `client_decoder(reject)(raw)`: exactly `json.loads(raw, parse_constant=reject)` for bytes (same detect_encoding +
  'surrogatepass' decode, same decoder options, so the same value or the same error);
- `dumps_compact(obj)`: exactly `json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))`;
- `CompactJSONResponse`: Starlette's JSONResponse whose `render` is that encoder (Starlette's own render makes
  the same call), so the same bytes.

tests/unit/router/test_router_json_codec.py compares each with the standard-library call on edge inputs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse

__all__ = ["CompactJSONResponse", "client_decoder", "dumps_compact"]

_COMPACT = json.JSONEncoder(ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def client_decoder(parse_constant: Callable[[str], Any]) -> Callable[[bytes], Any]:
    """`json.loads(raw, parse_constant=parse_constant)` for bytes, its decoder built once."""
    decode = json.JSONDecoder(parse_constant=parse_constant).decode
    detect = json.detect_encoding

    def loads(raw: bytes) -> Any:
        return decode(raw.decode(detect(raw), "surrogatepass"))

    return loads


def dumps_compact(obj: Any) -> str:
    return _COMPACT.encode(obj)


class CompactJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return _COMPACT.encode(content).encode("utf-8")

