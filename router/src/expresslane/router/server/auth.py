"""Client API keys: parsed from RouterSecrets (ROUTER_API_KEYS + legacy ROUTER_API_KEY), checked in constant time.

One key per line; blank lines and `#` comments are ignored:

    sk-alice-...                                   # every lane, no rate limit
    sk-bob-...   name=bob lanes=native rps=2       # native lane only, 2 requests/s (burst 2)
    sk-ci-...    name=ci  rps=0.5 burst=3          # every lane, a token bucket of 3 refilled at 0.5/s

Fields: `name=` (a label for logs and errors; default `key<N>`, the line number), `lanes=` (comma-separated
subset of native,express; default both), `rps=` (requests per second, > 0; default unlimited), `burst=` (bucket
size, >= 1; default max(1, rps)). A key is the first whitespace-free word of its line.

Checking (`ApiKeys.authenticate`): the presented bearer token is hashed (sha256) and compared with
`hmac.compare_digest` against EVERY configured key's hash (no early exit, equal lengths), so the time does not
depend on which key matched or how many leading bytes were right. Key values never appear in errors, logs or
reprs: only the `name`. No keys configured = authentication off (the entrypoint logs one warning).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import LANES
from ..errors import PermissionDenied, RateLimited, Unauthorized

__all__ = ["ApiKey", "ApiKeys", "AuthConfigError", "TokenBucket", "parse_api_keys"]

_FIELDS = ("name", "lanes", "rps", "burst")


class AuthConfigError(ValueError):
    """ROUTER_API_KEYS cannot be used; the message names the line and field, never the key."""


class TokenBucket:
    """`capacity` tokens, refilled at `rate` per second; `take()` returns 0.0 or the seconds until one is free."""

    def __init__(self, rate: float, capacity: float, clock: Callable[[], float]):
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._tokens = capacity
        self._at = clock()
        self._lock = threading.Lock()

    def take(self) -> float:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return 0.0
            return (1.0 - self._tokens) / self.rate


@dataclass(frozen=True, repr=False)
class ApiKey:
    name: str
    digest: bytes = field(compare=False)  # sha256 of the key; the key itself is not kept
    lanes: frozenset[str] = frozenset(LANES)
    rps: float | None = None
    burst: float | None = None

    def __repr__(self) -> str:
        return f"ApiKey(name={self.name!r}, lanes={sorted(self.lanes)}, rps={self.rps}, burst={self.burst})"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def _parse_line(words: list[str], lineno: int) -> ApiKey:
    key, fields = words[0], words[1:]
    values: dict[str, str] = {}
    where = f"ROUTER_API_KEYS line {lineno}"
    for f in fields:
        k, sep, v = f.partition("=")
        if not sep or k not in _FIELDS:
            raise AuthConfigError(f"{where}: unknown field {k!r} (fields: {', '.join(_FIELDS)}; write KEY first, "
                                  "then name=... lanes=... rps=... burst=...)")
        if k in values:
            raise AuthConfigError(f"{where}: {k}= given twice")
        values[k] = v
    name = values.get("name") or f"key{lineno}"
    where = f"{where} (name={name})"
    lanes = frozenset(LANES)
    if "lanes" in values:
        lanes = frozenset(x.strip() for x in values["lanes"].split(",") if x.strip())
        if not lanes or not lanes <= set(LANES):
            raise AuthConfigError(f"{where}: lanes= must be a comma-separated subset of {','.join(LANES)}")
    rps = burst = None
    if "rps" in values:
        try:
            rps = float(values["rps"])
        except ValueError:
            rps = math.nan
        if not (rps > 0 and math.isfinite(rps)):
            raise AuthConfigError(f"{where}: rps= must be a number > 0, got {values['rps']!r}")
    if "burst" in values:
        if rps is None:
            raise AuthConfigError(f"{where}: burst= needs rps=")
        try:
            burst = float(values["burst"])
        except ValueError:
            burst = math.nan
        if not (burst >= 1 and math.isfinite(burst)):
            raise AuthConfigError(f"{where}: burst= must be a number >= 1, got {values['burst']!r}")
    if rps is not None and burst is None:
        burst = max(1.0, rps)
    if len(key) < 8:
        raise AuthConfigError(f"{where}: the key is shorter than 8 characters")
    return ApiKey(name=name, digest=_digest(key), lanes=lanes, rps=rps, burst=burst)


def parse_api_keys(text: str) -> list[ApiKey]:
    keys: list[ApiKey] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        words = line.split()
        cut = next((i for i, w in enumerate(words) if w.startswith("#")), len(words))  # "# comment" to line end
        if words[:cut]:
            keys.append(_parse_line(words[:cut], lineno))
    seen: dict[bytes, str] = {}
    names: set[str] = set()
    for k in keys:
        if k.digest in seen:
            raise AuthConfigError(f"ROUTER_API_KEYS: the keys named {seen[k.digest]!r} and {k.name!r} are the same key")
        if k.name in names:
            raise AuthConfigError(f"ROUTER_API_KEYS: two keys are named {k.name!r}")
        seen[k.digest] = k.name
        names.add(k.name)
    return keys


class ApiKeys:
    """The configured keys plus one token bucket per rate-limited key."""

    def __init__(self, keys: list[ApiKey], clock: Callable[[], float] = time.monotonic):
        self.keys = list(keys)
        self._buckets = {k.name: TokenBucket(k.rps, k.burst or 1.0, clock) for k in keys if k.rps is not None}

    @classmethod
    def from_text(cls, text: str, clock: Callable[[], float] = time.monotonic) -> "ApiKeys":
        return cls(parse_api_keys(text), clock)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def __repr__(self) -> str:
        return f"ApiKeys({[k.name for k in self.keys]})"

    def match(self, token: str) -> ApiKey | None:
        """The key whose value is `token`, compared in constant time over all keys."""
        d = _digest(token)
        found: ApiKey | None = None
        for k in self.keys:  # no early exit: every key is compared
            if hmac.compare_digest(d, k.digest):
                found = k
        return found

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The caller's key from an `Authorization: Bearer <key>` header (None when auth is off); raises
        Unauthorized (401) or RateLimited (429 + Retry-After)."""
        if not self.keys:
            return None
        scheme, _, token = (authorization or "").strip().partition(" ")
        key = self.match(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
        if key is None:
            raise Unauthorized("missing or invalid API key (send 'Authorization: Bearer <key>')")
        bucket = self._buckets.get(key.name)
        if bucket is not None:
            wait = bucket.take()
            if wait > 0:
                raise RateLimited(f"rate limit of {key.rps:g} requests/s exceeded for API key {key.name!r}; "
                                  f"retry after {math.ceil(wait)} s", retry_after_s=max(1, math.ceil(wait)))
        return key

    @staticmethod
    def check_lane(key: ApiKey | None, lane: str) -> None:
        if key is not None and lane not in key.lanes:
            raise PermissionDenied(f"API key {key.name!r} may not use the {lane} lane (allowed: "
                                   f"{', '.join(sorted(key.lanes))})", param="model")
