"""Bearer-token guard of the express node's private endpoints (/pd/*, /decode_status, /capabilities).

/health, /ready and /metrics stay open (probes, Prometheus) and never show a rid. With no token configured
everything is open (dev / CI) and the entrypoint logs one warning. The comparison is constant-time.
"""

from __future__ import annotations

import hmac
import json

PROTECTED_PREFIXES = ("/pd/",)
PROTECTED_PATHS = frozenset({"/decode_status", "/capabilities"})


def is_protected(path: str) -> bool:
    return path.startswith(PROTECTED_PREFIXES) or path in PROTECTED_PATHS


class BearerAuth:
    """ASGI middleware: 401 ``{"error": "unauthorized", "message": ...}`` unless ``Authorization: Bearer <token>``."""

    def __init__(self, app, token: str) -> None:
        if not token:
            raise ValueError("BearerAuth needs a non-empty token")
        self.app = app
        self._expected = token.encode()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, credential = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(credential.strip(), self._expected)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not is_protected(scope["path"]) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": "unauthorized",
                           "message": "missing or invalid bearer token (Authorization: Bearer <EXPRESS_NODE_TOKEN>)"
                           }).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="expresslane-node"')]})
        await send({"type": "http.response.body", "body": body})
