"""The KV layout both ends must agree on, and its compatibility hash.

The wire layout is dense and canonical (see docs/protocol.md, "Wire layout"): for one request and one
sending rank the bytes are ``K[num_layers, num_tokens, num_heads, head_dim]`` immediately followed by
``V[num_layers, num_tokens, num_heads, head_dim]``, C-contiguous, in ``dtype``. Nothing about the
prefill's paged cache (block size, backend, stride order) crosses the wire, so it is not hashed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

# Bump when the meaning of the bytes in a receive slot changes.
WIRE_LAYOUT = "dense-kv-v1"

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical name of a torch dtype ("float32", "bfloat16", ...)."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {dtype!r}; known: {sorted(_DTYPES)}")
        return name
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; known: {sorted(_DTYPES)}")


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[dtype_name(name)]


@dataclass(frozen=True)
class KVLayoutSpec:
    """Model-wide KV shape of the whole model (all KV heads), as a decode node holds it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_seq_len: int
    wire_layout: str = WIRE_LAYOUT

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for field in ("num_layers", "num_kv_heads", "head_dim", "max_seq_len"):
            if int(getattr(self, field)) <= 0:
                raise ValueError(f"KVLayoutSpec.{field} must be positive, got {getattr(self, field)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def request_nbytes(self, num_tokens: int, num_heads: int | None = None) -> int:
        """Bytes on the wire for ``num_tokens`` tokens of ``num_heads`` heads (default: all)."""
        heads = self.num_kv_heads if num_heads is None else num_heads
        return 2 * self.num_layers * num_tokens * heads * self.head_dim * self.element_size

    def compat_hash(self) -> str:
        """What must match for the bytes to mean the same thing on both ends (not max_seq_len)."""
        factors = {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "wire_layout": self.wire_layout,
        }
        return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:16]

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: dict) -> "KVLayoutSpec":
        return cls(
            num_layers=int(data["num_layers"]),
            num_kv_heads=int(data["num_kv_heads"]),
            head_dim=int(data["head_dim"]),
            dtype=str(data["dtype"]),
            max_seq_len=int(data["max_seq_len"]),
            wire_layout=str(data.get("wire_layout", WIRE_LAYOUT)),
        )


# config.json fields that do not change what the model computes per token position (dtype is the
# layout's business and enters the layout hash; versions and names are bookkeeping).
_FINGERPRINT_IGNORED = frozenset({"torch_dtype", "dtype", "transformers_version", "_name_or_path",
                                  "use_cache", "_attn_implementation_autoset"})
_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
              "max_position_embeddings")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json")
_WEIGHT_SAMPLE_BYTES = 1 << 20


def model_fingerprint(model_dir: str) -> str:
    """sha256 (hex, 32 chars) of what makes two checkpoints compute the same KV for the same tokens.

    Covers the architecture, the shapes, the RoPE config, every other dtype-independent config.json
    field, the tokenizer files' bytes, and a cheap weight sample: for each ``*.safetensors`` file its
    name, size and the first MiB after its header (so two same-shaped random checkpoints differ). Both
    ends compute it from the same checkpoint directory; vLLM's compute_nixl_compatibility_hash covers
    model identity the same way. Raises FileNotFoundError if ``model_dir`` has no config.json.
    """
    import os
    import struct

    path = os.path.join(model_dir, "config.json")
    with open(path, "rb") as f:
        config = json.loads(f.read())
    h = hashlib.sha256()

    def put(tag: str, value: object) -> None:
        h.update(tag.encode() + b"\0" + json.dumps(value, sort_keys=True, default=str).encode() + b"\0")

    put("architectures", config.get("architectures"))
    put("model_type", config.get("model_type"))
    text_cfg = config.get("text_config") or {}
    put("shapes", {k: config.get(k, text_cfg.get(k)) for k in _SHAPE_KEYS})
    put("rope", {k: config.get(k, text_cfg.get(k)) for k in _ROPE_KEYS})
    put("config", {k: v for k, v in config.items() if k not in _FINGERPRINT_IGNORED})
    for name in _TOKENIZER_FILES:
        p = os.path.join(model_dir, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors"):
            continue
        p = os.path.join(model_dir, name)
        with open(p, "rb") as f:
            header = f.read(8)
            skip = struct.unpack("<Q", header)[0] if len(header) == 8 else 0
            f.seek(8 + skip)
            sample = f.read(_WEIGHT_SAMPLE_BYTES)
        put("weights", [name, os.path.getsize(p)])
        h.update(hashlib.sha256(sample).digest())
    return h.hexdigest()[:32]
