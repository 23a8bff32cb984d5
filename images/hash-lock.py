#!/usr/bin/env python3
"""Write a pip lock with hashes: every package pinned (`name==version`) with the sha256 of the file pip picks.

    python3 images/hash-lock.py IN OUT [--no-deps] [--exclude NAME ...] [--header TEXT] [-- PIP ARGS...]

IN is a requirements file (top-level wants, or an exact pin list with --no-deps). pip resolves it for this
machine's Python (`pip install --dry-run --ignore-installed --report`, nothing installed; run it on the image's
Python version and platform: python 3.11, x86_64 Linux) and OUT gets one `name==version --hash=sha256:...` per
line, so the Dockerfiles install with `--require-hashes --no-deps`: the exact files, nothing resolved at build.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def resolve(requirements: Path, no_deps: bool, pip_args: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
               "--report", str(report), "-r", str(requirements), *(["--no-deps"] if no_deps else []), *pip_args]
        proc = subprocess.run(cmd, text=True, capture_output=True)
        if proc.returncode != 0:
            sys.exit(f"hash-lock: pip failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(report.read_text())["install"]


def lock_lines(items: list[dict], exclude: set[str]) -> list[str]:
    lines = []
    for item in sorted(items, key=lambda i: i["metadata"]["name"].lower()):
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        if name.lower() in exclude:
            continue
        hashes = item["download_info"].get("archive_info", {}).get("hashes", {})
        if "sha256" not in hashes:
            sys.exit(f"hash-lock: no sha256 for {name}=={version} ({item['download_info'].get('url')})")
        lines.append(f"{name}=={version} --hash=sha256:{hashes['sha256']}")
    return lines


def main() -> int:
    argv = sys.argv[1:]
    pip_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, pip_args = argv[:at], argv[at + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("requirements", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--no-deps", action="store_true", help="IN is already a complete pin list")
    ap.add_argument("--exclude", action="append", default=[], help="package to leave out (repeatable)")
    ap.add_argument("--header", default="", help="comment lines written first (\\n-separated)")
    args = ap.parse_args(argv)
    lines = lock_lines(resolve(args.requirements, args.no_deps, pip_args), {e.lower() for e in args.exclude})
    header = [f"# {h}" if h else "#" for h in args.header.split("\\n")] if args.header else []
    args.out.write_text("\n".join(header + lines) + "\n")
    print(f"hash-lock: wrote {args.out} ({len(lines)} pins with sha256)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
