"""The messages of a connected mode's watch on its sockets: their kinds and layouts, the proof of the mode's secret, and
sending, receiving and connecting without raising (:mod:`._liveness` runs the watch)."""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time

NOTE = struct.Struct("!cI")  # a message: kind, member
HELLO = struct.Struct("!I16s32s")  # a member's answer to the challenge: its rank, its token, the proof
CHALLENGE = 16
PING, ACK, DROPPED, LEAVING, CLOSING = b"P", b"A", b"N", b"B", b"R"
# Rank 0 naming a lost member to the others, by what it saw.
LOST = {
    b"L": "died (its connection closed; rank 0 saw it)",
    b"M": "left the mode (it called connect again, or destroy; rank 0 saw it)",
    b"S": "stopped answering (rank 0 heard no heartbeat from it)",
}
DIED, LEFT, SILENT = LOST
HANDSHAKE_TIMEOUT = 5.0  # how long rank 0 waits for a connection's proof; how long a member waits for rank 0's answer
CONNECT_TRIES = 5  # a refused connection to the watch is tried again (see connect_to)


def proof(secret: str | None, *parts: object) -> bytes:
    """The HMAC-SHA256 of ``parts`` under ``secret`` (32 zero bytes for a mode without a secret)."""
    if secret is None:
        return bytes(32)
    message = "|".join(map(str, parts)).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


def recv_note(sock: socket.socket) -> tuple[bytes, int] | None:
    try:
        data = sock.recv(NOTE.size, socket.MSG_WAITALL)
    except OSError:
        return None
    return NOTE.unpack(data) if len(data) == NOTE.size else None


def send(sock: socket.socket, kind: bytes, member: int = 0) -> bool:
    try:
        sock.sendall(NOTE.pack(kind, member))
    except OSError:
        return False
    return True


def send_raw(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
    except OSError:
        return False
    return True


def connect_to(address: tuple[str, int], deadline: float) -> socket.socket:
    """A connection to rank 0's watch, tried again after a refusal while ``deadline`` allows.

    The listener is open for the generation's whole life, so a refusal is a
    transient: most likely a TIME_WAIT entry of an older connection with the
    same addresses and ports (the listener's port is picked from the range the clients' ports come from), which answers
    the new SYN with a reset.
    """
    for attempt in range(CONNECT_TRIES):
        timeout = max(0.001, min(HANDSHAKE_TIMEOUT, deadline - time.monotonic()))
        try:
            return socket.create_connection(address, timeout=timeout)
        except ConnectionRefusedError:
            if attempt == CONNECT_TRIES - 1 or time.monotonic() + 0.05 >= deadline:
                raise
            time.sleep(0.05)
    raise AssertionError("unreachable")
