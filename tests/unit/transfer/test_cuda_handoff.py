"""The express lane's KV handoff between two real processes, through the handoff probe's own code path
(docs/bench/2026-12-01-vram-handoff/gpu_handoff.py).

On a GPU (skipped without CUDA): VRAM staging -> VRAM receive slot over NIXL between two processes is byte-exact
and checked on the device (wsum16, no host copy); a live DecodeEngine injects straight from the receive slot and
decodes the same greedy tokens as when it prefills the prompt itself, and no KV-sized copy touches the host
(torch.profiler's memcpy records). On CPU the same two-process path (DRAM, crc32) runs in seconds, for CI.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl")

# the probe lives beside its results, in its lab note (docs/bench/2026-12-01-vram-handoff/)
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "docs" / "bench" / "2026-12-01-vram-handoff"))
import gpu_handoff  # noqa: E402

from expresslane.engine.transfer.checksum import checksum  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _run(out: Path, *args: str) -> list[dict]:
    rc = gpu_handoff.main(["--out", str(out), "--deadline-s", "400", *args])
    recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    bad = [r for r in recs if r["event"] in ("error", "skipped")]
    assert rc == 0 and not bad, bad
    return recs


def _events(recs: list[dict], name: str) -> list[dict]:
    return [r for r in recs if r["event"] == name]


def _check_transfers(recs: list[dict], algorithm: str, device_type: str, staging: str, count: int) -> None:
    transfers = _events(recs, "transfer")
    assert len(transfers) == count
    for t in transfers:
        assert t["bytes_exact"] and t["zero_copy_view"], t
        assert t["kv_device"].startswith(device_type) and t["staging"] == staging
        assert [c["algorithm"] for c in t["send_checksums"]] == [algorithm]
        assert [c["algorithm"] for c in t["recv_checksums"]] == [algorithm]  # the receiver checked it
        assert t["recv_checksums"][0]["nbytes"] == t["nbytes"]


def _check_inject(recs: list[dict], device_type: str) -> dict:
    (inj,) = _events(recs, "inject")
    assert inj["tokens_equal"], (inj["expected"], inj["got"])
    assert inj["sender_first_token"] == inj["first_token"]
    assert inj["kv_device"].startswith(device_type) and inj["zero_copy_view"]
    assert len(inj["recv_checksums"]) == 1  # the KV was checked before it was injected
    return inj


def test_two_process_handoff_and_inject_on_cpu(tmp_path: Path, tiny_model_dir: Path) -> None:
    recs = _run(tmp_path, "--device", "cpu", "--sizes", "llama-1b:16,200", "--reps", "1", "--no-bounce-ref",
                "--phases", "pairs", "inject", "--model-dir", str(tiny_model_dir))
    _check_transfers(recs, "crc32", "cpu", "DRAM", count=4)
    assert all(s["all_bytes_exact"] for s in _events(recs, "summary"))
    _check_inject(recs, "cpu")
    assert (tmp_path / "receiver.log").exists() and (tmp_path / "sender.log").exists()


@cuda
def test_vram_to_vram_between_two_processes_is_byte_exact_and_checked_on_the_device(tmp_path: Path) -> None:
    recs = _run(tmp_path, "--device", "cuda", "--sizes", "llama-1b:1024", "llama-8b:1024", "--reps", "2",
                "--phases", "pairs", "--modes", "vram->vram", "--no-bounce-ref")
    _check_transfers(recs, "wsum16", "cuda", "VRAM", count=6)


@cuda
def test_dram_to_vram_between_two_processes_is_byte_exact(tmp_path: Path) -> None:
    recs = _run(tmp_path, "--device", "cuda", "--sizes", "llama-1b:256", "--reps", "1", "--phases", "pairs",
                "--modes", "dram->vram", "--no-bounce-ref")
    _check_transfers(recs, "crc32", "cuda", "DRAM", count=2)


@cuda
def test_inject_from_the_vram_receive_slot_decodes_the_same_tokens_without_a_host_bounce(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    recs = _run(tmp_path, "--device", "cuda", "--phases", "inject", "--model-dir", str(tiny_model_dir),
                "--sizes", "llama-1b:16", "--modes", "vram->vram")  # small pair buffers: inject only
    (inj,) = _events(recs, "inject")
    mc = inj["memcpy"] or {}
    delta = inj["pinned_host_delta"] or {}
    facts = {k: inj.get(k) for k in ("tokens_equal", "expected", "got", "first_token", "sender_first_token",
                                     "kv_device", "zero_copy_view", "recv_checksums", "pinned_host_delta")}
    facts["memcpy"] = mc
    assert inj["tokens_equal"] and inj["sender_first_token"] == inj["first_token"], facts
    assert inj["kv_device"].startswith("cuda") and inj["zero_copy_view"], facts
    assert [c["algorithm"] for c in inj["recv_checksums"]] == ["wsum16"], facts  # checked before the inject
    assert mc.get("gpu_events", 0) > 0, ("the profiler recorded no GPU activity: cannot tell whether the host "
                                         "was used", facts)
    # The KV is 800 KiB here; what reaches the host is the checksum's sums and a few flags (bytes, not KiB),
    # and no pinned staging block of KV size is handed out.
    assert mc["host_bytes"] < 4096, facts
    assert (delta.get("active_bytes.allocated") or 0) < 4096, facts


@cuda
def test_wsum16_of_a_vram_buffer_copies_only_row_sums_to_the_host(tmp_path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    data = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda")
    checksum(data, "wsum16")  # warm (the arange)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        value = checksum(data, "wsum16")
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    mc = gpu_handoff._memcpy_summary(str(trace))
    assert mc["gpu_events"] > 0
    assert mc["host_bytes"] <= 64, mc["copies"]  # one group of rows: 3 int64 sums
    assert value == checksum(data.cpu(), "wsum16")
