"""The express decode server: DecodeEngine behind TileRT's decode-node HTTP contract plus reservations
(/pd/reserve, /pd/decode, /pd/cancel, /health, /ready, /capabilities, /decode_status, /metrics), fed by a KVSource
(the NIXL receiver in production).

    python -m expresslane.engine.server --model DIR --ctrl-port 5556 --http-port 5557
    app = create_app(config, engine, receiver, registry=None)

Modules: config (the one typed config), seats (each request seat's state machine), runner (the seats driven for
real), engine_thread (the one thread that touches the engine: injects, starts, the multi-user steps), health
(engine / control plane / NIXL checks), auth (bearer token), app (HTTP), kv_source (the KVSource contract +
LocalKVSource), receiver (the real one), schemas, errors, metrics.
"""

from .app import create_app
from .config import ServerConfig, parse_args
from .kv_source import KVSource, LocalKVSource, ReceivedKVLike

__all__ = ["KVSource", "LocalKVSource", "ReceivedKVLike", "ServerConfig", "create_app", "parse_args"]
