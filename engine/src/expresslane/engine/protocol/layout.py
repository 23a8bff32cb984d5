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
