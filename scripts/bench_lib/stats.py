"""Client-side statistics of one scenario: percentiles, TTFT / ITL, per-user and aggregate tokens/s.

Definitions (docs/performance.md):
  TTFT        request sent -> first chunk carrying text (includes any router queue wait and the KV handoff)
  ITL         gap between consecutive chunks carrying text (one chunk is usually one token; `tokens_per_chunk`
              says when a lane batches several)
  user tok/s  (completion_tokens - 1) / (last text chunk - first text chunk): decode speed one user sees
  e2e         request sent -> stream finished
  aggregate   sum of completion_tokens / scenario wall time (first request sent -> last request finished)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

__all__ = ["RequestResult", "percentile", "summarize", "distribution", "ScenarioStats"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default
    'linear' method); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Iterable[float], qs: Sequence[int] = (50, 90, 99), scale: float = 1.0,
                 ndigits: int = 3) -> dict[str, float | None]:
    """{"p50": .., "p90": .., ..., "mean": .., "n": ..} of `values * scale`, rounded; Nones when empty."""
    xs = [float(v) * scale for v in values]
    out: dict[str, float | None] = {}
    for q in qs:
        p = percentile(xs, q)
        out[f"p{q}"] = None if p is None else round(p, ndigits)
    out["mean"] = round(sum(xs) / len(xs), ndigits) if xs else None
    out["n"] = len(xs)
    return out


@dataclasses.dataclass
class RequestResult:
    """One request as the client saw it. Times are time.perf_counter() seconds."""

    sent_at: float
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # chunks carrying text
    finished_at: float | None = None
    completion_tokens: int | None = None  # from the usage chunk; None if the server sent none
    status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and bool(self.chunk_times)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tokens(self) -> int:
        """Completion tokens: the usage count, else the number of text chunks (a lower bound)."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)

    @property
    def decode_s(self) -> float | None:
        t = self.chunk_times
        return t[-1] - t[0] if len(t) >= 2 else None

    @property
    def user_tok_s(self) -> float | None:
        """Tokens after the first / time from the first to the last text chunk."""
        d = self.decode_s
        if d is None or d <= 0 or self.tokens < 2:
            return None
        return (self.tokens - 1) / d


@dataclasses.dataclass
class ScenarioStats:
    requests: int
    ok: int
    errors: int
    error_samples: list[str]
    short_outputs: int  # ok requests whose completion_tokens != the requested output length
    completion_tokens: int
    wall_s: float
    ttft_ms: dict
    itl_ms: dict
    e2e_ms: dict
    tokens_per_chunk: float | None
    user_tok_s: dict
    aggregate_tok_s: float | None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def summarize(results: Sequence[RequestResult], expected_tokens: int | None = None,
              wall_s: float | None = None) -> ScenarioStats:
    """Aggregate a scenario's requests. `wall_s` defaults to first sent -> last finished."""
    ok = [r for r in results if r.ok]
    bad = [r for r in results if not r.ok]
    if wall_s is None:
        starts = [r.sent_at for r in results]
        ends = [r.finished_at for r in results if r.finished_at is not None]
        wall_s = (max(ends) - min(starts)) if starts and ends else 0.0
    tokens = sum(r.tokens for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    samples = []
    for r in bad:
        if r.status != 200:
            msg = r.error or f"HTTP {r.status}"
        else:
            msg = r.error or "no text chunks"
        if msg not in samples:
            samples.append(msg)
    short = sum(1 for r in ok if expected_tokens is not None and r.tokens != expected_tokens)
    itls = [g for r in ok for g in r.itls_s]
    return ScenarioStats(
        requests=len(results),
        ok=len(ok),
        errors=len(bad),
        error_samples=samples[:5],
        short_outputs=short,
        completion_tokens=tokens,
        wall_s=round(wall_s, 4),
        ttft_ms=distribution([r.ttft_s for r in ok], (50, 90, 99), scale=1e3),
        itl_ms=distribution(itls, (50, 99), scale=1e3),
        e2e_ms=distribution([r.finished_at - r.sent_at for r in ok if r.finished_at is not None], (50, 90, 99),
                            scale=1e3),
        tokens_per_chunk=round(tokens / chunks, 3) if chunks else None,
        user_tok_s=distribution([v for r in ok if (v := r.user_tok_s) is not None], (10, 50, 90), ndigits=2),
        aggregate_tok_s=round(tokens / wall_s, 2) if wall_s > 0 and ok else None,
    )
