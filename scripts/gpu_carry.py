#!/usr/bin/env python3
"""Carry stock vLLM + NIXL (CUDA 13) and the Python packages the GPU machine lacks, as parts that each travel
beside the repo in one device call (64 MiB a call; the machine has no registry). docs/gpu-stack.md has the recipe.

    python3 scripts/gpu_carry.py lock        # images/gpu-carry/requirements.txt -> lock.txt (exact files, sha256)
    python3 scripts/gpu_carry.py build       # fetch the locked wheels (hash-checked), lay them out for CPython 3.12,
                                             # strip what a Hopper bf16 serving path never loads, tar.xz, split
    python3 scripts/gpu_carry.py deps        # every carried wheel's requirements met by the carried + the machine's?
    python3 scripts/gpu_carry.py calls       # the device `run` calls, in order (JSON: command + carry)
    python3 scripts/gpu_carry.py assemble --site DIR [--parts DIR]   # (GPU machine, stdlib only) parts -> DIR

Parts live in .carry/p1, .carry/p2, ... (ignored by git): one call carries one folder and copies its part into
/tmp/parts, which the machine keeps while it stays warm (30 s between calls). The last call runs the GPU check's
`stack` (scripts/gpu_check.py), which assembles /tmp/site (a no-op when it already holds this build) and runs
scripts/gpu_stack.py. `assemble` checks every part's sha256 against the manifest that travels with each part, and
names the missing or damaged ones.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK_DIR = REPO / "images" / "gpu-carry"
REQUIREMENTS = LOCK_DIR / "requirements.txt"
LOCK = LOCK_DIR / "lock.txt"
CARRY = REPO / ".carry"
MARKER = "EXPRESSLANE_GPU_CARRY.json"
DEVICE_LIMIT = 64 << 20          # what one device call may carry: working tree + carried paths
TREE_MARGIN = 6 << 20            # room left for the repo to grow (bench results, docs) after a build
COMMAND_LIMIT = 2000

# The GPU machine: CPython 3.12 on x86_64 Linux (glibc >= 2.35) with the packages below preinstalled (its
# description, as given with the machine on 2026-12-04; docs/gpu-stack.md).
PLATFORM_ARGS = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
                 "--abi", "none", "--only-binary=:all:"] + [
    a for n in ("manylinux_2_35", "manylinux_2_34", "manylinux_2_31", "manylinux_2_28", "manylinux_2_27",
                "manylinux_2_26", "manylinux_2_24", "manylinux_2_17", "manylinux2014", "manylinux_2_5",
                "manylinux1") for a in ("--platform", f"{n}_x86_64")] + ["--platform", "any"]
MACHINE_HAS = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer click cloudpickle cmake cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x einops
filelock frozenlist fsspec grpcio h11 hf-xet httpcore httpx huggingface-hub idna jinja2 joblib llvmlite markupsafe
matplotlib ml-dtypes mpmath msgpack multidict networkx ninja numba numpy nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx
opencv-python-headless packaging pandas pillow pip prometheus-client propcache protobuf psutil py-cpuinfo pyarrow
pydantic-settings pygments pyyaml regex requests rich safetensors sentencepiece setuptools six sympy tiktoken
tokenizers torch torchaudio torchvision tqdm transformers triton typing-extensions typing-inspect urllib3 uvloop
wheel xxhash yarl zipp""".split())

# Stripped from the laid-out site (bytes measured on vLLM 0.26.0 / nixl-cu13 1.5.1; docs/gpu-stack.md):
STRIP = [
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # 305 MB, FlashAttention 2 (pre-Hopper); its import is in a try
    "vllm/_moe_C_stable_libtorch.abi3.so",       # 48 MB, MoE kernels; imported under suppress(ImportError)
    "vllm/vllm-rs",                              # 43 MB, the Rust front end (not used by api_server)
    "nixl_ep_cu13",                              # 95 MB, NIXL expert-parallel kernels
    "mistral_common/data",                       # 36 MB, Mistral tokenizer files (Mistral models only)
    "pycountry/locales",                         # 22 MB, country-name translations
    "include",                                   # 7 MB, C headers from the wheels' data
    "bin",                                       # console scripts pip wrote for this machine's Python
]
# vllm/third_party: only its Python stays (vllm.third_party.pynvml is how vLLM finds CUDA); headers and
# DeepGEMM / FMHA binaries go (FP8 / Blackwell paths).
STRIP_NON_PY_UNDER = ["vllm/third_party"]


def log(msg: str) -> None:
    print(f"[gpu_carry {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, text=True, capture_output=True)
    if proc.returncode:
        sys.exit(f"gpu_carry: pip failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")


# ------------------------------------------------------------------------------------------------ lock / deps


def read_pins(path: Path) -> list[str]:
    return [line.split("#", 1)[0].split()[0] for line in path.read_text().splitlines()
            if line.split("#", 1)[0].strip()]


def wheel_name(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return canon(name), version


def canon(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def cmd_lock(args: argparse.Namespace) -> int:
    """Download every pin (no deps) for the GPU machine and write its file's sha256 into lock.txt."""
    dl = args.carry_dir / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    pins = read_pins(REQUIREMENTS)
    pip("download", "--quiet", "--no-deps", *PLATFORM_ARGS, "-d", str(dl), *pins)
    files = {wheel_name(p): p for p in dl.glob("*.whl")}
    lines = []
    for pin in pins:
        name, version = pin.split("==")
        path = files.get((canon(name), version))
        if path is None:
            sys.exit(f"gpu_carry: no wheel for {pin} in {dl}")
        lines.append(f"{name}=={version} --hash=sha256:{sha256_file(path)}  # {path.name}")
    LOCK.write_text("# The exact wheels scripts/gpu_carry.py carries to the GPU machine (CPython 3.12, x86_64), one\n"
                    "# line each: name==version, the sha256 of the file, its name. Generated from requirements.txt\n"
                    "# by `python3 scripts/gpu_carry.py lock`; installed with --no-deps.\n" + "\n".join(lines) + "\n")
    log(f"wrote {LOCK.relative_to(REPO)}: {len(lines)} wheels")
    return 0


def locked() -> list[tuple[str, str, str, str]]:
    """(name, version, sha256, file name) of every locked wheel."""
    out = []
    for line in LOCK.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        spec, comment = line.split("#", 1)
        pin, hash_arg = spec.split()
        name, version = pin.split("==")
        out.append((name, version, hash_arg.split(":", 1)[1], comment.strip()))
    return out


def fetch_locked(carry: Path) -> list[Path]:
    """The locked wheels in carry/dl, downloaded where missing; every file's sha256 checked."""
    dl = carry / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    wheels = []
    missing = [f"{n}=={v}" for n, v, _, f in locked() if not (dl / f).exists()]
    if missing:
        log(f"downloading {len(missing)} wheels")
        pip("download", "--quiet", "--no-deps", *PLATFORM_ARGS, "-d", str(dl), *missing)
    for name, version, digest, fname in locked():
        path = dl / fname
        if not path.exists():
            sys.exit(f"gpu_carry: {fname} ({name}=={version}) was not downloaded")
        if sha256_file(path) != digest:
            sys.exit(f"gpu_carry: {fname} does not match the lock's sha256 (delete it and build again)")
        wheels.append(path)
    return wheels


def cmd_deps(args: argparse.Namespace) -> int:
    """Every carried wheel's unconditional requirements (markers evaluated for the GPU machine) must be carried or
    on the machine (MACHINE_HAS; versions there are not known here, so only names are checked for those)."""
    import zipfile

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
           "platform_machine": "x86_64", "sys_platform": "linux", "platform_system": "Linux", "extra": ""}
    carried = {canon(n): v for n, v, _, _ in locked()}
    problems = []
    for path in fetch_locked(args.carry_dir):
        with zipfile.ZipFile(path) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode().splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            name = canon(req.name)
            if name in carried:
                if not req.specifier.contains(carried[name], prereleases=True):
                    problems.append(f"{path.name}: needs {req}, carried {carried[name]}")
            elif name not in MACHINE_HAS:
                problems.append(f"{path.name}: needs {req}: neither carried nor on the machine")
    for p in problems:
        print(p)
    print(f"{len(problems)} unmet requirements (vllm's are expected: the heavy paths a bf16 Llama never takes)")
    return 0


# ------------------------------------------------------------------------------------------------ build


def strip_site(site: Path) -> int:
    """Delete STRIP and the non-Python files under STRIP_NON_PY_UNDER; bytes removed."""
    removed = 0
    for rel in STRIP:
        p = site / rel
        if p.is_dir():
            removed += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            shutil.rmtree(p)
        elif p.exists():
            removed += p.stat().st_size
            p.unlink()
        else:
            sys.exit(f"gpu_carry: {rel} is not in the site: the strip list is out of date for these wheels")
    for rel in STRIP_NON_PY_UNDER:
        for f in sorted((site / rel).rglob("*"), reverse=True):
            if f.is_file() and f.suffix != ".py":
                removed += f.stat().st_size
                f.unlink()
            elif f.is_dir() and not any(f.iterdir()):
                f.rmdir()
    if not (site / "vllm" / "third_party" / "pynvml.py").exists():
        sys.exit("gpu_carry: vllm/third_party/pynvml.py is gone: vLLM cannot find CUDA without it")
    return removed


def tree_bytes(root: Path = REPO) -> int:
    """Bytes of what a device call sends from `root`: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    total = 0
    for rel in filter(None, out.split(b"\0")):
        p = root / os.fsdecode(rel)
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def cmd_build(args: argparse.Namespace) -> int:
    carry: Path = args.carry_dir
    wheels = fetch_locked(carry)
    site = carry / "site"
    if site.exists():
        shutil.rmtree(site)
    log(f"laying out {len(wheels)} wheels for CPython 3.12 in {site}")
    pip("install", "--quiet", "--no-deps", "--no-index", "--no-compile", "--target", str(site), *PLATFORM_ARGS,
        *map(str, wheels))
    raw = sum(f.stat().st_size for f in site.rglob("*") if f.is_file())
    removed = strip_site(site)
    lock_digest = sha256_file(LOCK)
    (site / MARKER).write_text(json.dumps({"lock_sha256": lock_digest, "wheels": [w.name for w in wheels]}, indent=1))
    log(f"site {raw / 1e6:.0f} MB, stripped {removed / 1e6:.0f} MB, left {(raw - removed) / 1e6:.0f} MB; "
        f"tar | xz -{args.level} (takes minutes on 2 cores)")
    archive = carry / "site.tar.xz"
    tar = subprocess.Popen(["tar", "-C", str(site), "--sort=name", "--owner=0", "--group=0", "--numeric-owner",
                            "--mtime=@0", "-cf", "-", "."], stdout=subprocess.PIPE)
    with archive.open("wb") as out:
        xz = subprocess.run(["xz", "-T0", f"-{args.level}", "-c"], stdin=tar.stdout, stdout=out)
    if tar.wait() or xz.returncode:
        sys.exit("gpu_carry: tar | xz failed")
    budget = DEVICE_LIMIT - tree_bytes() - TREE_MARGIN
    manifest = split_archive(archive, carry, budget, lock_digest)
    manifest["site_bytes"] = raw - removed
    log(f"{archive.name}: {manifest['archive_bytes'] / 1e6:.1f} MB in {len(manifest['parts'])} parts of <= "
        f"{max(p['bytes'] for p in manifest['parts']) / 1e6:.1f} MB (call budget {budget / 1e6:.1f} MB: 64 MiB - "
        f"repo - {TREE_MARGIN >> 20} MiB margin)")
    return 0


def split_archive(archive: Path, carry: Path, budget: int, lock_digest: str) -> dict:
    """archive -> carry/p1/site.tar.xz.01, carry/p2/..., equal parts of at most `budget` bytes, each folder with
    the manifest (every part's size and sha256) beside its part."""
    size = archive.stat().st_size
    nparts = -(-size // budget)
    part_bytes = -(-size // nparts)
    for old in carry.glob("p[0-9]*"):
        shutil.rmtree(old)
    parts = []
    with archive.open("rb") as f:
        for i in range(1, nparts + 1):
            data = f.read(part_bytes)
            folder = carry / f"p{i}"
            folder.mkdir()
            name = f"site.tar.xz.{i:02d}"
            (folder / name).write_bytes(data)
            parts.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"lock_sha256": lock_digest, "archive_sha256": sha256_file(archive), "archive_bytes": size,
                "parts": parts}
    for i in range(1, nparts + 1):
        (carry / f"p{i}" / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# ------------------------------------------------------------------------------------------------ assemble


class _Concat(io.RawIOBase):
    """The parts, read back to back as one stream."""

    def __init__(self, paths: list[Path]):
        self.files = [p.open("rb") for p in paths]

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self.files:
            n = self.files[0].readinto(buf)
            if n:
                return n
            self.files.pop(0).close()
        return 0


def cmd_assemble(args: argparse.Namespace) -> int:
    """Unpack the parts into --site, unless it already holds this build. Standard library only (GPU machine)."""
    parts_dir, site = Path(args.parts), Path(args.site)
    marker = site / MARKER
    want = args.lock_sha256 or sha256_file(LOCK)  # the lock travels with the repo
    if marker.exists() and json.loads(marker.read_text()).get("lock_sha256") == want:
        print(f"assemble: {site} already holds this build")
        return 0
    # the manifest that came with the parts being assembled first; a carry folder's (a part that travelled with
    # this call) only where the parts folder has none: a repo whose .carry holds another build then cannot make
    # good parts look damaged
    manifests = sorted(parts_dir.glob("manifest.json")) + sorted(args.carry_dir.glob("p*/manifest.json"))
    if not manifests:
        sys.exit(f"assemble: {site} does not hold this build and there is no manifest.json in {args.carry_dir}/p*/ "
                 f"or {parts_dir}: run the part calls")
    manifest = json.loads(manifests[0].read_text())
    if manifest["lock_sha256"] != want:
        sys.exit("assemble: the parts were built from another lock.txt than this repo's: build them again")
    for folder in args.carry_dir.glob("p*"):  # a part that travelled with this call
        for part in folder.glob("site.tar.xz.*"):
            if not (parts_dir / part.name).exists():
                parts_dir.mkdir(parents=True, exist_ok=True)
                shutil.copy(part, parts_dir / part.name)
    bad = []
    for p in manifest["parts"]:
        path = parts_dir / p["name"]
        if not path.exists():
            bad.append(f"{p['name']} missing")
        elif path.stat().st_size != p["bytes"] or sha256_file(path) != p["sha256"]:
            bad.append(f"{p['name']} damaged")
    if bad:
        sys.exit(f"assemble: {', '.join(bad)} in {parts_dir} (the machine was given back between calls, or a part "
                 "call failed): run the part calls again")
    t0 = time.monotonic()
    tmp = site.with_name(site.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    stream = io.BufferedReader(_Concat([parts_dir / p["name"] for p in manifest["parts"]]), 1 << 20)
    with tarfile.open(fileobj=stream, mode="r|xz") as tar:
        tar.extractall(tmp, filter="tar")
    shutil.rmtree(site, ignore_errors=True)
    tmp.rename(site)
    n = sum(1 for _ in site.rglob("*"))
    print(f"assemble: {len(manifest['parts'])} parts -> {site} ({n} entries) in {time.monotonic() - t0:.1f} s")
    return 0


# ------------------------------------------------------------------------------------------------ calls


def part_command(i: int, n: int, extra: str) -> str:
    return (f"set -e; mkdir -p /tmp/parts; cp .carry/p{i}/* /tmp/parts/; "
            f"echo part {i}/{n}: $(ls /tmp/parts | tr '\\n' ' '); {extra}")


def stack_command(shapes: list[str], args: argparse.Namespace) -> str:
    """The GPU check's stack: /tmp/site assembled from /tmp/parts, then scripts/gpu_stack.py into $OUT/stack/."""
    return (f"PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py stack $OUT --stack-shapes {','.join(shapes)} "
            f"--models /tmp/models --parts-dir /tmp/parts --site /tmp/site --deadline-s {args.deadline_s} 2>&1")


def cmd_calls(args: argparse.Namespace) -> int:
    manifests = sorted(args.carry_dir.glob("p*/manifest.json"))
    if not manifests:
        sys.exit("gpu_carry: no parts: run `python3 scripts/gpu_carry.py build` first")
    manifest = json.loads(manifests[0].read_text())
    n = len(manifest["parts"])
    shapes = [s for s in args.shapes.split(",") if s]
    # Checkpoints are written during the part calls (each ~25-35 s on the GPU), so the last call only serves.
    make = [f"python3 scripts/gpu_make_shape_model.py {s} /tmp/models/{s}" for s in shapes]
    per_call: list[list[str]] = [[] for _ in range(n)]
    for j, m in enumerate(make):
        per_call[min(j, max(n - 2, 0))].append(m)
    calls = []
    for i in range(1, n):
        calls.append({"carry": [f".carry/p{i}"], "timeout_s": 240,
                      "command": part_command(i, n, "; ".join(per_call[i - 1]) or "true")})
    # the last call only serves: a checkpoint not written by a part call (one part) is gpu_stack.py's to write
    calls.append({"carry": [f".carry/p{n}"], "timeout_s": 600,
                  "command": f"mkdir -p /tmp/parts; cp .carry/p{n}/* /tmp/parts/; {stack_command(shapes, args)}"})
    again = stack_command(shapes[-1:], args)
    followup = {"when": f"only if the last call skipped {shapes[-1]} and within 30 s of it (/tmp kept)",
                "carry": [], "timeout_s": 600, "command": again}
    tree = tree_bytes()
    for c in [*calls, followup]:
        if len(c["command"]) > COMMAND_LIMIT:
            sys.exit(f"gpu_carry: a command is {len(c['command'])} characters (limit {COMMAND_LIMIT})")
    biggest = max(p["bytes"] for p in manifest["parts"])
    print(json.dumps({"tree_bytes": tree, "largest_part_bytes": biggest,
                      "largest_call_bytes": tree + biggest + 2 * len(json.dumps(manifest)),
                      "limit_bytes": DEVICE_LIMIT, "calls": calls, "followup": followup}, indent=1))
    if tree + biggest > DEVICE_LIMIT:
        sys.exit("gpu_carry: the repo grew: a part no longer fits beside it; build again")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--carry-dir", type=Path, default=CARRY)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("lock")
    sub.add_parser("deps")
    b = sub.add_parser("build")
    b.add_argument("--level", default="6", help="xz preset (default 6; 9e saves a few % at many times the time)")
    c = sub.add_parser("calls")
    c.add_argument("--shapes", default="llama-8b,llama-1b")
    c.add_argument("--deadline-s", type=int, default=570,
                   help="seconds after the last call starts by which the stack has stopped its work (limit 600)")
    a = sub.add_parser("assemble")
    a.add_argument("--parts", default="/tmp/parts")
    a.add_argument("--site", default="/tmp/site")
    a.add_argument("--lock-sha256", help="expected build (default: the sha256 of images/gpu-carry/lock.txt)")
    args = ap.parse_args(argv)
    return {"lock": cmd_lock, "deps": cmd_deps, "build": cmd_build, "calls": cmd_calls,
            "assemble": cmd_assemble}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
