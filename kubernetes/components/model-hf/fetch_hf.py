#!/usr/bin/env python3
"""The model Job of the GPU overlays: a Hugging Face checkpoint at a pinned revision into the model's volume,
every file checked against the checksum the hub publishes for it.

    fetch_hf.py --repo ORG/NAME --revision COMMIT --out DIR

  1. --revision must be a commit hash (40 hex digits): a branch or tag can move, a commit cannot;
  2. huggingface_hub downloads the snapshot into a staging directory beside DIR (HF_TOKEN, from the optional
     Secret expresslane-hf-token, for gated repositories);
  3. every file is checked against the hub's own record of that revision: the sha256 of an LFS file (the
     weights), the git blob id (sha1 of "blob <size>\\0" + content) of the others; one mismatch fails the Job;
  4. SHA256SUMS of every file, the staging directory renamed to DIR, then the marker .expresslane-ready (holding
     SHA256SUMS' own sha256) last: the servers' wait-model init containers start nothing before it exists.
An existing DIR whose SHA256SUMS still verifies is kept (the Job is idempotent).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import sys
import tempfile
from pathlib import Path

MARKER = ".expresslane-ready"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def git_blob_id(path: Path) -> str:
    h = hashlib.sha1()
    h.update(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_sums(d: Path) -> str:
    lines = [f"{sha256(p)}  {p.relative_to(d)}" for p in sorted(d.rglob("*"))
             if p.is_file() and p.name not in ("SHA256SUMS", MARKER) and ".cache" not in p.parts]
    (d / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    return sha256(d / "SHA256SUMS")


def verify_sums(d: Path) -> bool:
    sums = d / "SHA256SUMS"
    if not sums.exists() or not (d / MARKER).exists():
        return False
    for line in sums.read_text().splitlines():
        digest, _, name = line.partition("  ")
        if not (d / name).is_file() or sha256(d / name) != digest:
            print(f"fetch: {d / name} does not match SHA256SUMS: downloading again", file=sys.stderr)
            return False
    return (d / MARKER).read_text().strip() == sha256(sums)


def check_against_hub(d: Path, siblings) -> None:
    """Each file against the hub's record: lfs.sha256 for LFS files, the git blob id for the others."""
    for s in siblings:
        path = d / s.rfilename
        if not path.is_file():
            raise SystemExit(f"fetch: {s.rfilename} is listed by the hub but was not downloaded")
        if s.lfs is not None:
            got, want, kind = sha256(path), s.lfs.sha256, "sha256"
        else:
            got, want, kind = git_blob_id(path), s.blob_id, "git blob id"
        if got != want:
            raise SystemExit(f"fetch: {s.rfilename}: {kind} {got}, the hub says {want}: refusing the checkpoint")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", required=True)
    p.add_argument("--revision", required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not re.fullmatch(r"[0-9a-f]{40}", args.revision):
        print(f"fetch: --revision {args.revision!r} is not a commit hash (40 hex digits): pin the commit "
              "(settings.yaml modelRevision), a branch or tag can move", file=sys.stderr)
        return 2
    if verify_sums(args.out):
        print(f"fetch: {args.out} present and verified", file=sys.stderr)
        return 0
    from huggingface_hub import HfApi, snapshot_download

    info = HfApi().model_info(args.repo, revision=args.revision, files_metadata=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.out.parent) as t:  # on the volume: the final rename is atomic
        staged = Path(t) / "model"
        snapshot_download(args.repo, revision=args.revision, local_dir=staged)
        shutil.rmtree(staged / ".cache", ignore_errors=True)
        check_against_hub(staged, info.siblings)
        digest = write_sums(staged)
        if args.out.exists():
            shutil.rmtree(args.out)
        staged.rename(args.out)
        (args.out / MARKER).write_text(digest + "\n")
    print(f"fetch: {args.repo}@{args.revision} in {args.out}, every file checked against the hub "
          f"(SHA256SUMS {digest})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
