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

import os
import zlib

import torch

CRC32 = "crc32"
WSUM16 = "wsum16"
ALGORITHMS = (CRC32, WSUM16)
ALGORITHM = CRC32  # the default (and the only one a receiver that advertises nothing knows)

_CHUNK = 64 * 1024 * 1024
# wsum16 on the device: rows of _ROW_WORDS words; int16 word x int32 position fits int32 (|j * w| < 2**30), a row's
# sums fit int64; groups of _GROUP_ROWS rows combine exactly in int64 (|r * s1_r| < 2**46, 2**16 of them < 2**62).
_ROW_WORDS = 1 << 15
_BATCH_ROWS = 1 << 11   # rows multiplied at once: 256 MiB of int32 products
_GROUP_ROWS = 1 << 16
_MASK64 = (1 << 64) - 1
_aranges: dict[tuple, torch.Tensor] = {}


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


def warm_wsum16(device: torch.device | str) -> None:
    """Run wsum16 once on ``device`` so its kernel is compiled (Triton JIT: 0.6 s for the first transfer of a
    process on an H200, GPU run 4) before a request waits on it. 64 bytes: a word count divisible by 16, as
    every KV's is (Triton specialises integer arguments on that)."""
    checksum(torch.zeros(64, dtype=torch.uint8, device=device), WSUM16)


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


def _arange(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (n, dtype, device)
    ar = _aranges.get(key)
    if ar is None:
        ar = _aranges[key] = torch.arange(n, dtype=dtype, device=device)
    return ar


_streams: dict[torch.device, torch.cuda.Stream] = {}


def _wsum16(data: torch.Tensor) -> tuple[int, int]:
    """On CUDA on a side stream of its own (after the work already queued on the caller's stream), so a
    receiver checking request N+1's KV does not queue behind or in front of request N's decode steps."""
    if data.device.type != "cuda":
        return _wsum16_here(data)
    stream = _streams.get(data.device)
    if stream is None:
        stream = _streams[data.device] = torch.cuda.Stream(device=data.device)
    stream.wait_stream(torch.cuda.current_stream(data.device))
    with torch.cuda.stream(stream):
        return _wsum16_here(data)


@torch.inference_mode()
def _wsum16_here(data: torch.Tensor) -> tuple[int, int]:
    """(S1, S2) mod 2**64, computed on data's device; what leaves it is 3 int64 per 4 GiB of words.

    Row r (words r*R .. r*R+R-1; the last row as if zero-padded: zeros add nothing) gives s1_r = sum(w) and
    s2_r = sum(j * w_j) (j the position in the row); then S1 = sum(s1_r) and
    S2 = sum((r*R + 1) * s1_r + s2_r) = R * sum(r * s1_r) + S1 + sum(s2_r), per group of rows on the device."""
    n = data.numel()
    even = n - (n & 1)
    body = data[:even]
    if body.data_ptr() % 2:  # an int16 view needs 2-byte alignment (slots are 256-byte aligned; this is rare)
        body = body.clone()
    words = body.view(torch.int16)
    nw = words.numel()
    R, dev = _ROW_WORDS, data.device
    s1 = s2 = 0
    if nw:
        s1_rows, s2_rows = _row_sums(words, R, wsum16_kernel(dev))
        G = _GROUP_ROWS
        sums = []
        for g0 in range(0, s1_rows.numel(), G):
            a = s1_rows[g0:g0 + G]
            sums.append(torch.stack([a.sum(), s2_rows[g0:g0 + G].sum(),
                                     (a * _arange(a.numel(), torch.int64, dev)).sum()]))
        for g, (a, b, c) in enumerate(torch.stack(sums).tolist()):  # one sync, 24 B per group
            r0 = g * G
            s1 += a
            s2 += R * (r0 * a + c) + a + b
    if n & 1:
        last_byte = int(data[n - 1].item())
        s1 += last_byte
        s2 += (nw + 1) * last_byte
    return s1 & _MASK64, s2 & _MASK64


def wsum16_kernel(device: torch.device) -> str:
    """Which row-sum kernel wsum16 uses on ``device``: ``EXPRESSLANE_WSUM16_KERNEL`` = auto (the default: triton
    on CUDA where triton imports, torch otherwise) | torch | triton (one pass, wsum16_kernel.py; CUDA, or CPU
    under TRITON_INTERPRET=1). Measured on one H200 (4 GiB VRAM slot): torch 30.4 ms, triton 2.57 ms, equal
    values in all 18 comparisons (docs/bench/2026-12-01-vram-handoff/)."""
    name = os.environ.get("EXPRESSLANE_WSUM16_KERNEL", "auto")
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"EXPRESSLANE_WSUM16_KERNEL={name!r}: auto | torch | triton")
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    return name


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _row_sums(words: torch.Tensor, R: int, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    nw = words.numel()
    if kernel == "triton":
        from expresslane.engine.transfer import wsum16_kernel as k

        return k.row_sums(words, R)
    full = nw // R
    pos = _arange(R, torch.int32, words.device)
    s1_parts: list[torch.Tensor] = []
    s2_parts: list[torch.Tensor] = []

    def rows_sums(rows: torch.Tensor) -> None:  # rows: [b, R] int16
        s1_parts.append(rows.sum(1, dtype=torch.int64))
        s2_parts.append((rows * pos).sum(1, dtype=torch.int64))  # int16 * int32 -> int32 on the fly

    for r0 in range(0, full, _BATCH_ROWS):
        b = min(_BATCH_ROWS, full - r0)
        rows_sums(words[r0 * R:(r0 + b) * R].view(b, R))
    if nw > full * R:
        last = torch.zeros(R, dtype=torch.int16, device=words.device)
        last[:nw - full * R] = words[full * R:]
        rows_sums(last.view(1, R))
    return torch.cat(s1_parts), torch.cat(s2_parts)
