"""The express decode server: DecodeEngine behind TileRT's decode-node HTTP contract (/pd/decode, /pd/cancel,
/health, /capabilities, /decode_status, /metrics), fed by a KVSource (the NIXL receiver in production).

    python -m expresslane.engine.server --model DIR --ctrl-port 5556 --http-port 5557
    app = create_app(config, engine, receiver, registry=None)
"""

from .app import create_app
from .config import ServerConfig, parse_args
from .kv_source import KVSource, LocalKVSource, ReceivedKVLike

__all__ = ["KVSource", "LocalKVSource", "ReceivedKVLike", "ServerConfig", "create_app", "parse_args"]
