"""Property tests (hypothesis) of the frame decoder and message validation: any input gives a typed
message or a ProtocolError, never another exception, and valid messages round-trip exactly."""

from __future__ import annotations

import json
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from expresslane.engine.protocol import messages as m
from expresslane.engine.protocol.auth import Session, new_nonce
from expresslane.engine.protocol.errors import AuthError, ProtocolError

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
_field_names = st.sampled_from(sorted({f for c in m.MESSAGE_CLASSES.values() for f in c.__dataclass_fields__})
                               + ["seq", "mac", "x"])


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_escape_as_anything_but_protocol_errors(data: bytes) -> None:
    try:
        msg = m.decode_frame(data)
    except ProtocolError:
        return
    assert isinstance(msg, m.Message)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(m.MESSAGE_TYPES)), st.dictionaries(_field_names, _json, max_size=10))
def test_random_fields_for_every_type_validate_or_raise_typed(mtype: str, fields: dict) -> None:
    body = json.dumps({**fields, "type": mtype}).encode()
    frame = struct.pack(">I", len(body)) + body
    try:
        msg = m.decode_frame(frame)
    except ProtocolError:
        return
    assert isinstance(msg, m.MESSAGE_CLASSES[mtype])
    assert m.decode_frame(m.encode(msg)) == msg  # what validates also round-trips


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=40), st.integers(0, 2**40), st.integers(0, 2**40), st.booleans())
def test_valid_messages_roundtrip(rid: str, gen: int, nbytes: int, ok: bool) -> None:
    for msg in (m.Ack(rid=rid, generation=gen, ok=ok), m.Done(rid=rid, rank=0, generation=gen, nbytes=nbytes),
                m.Abort(rid=rid, reason="x", write_final=ok)):
        assert m.decode_frame(m.encode(msg)) == msg


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_field_names, _json, max_size=6), st.integers(0, 3))
def test_tampered_sealed_frames_are_auth_errors(extra: dict, which: int) -> None:
    nd, np_ = new_nonce(), new_nonce()
    tx = Session.derive(b"k", nd, np_, side="prefill")
    rx = Session.derive(b"k", nd, np_, side="decode")
    sealed = json.loads(json.dumps(tx.seal(m.Abort(rid="r", reason="x").to_wire())))
    tampered = dict(sealed)
    if which == 0:
        tampered.update({k: v for k, v in extra.items() if k not in ("mac",)})
    elif which == 1:
        tampered["seq"] = 5
    elif which == 2:
        tampered.pop("mac")
    else:
        tampered["mac"] = "0" * 64
    if tampered == sealed:
        assert rx.unseal(tampered)["rid"] == "r"
        return
    try:
        rx.unseal(tampered)
    except AuthError:
        return
    raise AssertionError(f"tampered frame accepted: {tampered}")
