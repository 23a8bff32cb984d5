"""scripts/gpu_carry.py: parts that each fit one device call, put back together exactly on the GPU machine (or a
missing / damaged part named), and the device calls it prints."""

from __future__ import annotations

import io
import json
import random
import tarfile
from pathlib import Path

import gpu_carry
import pytest


def _site_archive(tmp_path: Path, lock_digest: str) -> tuple[Path, dict[str, bytes]]:
    files = {"vllm/__init__.py": b"__version__ = '0.26.0'\n", "vllm/third_party/pynvml.py": b"# nvml\n",
             "nixl_cu13.libs/libnixl.so": random.Random(0).randbytes(100_000),
             gpu_carry.MARKER: json.dumps({"lock_sha256": lock_digest}).encode()}
    archive = tmp_path / "site.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive, files


def _carry(tmp_path: Path, budget: int = 40_000) -> tuple[Path, dict, dict[str, bytes]]:
    archive, files = _site_archive(tmp_path, "lock-1")
    carry = tmp_path / "carry"
    carry.mkdir()
    manifest = gpu_carry.split_archive(archive, carry, budget, "lock-1")
    return carry, manifest, files


def test_parts_fit_the_budget_and_assemble_byte_exact(tmp_path, capsys) -> None:
    carry, manifest, files = _carry(tmp_path)
    assert len(manifest["parts"]) >= 2 and all(p["bytes"] <= 40_000 for p in manifest["parts"])
    for i, part in enumerate(manifest["parts"], 1):  # one part per folder, the manifest beside each
        assert sorted(x.name for x in (carry / f"p{i}").iterdir()) == ["manifest.json", part["name"]]
    parts, site = tmp_path / "parts", tmp_path / "site"
    assemble = ["--carry-dir", str(carry), "assemble", "--parts", str(parts), "--site", str(site),
                "--lock-sha256", "lock-1"]
    assert gpu_carry.main(assemble) == 0
    for name, data in files.items():
        assert (site / name).read_bytes() == data
    # idempotent: a second call finds this build in place and touches nothing
    (site / "touched").write_text("x")
    assert gpu_carry.main(assemble) == 0
    assert "already holds this build" in capsys.readouterr().out and (site / "touched").exists()


def test_a_missing_or_damaged_part_is_named(tmp_path) -> None:
    carry, manifest, _ = _carry(tmp_path)
    parts = tmp_path / "parts"
    parts.mkdir()
    first, second = manifest["parts"][0]["name"], manifest["parts"][1]["name"]
    (parts / first).write_bytes((carry / "p1" / first).read_bytes()[:-1] + b"\0")
    (parts / "manifest.json").write_text((carry / "p1" / "manifest.json").read_text())
    empty = tmp_path / "no-carry"
    empty.mkdir()  # as on the machine when the earlier calls' /tmp was lost: only the copied part is there
    with pytest.raises(SystemExit) as e:
        gpu_carry.main(["--carry-dir", str(empty), "assemble", "--parts", str(parts), "--site", str(tmp_path / "s"),
                        "--lock-sha256", "lock-1"])
    assert f"{first} damaged" in str(e.value) and f"{second} missing" in str(e.value)
    assert not (tmp_path / "s").exists()


def test_calls_one_part_each_and_the_last_runs_the_stack(tmp_path, capsys) -> None:
    carry, manifest, _ = _carry(tmp_path)
    assert gpu_carry.main(["--carry-dir", str(carry), "calls", "--shapes", "llama-8b,llama-1b"]) == 0
    out = json.loads(capsys.readouterr().out)
    calls = out["calls"]
    assert len(calls) == len(manifest["parts"])
    for i, call in enumerate(calls, 1):
        assert call["carry"] == [f".carry/p{i}"] and len(call["command"]) <= gpu_carry.COMMAND_LIMIT
        assert call["timeout_s"] <= 600
    assert "gpu_make_shape_model.py llama-8b" in calls[0]["command"]  # checkpoints written while parts travel
    assert "gpu_check.py stack $OUT --stack-shapes llama-8b,llama-1b" in calls[-1]["command"]
    assert "--stack-shapes llama-1b " in out["followup"]["command"]  # the last shape again, /tmp kept
    assert out["tree_bytes"] + out["largest_part_bytes"] < gpu_carry.DEVICE_LIMIT


def test_strip_refuses_a_stale_list(tmp_path) -> None:
    with pytest.raises(SystemExit, match="strip list is out of date"):
        gpu_carry.strip_site(tmp_path)
