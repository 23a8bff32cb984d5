"""Prometheus text exposition: parse a scrape, subtract two scrapes, read counters and histograms.

The bench scrapes every server before and after each scenario; scenarios run one at a time, so the
difference is that scenario's traffic (nothing else must talk to the stack meanwhile).
"""

from __future__ import annotations

import math
import re

import httpx

__all__ = ["Snapshot", "parse", "scrape", "hist_quantile"]

_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """{(name, frozenset(label items)): value} for every sample line; comments and junk are skipped."""
    out: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line.strip())
        if not m:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        labels = frozenset(_LABEL.findall(m.group("labels") or ""))
        out[(m.group("name"), labels)] = value
    return out


class Snapshot:
    """One scrape (or the difference of two). `available` is False when the endpoint did not answer."""

    def __init__(self, samples: dict[tuple[str, frozenset], float] | None = None, available: bool = True):
        self.samples = samples or {}
        self.available = available

    def __sub__(self, before: "Snapshot") -> "Snapshot":
        if not (self.available and before.available):
            return Snapshot({}, available=False)
        keys = set(self.samples) | set(before.samples)
        return Snapshot({k: self.samples.get(k, 0.0) - before.samples.get(k, 0.0) for k in keys})

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.samples)

    def value(self, name: str, **labels: str) -> float:
        """Sum of every series `name` whose labels include `labels`."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)

    def hist(self, name: str, **labels: str) -> dict:
        """{"count", "sum", "buckets": [(le, cumulative count), ...]} of histogram `name`."""
        want = set(labels.items())
        buckets: dict[float, float] = {}
        for (n, ls), v in self.samples.items():
            if n == name + "_bucket" and want <= ls:
                le = dict(ls).get("le")
                if le is not None:
                    b = math.inf if le in ("+Inf", "Inf") else float(le)
                    buckets[b] = buckets.get(b, 0.0) + v
        return {"count": self.value(name + "_count", **labels), "sum": self.value(name + "_sum", **labels),
                "buckets": sorted(buckets.items())}


def hist_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus histogram_quantile: linear interpolation inside the bucket holding rank q*count.
    `buckets`: sorted (upper bound, cumulative count), the last one +Inf. None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le  # the quantile lies above the last finite bound: report that bound
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def scrape(client: httpx.Client, url: str | None) -> Snapshot:
    """GET url; an unreachable or absent endpoint gives an unavailable snapshot (reported as null)."""
    if not url:
        return Snapshot({}, available=False)
    try:
        r = client.get(url, timeout=10)
        if r.status_code != 200:
            return Snapshot({}, available=False)
        return Snapshot(parse(r.text))
    except httpx.HTTPError:
        return Snapshot({}, available=False)
