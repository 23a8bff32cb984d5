"""The one place that wires the real KV receiver (expresslane.engine.transfer) to the decode server."""

from __future__ import annotations

from ..decode import DecodeEngine
from .config import ServerConfig
from .kv_source import KVSource


def build_receiver(config: ServerConfig, engine: DecodeEngine) -> KVSource:
    """The control-plane TCP server on --ctrl-port + NIXL receive buffer, sized by the engine's geometry (a
    pre-registered receive region per seat, plus one: a region whose abandoned write is still fenced never holds
    up a free seat's next request), with
    the Receiver API's keyword args (docs/protocol.md): peer authentication, connection cap, checksum check and the
    model's fingerprint (same checkpoint directory as the prefill's, so both sides compute the same one)."""
    from expresslane.engine.protocol.layout import model_fingerprint  # noqa: I001 - NIXL only when serving for real
    from expresslane.engine.transfer.receiver import KVReceiver

    g = engine.geometry
    return KVReceiver(
        g.num_layers, g.num_kv_heads, g.head_dim, str(g.dtype).removeprefix("torch."), g.device,
        g.max_seq_len, host=config.host, advertise_host=config.advertise_host, ctrl_port=config.ctrl_port,
        num_slots=engine.seats + 1,
        peer_secret=config.peer_secret, max_connections=config.max_connections,
        verify_checksum=config.verify_checksum, model_fingerprint=model_fingerprint(config.model),
    )
