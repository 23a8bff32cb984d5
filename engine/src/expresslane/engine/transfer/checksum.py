"""Checksum of staged / received KV bytes (``done.checksum``, ``"<algorithm>:<hex>"``).

Two algorithms, named in the string itself so the receiver checks with the one the sender used:

* ``crc32`` (the wire contract since protocol 1, and what a DRAM pair uses): zlib CRC-32 over the bytes. CPU
  tensors are hashed in place (no copy); a device tensor would have to be copied to the host first (a D2H pass
  of the whole KV: 4 GiB for an 8B model at 32k tokens), so device buffers use the next one instead.
* ``wsum16`` (for VRAM buffers, computed by torch on the tensor's own device, no host copy): the bytes read as
  little-endian signed 16-bit words ``w_0 .. w_{n-1}`` (an odd last byte is one more word, its value 0..255);
  ``S1 = sum(w_i)`` and ``S2 = sum((i + 1) * w_i)``, both exact integers taken mod 2**64, written as
  ``"wsum16:<S1 16 hex><S2 16 hex>"``. S1 catches any changed word, S2 (position-weighted, as in Fletcher / Adler
  sums) catches swapped, shifted, torn and overlapping writes. The arithmetic is exact (int64 rows of 2**22
  words cannot overflow: |w| < 2**15, so a row's S2 < 2**59), so CPU and GPU get the same value for the same bytes:
  a DRAM peer can check a VRAM peer's sum and the other way round.

Which one a sender uses: ``choose_algorithm`` -- ``wsum16`` when both buffers are VRAM and the receiver
advertises it (``hello.transport.checksums``); ``crc32`` otherwise (a mixed DRAM/VRAM pair: the DRAM side hashes
in place, the VRAM side copies to the host), and always towards a receiver that advertises nothing (one from
before ``wsum16``, which knows only crc32). The receiver checks with whichever algorithm ``done`` names.
CRC-32 / the sums find corruption and torn writes; authenticity is the control plane's HMAC's job.
"""

from __future__ import annotations

import zlib

import torch

CRC32 = "crc32"
WSUM16 = "wsum16"
ALGORITHMS = (CRC32, WSUM16)
ALGORITHM = CRC32  # the default (and the only one a receiver that advertises nothing knows)

_CHUNK = 64 * 1024 * 1024
_ROW_WORDS = 1 << 22   # words per exact int64 row sum (see the module docstring for why this cannot overflow)
_BATCH_ROWS = 8        # rows widened to int64 at once: 256 MiB of int64 per batch
_MASK64 = (1 << 64) - 1
_aranges: dict[torch.device, torch.Tensor] = {}


def checksum(data: torch.Tensor, algorithm: str = CRC32) -> str:
    """``"<algorithm>:<hex>"`` of a contiguous uint8 tensor's bytes."""
    if data.dtype != torch.uint8 or not data.is_contiguous():
        raise ValueError("checksum wants a contiguous uint8 tensor")
    data = data.view(-1)
    if algorithm == CRC32:
        return f"{CRC32}:{_crc32(data):08x}"
    if algorithm == WSUM16:
        s1, s2 = _wsum16(data)
        return f"{WSUM16}:{s1:016x}{s2:016x}"
    raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def algorithm_of(value: str) -> str | None:
    """The algorithm a ``done.checksum`` names, or None when it names none this side knows."""
    name, sep, _ = value.partition(":")
    return name if sep and name in ALGORITHMS else None


def choose_algorithm(local_on_device: bool, remote_mem_type: str, offered: object) -> str:
    """The algorithm a sender uses towards a receiver whose hello advertises ``offered`` (None: an older node).

    ``wsum16`` only when BOTH buffers are on a device: a mixed pair has one side on the host whichever algorithm
    it uses, and there zlib's crc32 in place beats torch's int64 sums by ~8x (measured: 128 MiB, 2 loaded CPU
    cores: crc32 0.1 s, wsum16 0.8 s), while the device side's crc32 costs a D2H pass (~1.2x a host crc32)."""
    offered = offered if isinstance(offered, list) else []
    if WSUM16 in offered and local_on_device and remote_mem_type == "VRAM":
        return WSUM16
    return CRC32


def _crc32(data: torch.Tensor) -> int:
    crc = 0
    if data.device.type == "cpu":
        crc = zlib.crc32(memoryview(data.numpy()), crc)
    else:  # a host bounce: the D2H copy of every byte (what wsum16 exists to avoid)
        for off in range(0, data.numel(), _CHUNK):
            crc = zlib.crc32(memoryview(data[off:off + _CHUNK].cpu().numpy()), crc)
    return crc & 0xFFFFFFFF


def _arange(device: torch.device) -> torch.Tensor:
    ar = _aranges.get(device)
    if ar is None:
        ar = _aranges[device] = torch.arange(_ROW_WORDS, dtype=torch.int64, device=device)
    return ar


@torch.inference_mode()
def _wsum16(data: torch.Tensor) -> tuple[int, int]:
    """(S1, S2) mod 2**64, computed on data's device; only the per-row sums (16 B per 8 MiB) leave it."""
    n = data.numel()
    even = n - (n & 1)
    body = data[:even]
    if body.data_ptr() % 2:  # an int16 view needs 2-byte alignment (slots are 256-byte aligned; this is rare)
        body = body.clone()
    words = body.view(torch.int16)
    nw = words.numel()
    ar = _arange(data.device)
    full = nw // _ROW_WORDS
    s1_parts: list[torch.Tensor] = []
    s2_parts: list[torch.Tensor] = []
    for r0 in range(0, full, _BATCH_ROWS):
        b = min(_BATCH_ROWS, full - r0)
        rows = words[r0 * _ROW_WORDS:(r0 + b) * _ROW_WORDS].view(b, _ROW_WORDS).to(torch.int64)
        s1_parts.append(rows.sum(1))
        s2_parts.append((rows * ar).sum(1))
    tail_words = nw - full * _ROW_WORDS
    if tail_words:
        tail = words[full * _ROW_WORDS:].to(torch.int64)
        s1_parts.append(tail.sum().view(1))
        s2_parts.append((tail * ar[:tail_words]).sum().view(1))
    s1_rows = torch.cat(s1_parts).tolist() if s1_parts else []  # one sync, a few KiB
    s2_rows = torch.cat(s2_parts).tolist() if s2_parts else []
    s1 = s2 = 0
    for r, (a, w) in enumerate(zip(s1_rows, s2_rows)):  # row r starts at word r * _ROW_WORDS
        s1 += a
        s2 += (r * _ROW_WORDS + 1) * a + w
    if n & 1:
        last = int(data[n - 1].item())
        s1 += last
        s2 += (nw + 1) * last
    return s1 & _MASK64, s2 & _MASK64
