"""Secrets from the environment or a secret file, never from config text or the repo (docs/security.md).

Every secret NAME is read from ``NAME_FILE`` (a path, e.g. a compose/k8s secret mount; the file's content,
stripped of surrounding whitespace) or else from ``NAME``. Setting both is an error, so a stale variable cannot
silently shadow a rotated file. Values are never logged; ``describe`` gives a safe one-line origin for logs.

Names used by the engine side:
  EXPRESSLANE_PEER_SECRET   control-plane HMAC secret shared by the prefill connector and every express node
  EXPRESS_NODE_TOKEN        bearer token for the express node's /pd/*, /decode_status, /capabilities
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["SecretError", "describe", "read_secret"]

PEER_SECRET = "EXPRESSLANE_PEER_SECRET"
NODE_TOKEN = "EXPRESS_NODE_TOKEN"


class SecretError(ValueError):
    """A secret is configured in a way that cannot be used (both forms set, unreadable or empty file)."""


def read_secret(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The secret NAME from ``NAME_FILE`` or ``NAME``; None when neither is set (or ``NAME`` is empty)."""
    env = os.environ if env is None else env
    path, value = env.get(f"{name}_FILE") or "", env.get(name) or ""
    if path and value:
        raise SecretError(f"both {name} and {name}_FILE are set; set exactly one")
    if path:
        try:
            text = Path(path).read_text().strip()
        except OSError as e:
            raise SecretError(f"{name}_FILE={path}: cannot read the secret file: {e.strerror}") from None
        if not text:
            raise SecretError(f"{name}_FILE={path}: the secret file is empty")
        return text
    return value or None


def describe(name: str, env: Mapping[str, str] | None = None) -> str:
    """Where NAME comes from, safe to log (never the value)."""
    env = os.environ if env is None else env
    if env.get(f"{name}_FILE"):
        return f"{name} from file {env[f'{name}_FILE']}"
    return f"{name} from the environment" if env.get(name) else f"{name} not set"
