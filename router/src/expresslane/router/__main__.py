"""`python -m expresslane.router --config FILE`: the only place the router reads the environment.

The YAML config is interpolated with `os.environ` (`${VAR:-default}`), validated into one typed
`RouterConfig`, and served with uvicorn on `listen.host:listen.port` (`--host/--port` override).
Secrets never pass through the YAML: `RouterSecrets.from_env(os.environ)` reads ROUTER_API_KEYS(_FILE),
ROUTER_API_KEY(_FILE), VLLM_API_KEY(_FILE) and EXPRESS_NODE_TOKEN(_FILE) (docs/security.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .server.auth import AuthConfigError, parse_api_keys
from .config import ConfigError, load_config
from .server.requestlog import JsonFormatter, RequestIdFilter
from .server.secrets import RouterSecrets, SecretError


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m expresslane.router", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="router YAML (see compose/config/router.yaml)")
    ap.add_argument("--host", help="override listen.host")
    ap.add_argument("--port", type=int, help="override listen.port")
    ap.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "info"))
    ap.add_argument("--log-format", choices=("text", "json"), default=os.environ.get("LOG_FORMAT", "text"),
                    help="text lines, or one JSON object per line (env LOG_FORMAT)")
    ap.add_argument("--no-access-log", action="store_true",
                    help="no access line per request (method, path, status, lane, duration, request id)")
    ap.add_argument("--check", action="store_true", help="validate the config, print it, and exit")
    return ap


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call is noise


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args.config, os.environ)
        secrets = RouterSecrets.from_env(os.environ)
        n_keys = len(parse_api_keys(secrets.api_keys_text))
    except (ConfigError, SecretError, AuthConfigError) as e:
        print(f"expresslane.router: {e}", file=sys.stderr)
        return 2
    if args.check:
        print(config.model_dump_json(indent=2))
        print(f"# {secrets!r}; {n_keys} client API key(s) parsed", file=sys.stderr)
        return 0
    setup_logging(args.log_level, args.log_format)
    from .app import create_app
    from .server.serving import serve

    app = create_app(config, secrets=secrets, access_log=not args.no_access_log)
    return serve(app, host=args.host or config.listen.host, port=args.port or config.listen.port,
                 log_level=args.log_level.lower(),  # our log handlers, not uvicorn's
                 keepalive_s=config.listen.keepalive_timeout_s)


if __name__ == "__main__":
    raise SystemExit(main())
