#!/usr/bin/env python3
"""A preStop drain (standard library only): stop taking new requests, then wait for the ones in flight.

    drain.py --unpublish-wait S --deadline S (--vllm-metrics URL | --decode-status URL [--token-file F])

1. Wait --unpublish-wait seconds. A terminating pod leaves its Service's endpoints at once; the router re-resolves
   its pools every few seconds (DNS, cached up to CoreDNS' TTL) and the gateway drops the endpoint, so no new
   request is sent here after this wait. The server keeps serving meanwhile.
2. Poll the server every second until nothing is in flight:
   --vllm-metrics URL    vLLM's /metrics: vllm:num_requests_running + vllm:num_requests_waiting == 0;
   --decode-status URL   an express node's /decode_status: `idle` (our node: {"state": ...}; TileRT's:
                         {"status": ...}); --token-file: the bearer token our node asks for.
3. Return when idle, when the server no longer answers (nothing left to drain), or after --deadline seconds
   (the longest decode deadline: a request cannot outlive it). Kubernetes then sends SIGTERM; the pod's
   terminationGracePeriodSeconds is larger than the two waits together.
Its lines go to the server's stderr (/proc/1/fd/2), so they are in the container's log (kubectl logs): Kubernetes
keeps a hook's own output only in the event of a failed hook.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable


def vllm_in_flight(text: str) -> float:
    total = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def decode_idle(body: str) -> bool:
    status = json.loads(body)
    return status.get("state", status.get("status")) == "idle"


def fetch(url: str, token: str | None) -> str:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=3) as resp:
        return resp.read().decode()


def drain(idle: Callable[[], bool], unpublish_wait: float, deadline: float, log=print) -> str:
    log(f"drain: waiting {unpublish_wait:g} s for the router and gateway to stop sending requests here")
    time.sleep(unpublish_wait)
    end = time.monotonic() + deadline
    while True:
        try:
            if idle():
                log("drain: nothing in flight")
                return "idle"
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            log(f"drain: the server does not answer ({e}): nothing left to drain")
            return "gone"
        if time.monotonic() >= end:
            log(f"drain: still busy after {deadline:g} s (the longest decode deadline): stopping anyway")
            return "deadline"
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--unpublish-wait", type=float, required=True)
    p.add_argument("--deadline", type=float, required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--vllm-metrics")
    src.add_argument("--decode-status")
    p.add_argument("--token-file")
    args = p.parse_args(argv)
    token = None
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip()
    if args.vllm_metrics:
        def idle() -> bool:
            return vllm_in_flight(fetch(args.vllm_metrics, None)) == 0
    else:
        def idle() -> bool:
            return decode_idle(fetch(args.decode_status, token))
    try:
        out = open("/proc/1/fd/2", "w")  # the server's stderr: the container's log
    except OSError:
        out = sys.stderr
    drain(idle, args.unpublish_wait, args.deadline, log=lambda m: print(m, file=out, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
