"""Pre-allocated staging slots the forward step copies a request's KV into (prefill side).

One contiguous byte buffer (registered with NIXL once) cut into equal slots. acquire() never blocks:
when every slot is in flight the caller fails that request's send (metric + log), it never waits.
"""

from __future__ import annotations

import threading

import torch


class StagingSlot:
    def __init__(self, pool: "StagingPool", index: int) -> None:
        self.pool = pool
        self.index = index
        self.offset = index * pool.slot_nbytes
        self._held = False

    @property
    def nbytes(self) -> int:
        return self.pool.slot_nbytes

    def bytes(self, nbytes: int | None = None) -> torch.Tensor:
        n = self.pool.slot_nbytes if nbytes is None else nbytes
        if n > self.pool.slot_nbytes:
            raise ValueError(f"{n} B does not fit a {self.pool.slot_nbytes} B staging slot")
        return self.pool.buffer[self.offset : self.offset + n]

    def dense_kv(self, num_layers: int, num_tokens: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot as wire-layout K and V views, each [L, T, H, D] contiguous (K bytes then V bytes)."""
        elt = torch.empty((), dtype=dtype).element_size()
        half = num_layers * num_tokens * num_heads * head_dim * elt
        raw = self.bytes(2 * half)
        shape = (num_layers, num_tokens, num_heads, head_dim)
        return raw[:half].view(dtype).view(shape), raw[half:].view(dtype).view(shape)

    def release(self) -> None:
        self.pool._release(self)


class StagingPool:
    def __init__(self, num_slots: int, slot_nbytes: int, device: torch.device | str = "cpu",
                 pin_memory: bool = False, on_change=None) -> None:
        if num_slots < 1 or slot_nbytes < 1:
            raise ValueError("staging needs at least one slot of at least one byte")
        self.num_slots = num_slots
        # Keep slots 256-byte aligned so every dtype view of a slot is aligned.
        self.slot_nbytes = (slot_nbytes + 255) // 256 * 256
        self.buffer = torch.empty(num_slots * self.slot_nbytes, dtype=torch.uint8, device=device,
                                  pin_memory=pin_memory)
        self._slots = [StagingSlot(self, i) for i in range(num_slots)]
        self._free = list(reversed(self._slots))
        self._lock = threading.Lock()
        # called with the number of slots in use after every acquire/release (the in-use gauge)
        self._on_change = on_change

    def acquire(self) -> StagingSlot | None:
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            slot._held = True
            in_use = self.num_slots - len(self._free)
        if self._on_change is not None:
            self._on_change(in_use)
        return slot

    def _release(self, slot: StagingSlot) -> None:
        with self._lock:
            if not slot._held:  # idempotent: every path may release
                return
            slot._held = False
            self._free.append(slot)
            in_use = self.num_slots - len(self._free)
        if self._on_change is not None:
            self._on_change(in_use)

    @property
    def num_in_use(self) -> int:
        with self._lock:
            return self.num_slots - len(self._free)

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)
