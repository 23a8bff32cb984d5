#!/usr/bin/env python3
"""Init container: wait until the model's volume holds a verified checkpoint (standard library only).

    wait_model.py [--timeout S]

The model's download/convert Job (kubernetes/components/model-*) writes MODEL_DIR/.expresslane-ready last, after
every file's sha256 matched; this waits for that file (polling every 5 s, a line a minute), so the servers never
start on a half-written checkpoint. Exit 1 after --timeout seconds (default 7200) with what to look at.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeout", type=float, default=7200.0)
    p.add_argument("--poll", type=float, default=5.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    model_dir = Path(os.environ.get("MODEL_DIR", ""))
    if not model_dir.is_absolute():
        print(f"wait-model: MODEL_DIR={str(model_dir)!r} must be an absolute path", file=sys.stderr)
        return 1
    marker = model_dir / ".expresslane-ready"
    start = time.monotonic()
    last = start
    while not marker.exists():
        waited = time.monotonic() - start
        if waited >= args.timeout:
            print(f"wait-model: {marker} did not appear within {args.timeout:g} s: see the model Job's log "
                  "(kubectl get jobs; kubectl logs job/<name>)", file=sys.stderr)
            return 1
        if time.monotonic() - last >= 60:
            print(f"wait-model: waiting for {marker} ({waited:.0f} s)", file=sys.stderr, flush=True)
            last = time.monotonic()
        time.sleep(args.poll)
    print(f"wait-model: {model_dir} ready: {marker.read_text().strip()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
