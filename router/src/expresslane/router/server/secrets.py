"""The router's secrets, read at the entrypoint from the environment or secret files (docs/security.md).

Never interpolated into the YAML config text and never logged. Each NAME comes from ``NAME_FILE`` (a path:
a compose/k8s secret mount) or else ``NAME``; both set is an error (a stale variable must not shadow a rotated
file).

  ROUTER_API_KEYS       client keys for /v1/*, one per line (``#`` comments and blank lines ignored); each line
                        is ``KEY`` or ``KEY name=<label> lanes=native,express rps=<float>`` (see auth.py)
  ROUTER_API_KEY        the single-key form kept for compatibility (added to ROUTER_API_KEYS)
  VLLM_API_KEY          sent as ``Authorization: Bearer`` to the prefill and native decode vLLM servers
                        (their ``--api-key``)
  EXPRESS_NODE_TOKEN    sent as ``Authorization: Bearer`` to express nodes (/pd/*, /capabilities, ...)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RouterSecrets", "SecretError", "read_secret"]


class SecretError(ValueError):
    """A secret is configured in a way that cannot be used."""


def read_secret(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """NAME from ``NAME_FILE`` or ``NAME``; None when neither is set."""
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


@dataclass(frozen=True, repr=False)
class RouterSecrets:
    api_keys_text: str = ""          # raw ROUTER_API_KEYS (+ ROUTER_API_KEY) lines; parsed by auth.py
    vllm_api_key: str | None = None
    express_node_token: str | None = None

    def __repr__(self) -> str:  # never print a value
        n = sum(1 for ln in self.api_keys_text.splitlines() if ln.strip() and not ln.lstrip().startswith("#"))
        return (f"RouterSecrets(api_keys={n}, vllm_api_key={'set' if self.vllm_api_key else 'unset'}, "
                f"express_node_token={'set' if self.express_node_token else 'unset'})")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "RouterSecrets":
        env = os.environ if env is None else env
        keys = read_secret("ROUTER_API_KEYS", env) or ""
        single = read_secret("ROUTER_API_KEY", env)
        if single:
            keys = f"{keys}\n{single}" if keys else single
        return cls(api_keys_text=keys, vllm_api_key=read_secret("VLLM_API_KEY", env),
                   express_node_token=read_secret("EXPRESS_NODE_TOKEN", env))

    def upstream_headers(self, lane_kind: str) -> dict[str, str]:
        """Authorization for a call to an upstream: 'vllm' (prefill, native decode) or 'express' (a node)."""
        token = self.vllm_api_key if lane_kind == "vllm" else self.express_node_token
        return {"Authorization": f"Bearer {token}"} if token else {}
