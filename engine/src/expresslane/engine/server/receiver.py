"""The one place that wires the real KV receiver (expresslane.engine.transfer) to the decode server."""

from __future__ import annotations

from ..decode import DecodeEngine
from .config import ServerConfig
from .kv_source import KVSource


def build_receiver(config: ServerConfig, engine: DecodeEngine) -> KVSource:
    """The control-plane TCP server on --ctrl-port + NIXL receive buffer, sized by the engine's geometry."""
    from expresslane.engine.transfer.receiver import KVReceiver  # NIXL is only needed when serving for real

    g = engine.geometry
    return KVReceiver(
        g.num_layers, g.num_kv_heads, g.head_dim, str(g.dtype).removeprefix("torch."), g.device,
        g.max_seq_len, host=config.host, advertise_host=config.advertise_host, ctrl_port=config.ctrl_port,
    )
