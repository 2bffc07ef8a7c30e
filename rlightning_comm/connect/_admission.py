"""Rank 0's side of a connected mode's watch: accepting a connection, challenging it, and admitting the process that
proves the mode's secret as a candidate (:mod:`._liveness` runs the watch that inherits this)."""

from __future__ import annotations

import hmac
import os
import selectors
import socket
import threading
import time
from typing import Any

from rlightning_comm.connect._messages import ACK, CHALLENGE, DROPPED, HANDSHAKE_TIMEOUT, HELLO, proof, send, send_raw


class Peer:
    """A connection the watch keeps: who is at the other end, and when it was last heard from."""

    def __init__(self, sock: socket.socket, rank: int, token: str) -> None:
        self.sock, self.rank, self.token = sock, rank, token
        self.heard = time.monotonic()


class Admission:
    """Mixin of :class:`~._liveness.Watch`: rank 0's acceptance of connections (on the watch's thread)."""

    _listener: socket.socket | None
    _secret: str | None
    _handshakes: dict[socket.socket, tuple[bytes, float]]
    _lock: threading.Lock
    _admitted: Any
    _peers: dict[socket.socket, Peer]

    def _accept(self, selector: selectors.BaseSelector) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        challenge = os.urandom(CHALLENGE)
        sock.setblocking(True)
        sock.settimeout(HANDSHAKE_TIMEOUT)
        if not send_raw(sock, challenge):
            sock.close()
            return
        self._handshakes[sock] = (challenge, time.monotonic() + HANDSHAKE_TIMEOUT)
        selector.register(sock, selectors.EVENT_READ, "handshake")

    def _handshake(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        """A connection's answer to its challenge: a candidate if it proves the secret, else refused (closed)."""
        challenge, _ = self._handshakes.pop(sock)
        selector.unregister(sock)
        try:
            sock.settimeout(0.2)  # the answer is one small message, sent at once: a partial one is refused
            data = sock.recv(HELLO.size, socket.MSG_WAITALL)
        except OSError:
            data = b""
        if len(data) != HELLO.size:
            sock.close()
            return
        rank, token, mac = HELLO.unpack(data)
        if not hmac.compare_digest(mac, proof(self._secret, challenge.hex(), rank, token.hex())):
            sock.close()  # a process that does not hold the secret: refused
            return
        with self._lock:
            late = self._admitted is not None  # the verdict was given without it: it reads the verdict
            if not late:
                self._peers[sock] = Peer(sock, rank, token.hex())
        if late or not send(sock, ACK):
            if late:
                send(sock, DROPPED)
            with self._lock:
                self._peers.pop(sock, None)
            sock.close()
            return
        sock.settimeout(2.0)
        selector.register(sock, selectors.EVENT_READ, "peer")
