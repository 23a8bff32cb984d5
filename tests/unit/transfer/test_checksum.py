"""done.checksum algorithms (transfer/checksum.py): crc32 (the DRAM wire contract) and wsum16 (device-side sums,
no host copy), checked against plain-Python definitions, and which one a sender chooses."""

from __future__ import annotations

import zlib

import pytest
import torch

from expresslane.engine.transfer import checksum as cs


def _ref_wsum16(data: bytes) -> str:
    """The definition in the module docstring, in plain Python."""
    words = [int.from_bytes(data[i:i + 2], "little", signed=True) for i in range(0, len(data) - 1, 2)]
    if len(data) % 2:
        words.append(data[-1])
    s1 = sum(words) % 2**64
    s2 = sum((i + 1) * w for i, w in enumerate(words)) % 2**64
    return f"wsum16:{s1:016x}{s2:016x}"


def _rand(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture()
def small_rows(monkeypatch):
    """Rows of 8 words, batches of 3 rows, groups of 4 rows: every path (rows, batches, groups, tail) on a few
    hundred bytes."""
    monkeypatch.setattr(cs, "_ROW_WORDS", 8)
    monkeypatch.setattr(cs, "_BATCH_ROWS", 3)
    monkeypatch.setattr(cs, "_GROUP_ROWS", 4)
    monkeypatch.setattr(cs, "_aranges", {})


def test_crc32_is_zlib_crc32() -> None:
    data = _rand(1000)
    assert cs.checksum(data) == f"crc32:{zlib.crc32(data.numpy().tobytes()):08x}"
    assert cs.checksum(data, "crc32") == cs.checksum(data)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 15, 16, 17, 47, 48, 49, 200, 1001])
def test_wsum16_matches_its_definition(small_rows, n: int) -> None:
    data = _rand(n, seed=n)
    assert cs.checksum(data, "wsum16") == _ref_wsum16(data.numpy().tobytes())


def test_wsum16_at_the_real_row_size_matches_its_definition() -> None:
    data = _rand(5 * 2 * cs._ROW_WORDS + 7)  # five full rows and an odd tail
    raw = data.numpy().tobytes()
    import numpy as np

    w = np.frombuffer(raw[:len(raw) - 1], dtype="<i2").astype(object)  # exact integers
    s1 = int(w.sum()) + raw[-1]
    s2 = int((w * np.arange(1, len(w) + 1, dtype=object)).sum()) + (len(w) + 1) * raw[-1]
    assert cs.checksum(data, "wsum16") == f"wsum16:{s1 % 2**64:016x}{s2 % 2**64:016x}"


def test_wsum16_of_extreme_words_does_not_overflow(small_rows) -> None:
    for fill in (0x80, 0x7F, 0xFF):  # int16 -32640 / 32639 / -1 everywhere
        data = torch.full((1000,), fill, dtype=torch.uint8)
        assert cs.checksum(data, "wsum16") == _ref_wsum16(data.numpy().tobytes())


def test_wsum16_of_an_odd_address_view(small_rows) -> None:
    base = _rand(101)
    view = base[1:]
    assert view.data_ptr() % 2 == 1
    assert cs.checksum(view, "wsum16") == _ref_wsum16(view.numpy().tobytes())


@pytest.mark.parametrize("algorithm", ["crc32", "wsum16"])
def test_corruptions_change_the_checksum(algorithm: str) -> None:
    data = _rand(4096)
    good = cs.checksum(data, algorithm)
    flipped = data.clone()
    flipped[1234] ^= 1
    swapped = data.clone()
    swapped[100:102], swapped[3000:3002] = data[3000:3002].clone(), data[100:102].clone()
    shifted = data.clone()
    shifted[512:1024] = data[0:512]  # a write landed at the wrong offset (overlapping)
    stale = data.clone()
    stale[2048:] = 0  # a torn write: the second half never landed
    assert not torch.equal(swapped, data)
    for bad in (flipped, swapped, shifted, stale):
        assert cs.checksum(bad, algorithm) != good


def test_unknown_algorithm_and_bad_input_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        cs.checksum(_rand(4), "md5")
    with pytest.raises(ValueError, match="uint8"):
        cs.checksum(torch.zeros(4, dtype=torch.int16), "wsum16")


def test_algorithm_of() -> None:
    assert cs.algorithm_of("crc32:0000abcd") == "crc32"
    assert cs.algorithm_of("wsum16:" + "0" * 32) == "wsum16"
    assert cs.algorithm_of("sha1:00") is None
    assert cs.algorithm_of("crc32") is None
    assert cs.algorithm_of("") is None


def test_choose_algorithm() -> None:
    both = ["crc32", "wsum16"]
    assert cs.choose_algorithm(False, "DRAM", both) == "crc32"   # a DRAM pair keeps the CRC-32 contract
    assert cs.choose_algorithm(True, "VRAM", both) == "wsum16"   # VRAM -> VRAM: no host copy on either side
    assert cs.choose_algorithm(True, "DRAM", both) == "crc32"    # mixed: the host side's crc32 in place is cheaper
    assert cs.choose_algorithm(False, "VRAM", both) == "crc32"
    assert cs.choose_algorithm(True, "VRAM", None) == "crc32"     # a node from before wsum16 advertises none
    assert cs.choose_algorithm(True, "VRAM", ["crc32"]) == "crc32"
    assert cs.choose_algorithm(True, "VRAM", "wsum16") == "crc32"  # not a list: ignored


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 4097, 3 * 2 * (1 << 22) + 5])
def test_wsum16_on_cuda_equals_cpu_without_a_host_copy(n: int) -> None:
    cpu = _rand(n, seed=n)
    dev = cpu.cuda()
    assert cs.checksum(dev, "wsum16") == cs.checksum(cpu, "wsum16")


_TRITON_CHECK = """
import json, os, sys, torch
from expresslane.engine.transfer import checksum as cs
out = []
for n in (1, 2, 4097, 65536, 3 * 65536 + 1001, 5 * 65536):
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    os.environ["EXPRESSLANE_WSUM16_KERNEL"] = "triton"
    tri = cs.checksum(data, "wsum16")
    os.environ["EXPRESSLANE_WSUM16_KERNEL"] = "torch"
    out.append([n, tri, cs.checksum(data, "wsum16")])
assert "expresslane.engine.transfer.wsum16_kernel" in sys.modules
print(json.dumps(out))
"""


def test_wsum16_triton_kernel_matches_the_torch_one_under_the_interpreter() -> None:
    """The one-pass Triton row sums (wsum16_kernel.py) on CPU through Triton's interpreter, in a fresh
    interpreter (TRITON_INTERPRET is read when the kernel is decorated; vLLM, once imported, refuses it)."""
    pytest.importorskip("triton")
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _TRITON_CHECK], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 6
    for n, tri, ref in rows:
        assert tri == ref, n
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
        if n < 5000:
            assert tri == _ref_wsum16(data.numpy().tobytes())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_wsum16_triton_kernel_on_cuda_equals_cpu(monkeypatch) -> None:
    pytest.importorskip("triton")
    cpu = _rand(7 * (1 << 20) + 3, seed=5)
    monkeypatch.setenv("EXPRESSLANE_WSUM16_KERNEL", "triton")
    got = cs.checksum(cpu.cuda(), "wsum16")
    monkeypatch.setenv("EXPRESSLANE_WSUM16_KERNEL", "torch")
    assert got == cs.checksum(cpu, "wsum16")

