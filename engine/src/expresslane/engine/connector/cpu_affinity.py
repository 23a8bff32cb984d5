"""Keep a CPU prefill's forward thread on the core its OpenMP binding gave it.

On the CPU backend, vLLM's ``NixlConnector`` worker (constructed before ours under ``MultiConnector``)
calls ``os.sched_setaffinity(0, [last core of each NUMA node])`` from the worker's main thread, to reserve
a core for ``start_load_kv`` (vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py). That
thread is also OpenMP's master thread, which runs every forward. On a host split between several servers
(``VLLM_CPU_OMP_THREADS_BIND=0`` for prefill, ``=1`` for decode) every server's forward thread lands on the
same last core. A prefill server is a KV *producer*: it never loads KV, so it needs no such reservation.
:func:`restore_forward_affinity` puts the main thread back on the CPU OpenMP bound it to.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

logger = logging.getLogger(__name__)


def _first_cpu(cpu_list: str) -> int | None:
    m = re.match(r"\s*(\d+)", cpu_list)
    return int(m.group(1)) if m else None


def omp_master_cpu(env: Mapping[str, str]) -> int | None:
    """The CPU vLLM's OpenMP binding pinned this worker's master thread to, from the variables vLLM sets
    in the worker's environment (``utils/ompmultiprocessing.py``); None when threads were not bound."""
    if env.get("GOMP_CPU_AFFINITY"):  # "0 1 2"
        return _first_cpu(env["GOMP_CPU_AFFINITY"])
    m = re.search(r"proclist=\[([^\]]*)\]", env.get("KMP_AFFINITY", ""))  # Intel OpenMP
    if m:
        return _first_cpu(m.group(1))
    if env.get("OMP_PLACES", "").startswith("{"):  # "{0,1,2}"
        return _first_cpu(env["OMP_PLACES"][1:])
    return None


def restore_forward_affinity(env: Mapping[str, str] | None = None) -> int | None:
    """Pin the calling (main) thread back to its OpenMP master CPU if something moved it. Returns the CPU
    when it had to move the thread, else None."""
    cpu = omp_master_cpu(os.environ if env is None else env)
    if cpu is None:
        return None
    current = os.sched_getaffinity(0)
    if current == {cpu}:
        return None
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError as e:
        logger.warning("expresslane: could not pin the forward thread back to CPU %d (now on %s): %s", cpu,
                       sorted(current), e)
        return None
    logger.info("expresslane: the forward thread had been moved to CPU(s) %s (NixlConnector reserves them for "
                "KV loads, which a prefill never does); pinned it back to its OpenMP CPU %d. "
                "Turn off with kv_connector_extra_config restore_omp_affinity=false", sorted(current), cpu)
    return cpu
