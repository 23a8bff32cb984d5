"""Control-plane framing, typed messages, caps, compatibility checks, model fingerprint, frame MACs."""

from __future__ import annotations

import json
import shutil
import socket
import struct
from pathlib import Path

import pytest

from expresslane.engine.protocol import auth as a
from expresslane.engine.protocol import messages as m
from expresslane.engine.protocol.errors import (
    AuthError,
    BadMessage,
    ConnectionClosed,
    LayoutMismatch,
    MagicMismatch,
    MessageTooLarge,
    ModelMismatch,
    ProtocolError,
    VersionMismatch,
)
from expresslane.engine.protocol.layout import KVLayoutSpec, model_fingerprint

LAYOUT = KVLayoutSpec(4, 4, 32, "float32", 4096)


def _pair():
    a_, b = socket.socketpair()
    a_.settimeout(2)
    b.settimeout(2)
    return a_, b


def test_roundtrip_every_message() -> None:
    x, y = _pair()
    msgs = [
        m.Challenge(magic=m.MAGIC, protocol_version=m.PROTOCOL_VERSION, auth="none", nonce=a.new_nonce()),
        m.Auth(nonce=a.new_nonce(), proof="00" * 32),
        m.AuthOk(proof="11" * 32),
        m.hello(LAYOUT, {"name": "nixl"}, busy=False, node_id="n", model_fingerprint="f" * 32),
        m.admit(rid="r", rank=0, world_size=1, head_start=0, num_heads=4, num_tokens=3, nbytes=10, layout=LAYOUT),
        m.Accept(rid="r", rank=0, generation=7, dest_offset=0, nbytes=10, notif="r|7|0"),
        m.reject(rid="r", reason=m.REJECT_BUSY, detail="x"),
        m.Done(rid="r", rank=0, generation=7, nbytes=10, checksum="crc32:0000abcd", timings={"write_s": 0.1}),
        m.Ack(rid="r", generation=7, ok=True),
        m.Abort(rid="r", reason="write_timeout", detail="d", write_final=False),
        m.Error(code="protocol", detail="bad"),
    ]
    assert {type(msg) for msg in msgs} == set(m.MESSAGE_CLASSES.values())
    for msg in msgs:
        m.send_msg(x, msg)
        assert m.recv_msg(y) == msg
    assert msgs[6].retryable is True
    assert m.reject(rid="r", reason=m.REJECT_TOO_LONG).retryable is False


def test_frame_is_big_endian_length_prefixed_json() -> None:
    frame = m.encode(m.Ack(rid="r", generation=1, ok=True))
    (n,) = struct.unpack(">I", frame[:4])
    assert n == len(frame) - 4 and frame[4:5] == b"{"
    assert m.decode_frame(frame) == m.Ack(rid="r", generation=1, ok=True)


def test_size_cap_on_encode_and_decode() -> None:
    with pytest.raises(MessageTooLarge):
        m.encode(m.Error(code="x", detail="y" * 2000), max_bytes=1000)
    x, y = _pair()
    x.sendall(struct.pack(">I", m.MAX_MESSAGE_BYTES + 1))  # announced size alone is refused
    with pytest.raises(MessageTooLarge):
        m.recv_msg(y)


@pytest.mark.parametrize("obj", [
    {"type": "ack", "rid": "r", "generation": -1, "ok": True},          # negative
    {"type": "ack", "rid": "r", "generation": 1.5, "ok": True},         # float
    {"type": "ack", "rid": "", "generation": 1, "ok": True},            # empty rid
    {"type": "ack", "rid": "r", "generation": 1, "ok": "yes"},          # not a bool
    {"type": "ack", "rid": "r" * 300, "generation": 1, "ok": True},     # rid too long
    {"type": "ack", "rid": "r"},                                         # missing fields
    {"type": "admit", "magic": m.MAGIC, "protocol_version": 2, "layout_hash": "", "layout": {}, "rid": "r",
     "rank": 2, "world_size": 2, "head_start": 0, "num_heads": 1, "num_tokens": 1, "nbytes": 1},  # rank >= world
    {"type": "done", "rid": "r", "rank": 0, "generation": 1, "nbytes": True},  # bool is not an int
])
def test_invalid_fields_are_typed_errors(obj: dict) -> None:
    with pytest.raises(BadMessage):
        m.parse(obj)


def test_malformed_frames() -> None:
    for body in (b"not json", b"[1, 2]", b'{"type": "nope"}', b"\xff\xfe", b"[" * 100000):
        x, y = _pair()
        x.sendall(struct.pack(">I", len(body)) + body)
        with pytest.raises(ProtocolError):
            m.recv_msg(y)
    x, y = _pair()
    x.sendall(struct.pack(">I", 100) + b"{")
    x.close()
    with pytest.raises(ConnectionClosed, match="mid-frame"):
        m.recv_msg(y)
    x, y = _pair()
    x.close()
    with pytest.raises(ConnectionClosed):
        m.recv_msg(y)


def test_compat_checks_magic_then_version_then_layout_then_model() -> None:
    good = m.hello(LAYOUT, {}, False, "n", model_fingerprint="a" * 32)
    assert m.check_compat(good, LAYOUT, peer="p", local_fingerprint="a" * 32) == LAYOUT
    with pytest.raises(MagicMismatch, match="expresslane_ctrl_port"):
        m.check_compat(m.Hello(**{**good.__dict__, "magic": "tilert", "protocol_version": 99}), LAYOUT, peer="p")
    with pytest.raises(VersionMismatch, match="same expresslane-engine version"):
        m.check_compat(m.Hello(**{**good.__dict__, "protocol_version": 99}), LAYOUT, peer="p")
    other = KVLayoutSpec(4, 4, 32, "bfloat16", 4096)
    with pytest.raises(LayoutMismatch, match=r"dtype: p=bfloat16 local=float32.*--dtype"):
        m.check_compat(m.hello(other, {}, False, "n"), LAYOUT, peer="p")
    with pytest.raises(LayoutMismatch, match="num_layers"):
        m.check_compat(m.hello(KVLayoutSpec(8, 4, 32, "float32", 4096), {}, False, "n"), LAYOUT, peer="p")
    # max_seq_len is not part of the compatibility hash
    assert m.check_compat(m.hello(KVLayoutSpec(4, 4, 32, "float32", 128), {}, False, "n"), LAYOUT, peer="p")
    with pytest.raises(ModelMismatch, match=f"p={'a' * 32} local={'b' * 32}"):
        m.check_compat(good, LAYOUT, peer="p", local_fingerprint="b" * 32)


def test_layout_nbytes_and_hash() -> None:
    assert LAYOUT.request_nbytes(10) == 2 * 4 * 10 * 4 * 32 * 4
    assert LAYOUT.request_nbytes(10, num_heads=2) == LAYOUT.request_nbytes(10) // 2
    assert LAYOUT.compat_hash() == KVLayoutSpec(4, 4, 32, "torch.float32", 1).compat_hash()
    assert LAYOUT.compat_hash() != KVLayoutSpec(4, 4, 64, "float32", 4096).compat_hash()
    with pytest.raises(ValueError):
        KVLayoutSpec(4, 4, 32, "int3", 4096)


def _checkpoint(path: Path, **config) -> Path:
    path.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
           "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "rope_theta": 10000.0,
           "torch_dtype": "bfloat16", "transformers_version": "5.0", **config}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    header = b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(range(16)))
    return path


def test_model_fingerprint_covers_config_rope_tokenizer_and_weights(tmp_path: Path) -> None:
    base = model_fingerprint(str(_checkpoint(tmp_path / "a")))
    assert len(base) == 32 and base == model_fingerprint(str(tmp_path / "a"))
    # dtype and bookkeeping fields do not change the fingerprint (dtype is the layout hash's business)
    assert model_fingerprint(str(_checkpoint(tmp_path / "b", torch_dtype="float32",
                                             transformers_version="9"))) == base
    assert model_fingerprint(str(_checkpoint(tmp_path / "c", rope_theta=500000.0))) != base
    assert model_fingerprint(str(_checkpoint(tmp_path / "d", architectures=["MistralForCausalLM"]))) != base
    e = shutil.copytree(tmp_path / "a", tmp_path / "e")
    (e / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    assert model_fingerprint(str(e)) != base
    f = shutil.copytree(tmp_path / "a", tmp_path / "f")  # same shapes, other weights
    raw = bytearray((f / "model.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (f / "model.safetensors").write_bytes(bytes(raw))
    assert model_fingerprint(str(f)) != base
    with pytest.raises(FileNotFoundError):
        model_fingerprint(str(tmp_path / "missing"))


def test_session_macs_stop_replay_injection_and_reordering() -> None:
    secret = b"s3cret"
    nd, np_ = a.new_nonce(), a.new_nonce()
    prefill = a.Session.derive(secret, nd, np_, side="prefill")
    decode = a.Session.derive(secret, nd, np_, side="decode")
    f1 = json.loads(json.dumps(prefill.seal(m.Abort(rid="r", reason="x").to_wire())))
    f2 = json.loads(json.dumps(prefill.seal(m.Abort(rid="r2", reason="x").to_wire())))
    assert decode.unseal(dict(f1))["rid"] == "r"
    with pytest.raises(AuthError, match="sequence"):
        decode.unseal(dict(f1))  # replayed within the connection
    with pytest.raises(AuthError, match="MAC"):
        decode.unseal({**f2, "rid": "victim"})  # altered
    with pytest.raises(AuthError, match="without MAC"):
        decode.unseal({k: v for k, v in f2.items() if k != "mac"})  # injected unauthenticated
    other = a.Session.derive(secret, a.new_nonce(), np_, side="decode")
    with pytest.raises(AuthError, match="MAC"):
        other.unseal(dict(f2))  # replayed into another connection (other nonces, other key)
    assert decode.unseal(dict(f2))["rid"] == "r2"
    with pytest.raises(AuthError, match="MAC"):  # a frame the node sent is not valid coming back
        prefill.unseal(dict(f1))
    assert a.verify(a.prefill_proof(secret, nd, np_), a.prefill_proof(secret, nd, np_))
    assert not a.verify(a.prefill_proof(b"wrong", nd, np_), a.prefill_proof(secret, nd, np_))
    assert a.prefill_proof(secret, nd, np_) != a.decode_proof(secret, nd, np_)
