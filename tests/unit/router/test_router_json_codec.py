"""json_codec: the once-built decoder and encoder give the standard library's exact results (values, bytes and
error messages), on generated JSON values and on the edges where JSON libraries differ."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from expresslane.router.json_codec import CompactJSONResponse, client_decoder, dumps_compact
from expresslane.router.server.limits import _no_constants, loads_object
from expresslane.router.errors import BadRequest


def _reject(name: str):
    raise ValueError(f"{name} is not a JSON value")


_loads = client_decoder(_reject)


def _stdlib_loads(raw: bytes):
    return json.loads(raw, parse_constant=_reject)


def _outcome(fn, *a, **kw):
    try:
        return ("ok", fn(*a, **kw))
    except Exception as e:  # the same type and message
        return ("error", type(e).__name__, str(e))


_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text())
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=5)
                       | st.dictionaries(st.text(max_size=5), inner, max_size=5), max_leaves=30)


def _same(a, b) -> bool:  # equal, with NaN equal to NaN
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=300, deadline=None)
@given(_values)
def test_dumps_and_the_reply_render_equal_the_stdlib(value):
    want = _outcome(json.dumps, value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    assert _outcome(dumps_compact, value) == want
    render_want = _outcome(JSONResponse(None).render, value)
    assert _outcome(CompactJSONResponse(None).render, value) == render_want


@settings(max_examples=300, deadline=None)
@given(_values)
def test_loads_equals_the_stdlib_on_what_the_stdlib_writes(value):
    for text in {json.dumps(value), json.dumps(value, ensure_ascii=False, allow_nan=True)}:
        for raw in (text.encode("utf-8", "surrogatepass"), text.encode("utf-16"), text.encode("utf-32-le")):
            a, b = _outcome(_loads, raw), _outcome(_stdlib_loads, raw)
            assert a[0] == b[0] and (_same(a[1], b[1]) if a[0] == "ok" else a == b), (raw, a, b)


EDGES = [b"", b" ", b"{", b"[1,]", b'{"a":1,}', b"NaN", b"-Infinity", b"[Infinity]", b"1e400", b"-1e400",
         b"123456789012345678901234567890", b'"\\ud800"', b'"\\udc00\\ud800"', b'"\xed\xa0\x80"', b"\xff\xfe",
         b"\xef\xbb\xbf{}", b'{"a":1,"a":2}', b"-0", b"-0.0", b"1E5", b"01", b"[1 2]", b'"\x00"', b'"\t"', b"\xc3",
         b'{"k": "\xc3\xa9"}', b"true false", b'{"prompt": [1, 2, 3], "max_tokens": 1}', "{}".encode("utf-16-be"),
         b"[" * 50 + b"]" * 50, b"1.5e-07", b"\x00\x00\x00{"]


@pytest.mark.parametrize("raw", EDGES, ids=range(len(EDGES)))
def test_loads_equals_the_stdlib_on_edge_inputs(raw):
    a, b = _outcome(_loads, raw), _outcome(_stdlib_loads, raw)
    assert a[0] == b[0] and (_same(a[1], b[1]) if a[0] == "ok" else a == b), (a, b)


@pytest.mark.parametrize("raw", EDGES, ids=range(len(EDGES)))
def test_the_client_body_parse_keeps_its_answers(raw):
    """limits.loads_object, on the decoder built once, against the same function on json.loads itself."""
    def old(raw: bytes):
        try:
            body = json.loads(raw, parse_constant=_no_constants)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    a, b = _outcome(loads_object, raw, 400), _outcome(old, raw)
    assert a[0] == b[0] and (_same(a[1], b[1]) if a[0] == "ok" else a == b), (a, b)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), [1.0, -float("inf")], {"a": float("nan")},
                                   2 ** 64, 1e16, 1e-05, -0.0, "\ud800", {1: 2}, {"\x7f\u2028\x00\n": "é"},
                                   {True: None}, [1.5e-07, 0.1, 123456.789]])
def test_dumps_edges_equal_the_stdlib(value):
    assert _outcome(dumps_compact, value) == _outcome(json.dumps, value, ensure_ascii=False, allow_nan=False,
                                                      separators=(",", ":"))
    assert _outcome(CompactJSONResponse(None).render, value) == _outcome(JSONResponse(None).render, value)
