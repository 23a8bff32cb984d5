"""The prefill side of one control connection (blocking sockets): connect, authenticate, then frames.

``open_channel`` connects (optionally TLS), reads the node's challenge (magic and version checked
first), proves the shared secret and checks the node's proof (mutual), then reads the hello. A side
with a secret refuses a node that offers no authentication, and the other way round: both are typed
``AuthError``s that name the fix.
"""

from __future__ import annotations

import socket
import ssl

from expresslane.engine.protocol import auth as a
from expresslane.engine.protocol import messages as m
from expresslane.engine.protocol.errors import AuthError


class Channel:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.session = a.Session.open(side="prefill")

    def send(self, msg: m.Message) -> None:
        self.sock.sendall(m.frame(m.encode_body(self.session.seal(msg.to_wire()))))

    def recv(self) -> m.Message:
        return m.parse(self.session.unseal(m.decode_object(m.recv_body(self.sock))))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_channel(host: str, port: int, *, secret: bytes | None, connect_timeout_s: float, io_timeout_s: float,
                 ssl_context: ssl.SSLContext | None = None) -> tuple[Channel, m.Hello]:
    """Connected, authenticated channel + the node's hello. OSError when the node cannot be reached."""
    peer = f"decode node {host}:{port}"
    sock = socket.create_connection((host, port), timeout=connect_timeout_s)
    try:
        if ssl_context is not None:
            sock = ssl_context.wrap_socket(sock, server_hostname=host)
        sock.settimeout(io_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ch = Channel(sock, peer)
        challenge = m.expect(ch.recv(), m.Challenge)
        assert isinstance(challenge, m.Challenge)
        m.check_magic_version(challenge.magic, challenge.protocol_version, peer=peer)
        if challenge.auth == a.AUTH_HMAC:
            if secret is None:
                raise AuthError(f"{peer} requires control-plane authentication: set EXPRESSLANE_PEER_SECRET "
                                "(or _FILE) on the prefill to the express nodes' secret")
            nonce_d = a.check_nonce(challenge.nonce)
            nonce_p = a.new_nonce()
            ch.send(m.Auth(nonce=nonce_p, proof=a.prefill_proof(secret, nonce_d, nonce_p)))
            ok = ch.recv()
            if not isinstance(ok, m.AuthOk) or not a.verify(a.decode_proof(secret, nonce_d, nonce_p), ok.proof):
                raise AuthError(f"{peer} did not prove the peer secret: wrong EXPRESSLANE_PEER_SECRET on one "
                                "side, or not our node")
            ch.session = a.Session.derive(secret, nonce_d, nonce_p, side="prefill")
        elif secret is not None:
            raise AuthError(f"{peer} offers no authentication but this prefill has EXPRESSLANE_PEER_SECRET set: "
                            "refusing to send KV to it; set the same secret on the express node")
        hello = m.expect(ch.recv(), m.Hello)
        assert isinstance(hello, m.Hello)
        return ch, hello
    except BaseException:
        sock.close()
        raise
