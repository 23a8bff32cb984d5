#!/usr/bin/env python3
"""Checks a pod makes before its server starts, then exec's the server (standard library only: every image of the
stack has python3). A failed check exits 1 with one line that says what is wrong and how to fix it; the pod then
restarts (CrashLoopBackOff) and `kubectl describe pod` shows the line (terminationMessagePolicy
FallbackToLogsOnError). Nothing falls back silently.

    start_checks.py [--allow-list] -- COMMAND [ARG...]

RDMA (EXPRESSLANE_RDMA, which must be set: `required` or `off`):
  required  NIXL's UCX must have an RDMA transport and no way to fall back to TCP:
            - UCX_TLS names an RDMA transport (rc, dc, ud and their variants, or ib) and neither tcp nor `all`;
            - UCX_NET_DEVICES names the RDMA ports explicitly (e.g. mlx5_0:1,mlx5_1:1; not empty, not `all`), and
              each one exists under /sys/class/infiniband with its port ACTIVE;
            - /dev/infiniband has a uverbs device this container may open (the RDMA device plugin's resource);
            - the locked-memory limit (RLIMIT_MEMLOCK) is unlimited: NIXL registers the KV cache with the NIC,
              and the container runtime sets this limit (containerd: LimitMEMLOCK=infinity in its systemd unit).
  off       the explicit opt-out (CPU stacks, or a cluster without RDMA where TCP is accepted): one warning line,
            no check.

--allow-list: the prefills' destination allow-list (EXPRESSLANE_ALLOWED_DESTINATIONS, `CIDR:port` / `host:port`
entries) must cover this pod's own address (POD_IP) when it names networks: every pod of the cluster takes its
address from the pod CIDR, so a list whose CIDRs miss this pod would refuse every express node (the express lane
would silently spill to the native lane). A list of exact addresses or names only is not checked.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import resource
import sys
from pathlib import Path

RDMA_TRANSPORTS = {"rc", "rc_v", "rc_x", "rc_mlx5", "rc_verbs", "dc", "dc_x", "dc_mlx5", "ud", "ud_v", "ud_x",
                   "ud_mlx5", "ud_verbs", "ib"}
TCP_TRANSPORTS = {"tcp", "all"}


class CheckFailed(Exception):
    """A start check failed: the message says what and how to fix it."""


def check_rdma(env: dict[str, str], sysfs: Path, dev: Path, memlock: int) -> str:
    mode = env.get("EXPRESSLANE_RDMA", "")
    if mode == "off":
        return ("EXPRESSLANE_RDMA=off: the RDMA check is off on purpose; NIXL may move KV over TCP "
                f"(UCX_TLS={env.get('UCX_TLS', '')!r})")
    if mode != "required":
        raise CheckFailed(f"EXPRESSLANE_RDMA={mode!r}: set it to `required` (GPU stacks: refuse to start without "
                          "an RDMA transport) or `off` (the explicit opt-out: TCP accepted)")
    tls = [t.strip() for t in env.get("UCX_TLS", "").split(",") if t.strip()]
    if not tls or any(t.startswith("^") for t in tls):
        raise CheckFailed(f"UCX_TLS={env.get('UCX_TLS', '')!r}: name the transports explicitly (e.g. "
                          "rc,sm,self,cuda_copy,cuda_ipc), not empty and not a `^` exclusion list")
    if not RDMA_TRANSPORTS & set(tls):
        raise CheckFailed(f"UCX_TLS={','.join(tls)} has no RDMA transport (one of {sorted(RDMA_TRANSPORTS)})")
    fallback = TCP_TRANSPORTS & set(tls)
    if fallback:
        raise CheckFailed(f"UCX_TLS={','.join(tls)} lists {sorted(fallback)}: UCX would fall back to TCP when RDMA "
                          "is missing; drop it, or set EXPRESSLANE_RDMA=off to accept TCP")
    devices = [d.strip() for d in env.get("UCX_NET_DEVICES", "").split(",") if d.strip()]
    if not devices or "all" in devices:
        raise CheckFailed(f"UCX_NET_DEVICES={env.get('UCX_NET_DEVICES', '')!r}: name the RDMA ports "
                          "(e.g. mlx5_0:1,mlx5_1:1; `ibv_devinfo` on the node lists them)")
    for d in devices:
        name, _, port = d.partition(":")
        state_file = sysfs / "class" / "infiniband" / name / "ports" / (port or "1") / "state"
        if not state_file.exists():
            have = sorted(p.name for p in (sysfs / "class" / "infiniband").glob("*"))
            raise CheckFailed(f"UCX_NET_DEVICES names {d}, which this container does not have (RDMA devices: "
                              f"{have or 'none'}): request the RDMA device plugin's resource and name its ports")
        state = state_file.read_text().strip()
        if "ACTIVE" not in state:
            raise CheckFailed(f"RDMA port {d} is {state!r}, not ACTIVE (cable, subnet manager or link down)")
    verbs = sorted((dev / "infiniband").glob("uverbs*"))
    if not verbs:
        raise CheckFailed(f"no {dev / 'infiniband'}/uverbs* in this container: the RDMA device plugin's resource "
                          "is not requested or not installed")
    if not any(os.access(v, os.R_OK | os.W_OK) for v in verbs):
        raise CheckFailed(f"{', '.join(map(str, verbs))}: not readable and writable by uid {os.getuid()}")
    if memlock != resource.RLIM_INFINITY:
        raise CheckFailed(f"locked-memory limit is {memlock} bytes, not unlimited: NIXL cannot register the KV "
                          "cache with the NIC; set LimitMEMLOCK=infinity for the container runtime "
                          "(docs/kubernetes.md, 'Nodes')")
    return f"RDMA: UCX_TLS={','.join(tls)}, devices {', '.join(devices)} ACTIVE, {len(verbs)} uverbs, memlock unlimited"


def check_allow_list(env: dict[str, str]) -> str:
    entries = [e.strip() for e in env.get("EXPRESSLANE_ALLOWED_DESTINATIONS", "").split(",") if e.strip()]
    networks = []
    for e in entries:
        host, _, _port = e.rpartition(":")
        if "/" in host:
            try:
                networks.append(ipaddress.ip_network(host.strip("[]"), strict=False))
            except ValueError as err:
                raise CheckFailed(f"EXPRESSLANE_ALLOWED_DESTINATIONS entry {e!r}: {err}") from None
    if not networks:
        return "allow-list: exact destinations only (not checked against the pod CIDR)"
    pod_ip = env.get("POD_IP", "")
    try:
        addr = ipaddress.ip_address(pod_ip)
    except ValueError:
        raise CheckFailed(f"POD_IP={pod_ip!r} is not an address (set it from status.podIP)") from None
    if not any(addr in n for n in networks if n.version == addr.version):
        raise CheckFailed(f"this pod's address {addr} is outside every network of EXPRESSLANE_ALLOWED_DESTINATIONS "
                          f"({', '.join(map(str, networks))}): the list must name the cluster's pod CIDR, or the "
                          "prefills refuse every express node. Set podCIDR in the overlay's settings.yaml")
    return f"allow-list: {addr} inside {', '.join(map(str, networks))}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--allow-list", action="store_true", help="check the prefills' destination allow-list")
    p.add_argument("--sysfs-root", type=Path, default=Path("/sys"), help=argparse.SUPPRESS)
    p.add_argument("--dev-root", type=Path, default=Path("/dev"), help=argparse.SUPPRESS)
    p.add_argument("--memlock", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...] to exec once the checks pass")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command to run (start_checks.py [--allow-list] -- COMMAND ...)")
    env = dict(os.environ)
    memlock = args.memlock if args.memlock is not None else resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    try:
        lines = [check_rdma(env, args.sysfs_root, args.dev_root, memlock)]
        if args.allow_list:
            lines.append(check_allow_list(env))
    except CheckFailed as e:
        print(f"start check failed: {e}", file=sys.stderr, flush=True)
        return 1
    for line in lines:
        print(f"start check: {line}", file=sys.stderr, flush=True)
    os.execvp(command[0], command)
    return 127  # (execvp does not return)


if __name__ == "__main__":
    sys.exit(main())
