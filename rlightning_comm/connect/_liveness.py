"""The death watch of one generation of a connected mode: one socket from every member to rank 0, one thread per
process.

gloo does not always notice a member's death (a send to a receiver that died
after posting its receive waits out the group's timeout), so a connected mode
keeps connections of its own: every other member connects to rank 0 while the
generation forms and keeps the connection open. The kernel closes a dead
process's sockets, so a death reaches the other end within milliseconds,
whatever the members are doing. A thread per generation waits on its sockets
(blocked in ``select``: it costs nothing while nobody dies, and no collective
ever looks at it) and reports a loss once:

* rank 0 sees a member's connection close (a death), or that member's
  "leaving" message (it called ``connect`` again, or ``destroy``); it tells
  every other member which member was lost, then closes the generation's
  connections;
* a member sees rank 0's message naming the lost member, rank 0's
  "closing" message (rank 0 re-forms the mode or left), or rank 0's
  connection close (rank 0 died).

A member that is alive but absent (blocked elsewhere) keeps its connection
open: that is a timeout of the group, not a loss.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from rlightning_comm.errors import CommTimeoutError

_NOTE = struct.Struct("!cI")  # a message: kind, member
_HELLO, _LEAVING, _LOST, _CLOSING = b"H", b"B", b"L", b"R"

# (lost member or None, what happened): called once, on the watch's thread.
OnLost = Callable[[int | None, str], None]


def _recv_note(sock: socket.socket) -> tuple[bytes, int] | None:
    try:
        data = sock.recv(_NOTE.size, socket.MSG_WAITALL)
    except OSError:
        return None
    return _NOTE.unpack(data) if len(data) == _NOTE.size else None


class Watch:
    """The sockets of one generation and the thread that watches them.

    Build it with :meth:`host` on rank 0 or :meth:`join` on the other members.
    """

    def __init__(self, peers: dict[int, socket.socket], is_host: bool, on_lost: OnLost, name: str) -> None:
        self._peers = peers  # member -> socket (on a member: {0: its socket to rank 0})
        self._is_host = is_host
        self._on_lost = on_lost
        self._closing = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name=f"rlightning-comm-watch {name}", daemon=True)
        self._thread.start()

    @classmethod
    def host(cls, listener: socket.socket, world_size: int, deadline: float, on_lost: OnLost, name: str) -> Watch:
        """On rank 0: accept every other member's connection (each says its rank), then watch them.

        Raises:
            CommTimeoutError: some member did not connect by ``deadline`` (``time.monotonic()``).
        """
        peers: dict[int, socket.socket] = {}
        try:
            while len(peers) < world_size - 1:
                listener.settimeout(max(0.001, deadline - time.monotonic()))
                try:
                    sock, _ = listener.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, world_size)) - set(peers))
                    raise CommTimeoutError(
                        f"connect on mode {name}: ranks {missing} passed the preflight but did not connect to rank 0 "
                        "in time"
                    ) from None
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                note = _recv_note(sock)
                if note is None or note[0] != _HELLO or note[1] in peers or not 0 < note[1] < world_size:
                    sock.close()  # not a member of this generation
                    continue
                sock.settimeout(None)
                peers[note[1]] = sock
        except BaseException:
            for sock in peers.values():
                sock.close()
            raise
        finally:
            listener.close()
        return cls(peers, True, on_lost, name)

    @classmethod
    def join(cls, address: tuple[str, int], rank: int, deadline: float, on_lost: OnLost, name: str) -> Watch:
        """On a member: connect to rank 0's watch and say this member's rank.

        Raises:
            CommTimeoutError: rank 0 could not be reached by ``deadline``.
        """
        try:
            sock = socket.create_connection(address, timeout=max(0.001, deadline - time.monotonic()))
            sock.sendall(_NOTE.pack(_HELLO, rank))
        except OSError as err:
            raise CommTimeoutError(
                f"connect on mode {name}: could not connect to rank 0's watch at {address[0]}:{address[1]}: {err}"
            ) from err
        sock.settimeout(None)
        return cls({0: sock}, False, on_lost, name)

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        for member, sock in self._peers.items():
            selector.register(sock, selectors.EVENT_READ, member)
        try:
            while True:
                for key, _ in selector.select():
                    if key.data is None or self._closing:
                        return
                    self._report(key.data, _recv_note(key.fileobj))
                    return
        finally:
            selector.close()

    def _report(self, member: int, note: tuple[bytes, int] | None) -> None:
        """One message (or a closed connection) from ``member``: what was lost, told to the others on rank 0."""
        if self._is_host:
            lost: int | None = member
            what = (
                "left the mode (it called connect again, or destroy)"
                if note is not None and note[0] == _LEAVING
                else "died (its connection closed)"
            )
            for other, sock in self._peers.items():
                if other != member:
                    with contextlib.suppress(OSError):
                        sock.sendall(_NOTE.pack(_LOST, member))
        elif note is not None and note[0] == _LOST:
            lost, what = note[1], "was lost (rank 0 saw it die or leave)"
        elif note is not None and note[0] == _CLOSING:
            lost, what = 0, "closed this generation (rank 0 re-forms the mode, or left)"
        else:
            lost, what = 0, "died (its connection closed)"
        self._on_lost(lost, what)
        self._close_sockets()

    def close(self) -> None:
        """Leave: tell the other end (rank 0 tells every member it closes; a member tells rank 0 it leaves), stop the
        thread."""
        self._closing = True
        kind = _CLOSING if self._is_host else _LEAVING
        for sock in list(self._peers.values()):
            with contextlib.suppress(OSError):
                sock.sendall(_NOTE.pack(kind, 0))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._close_sockets()
        self._wake_r.close()
        self._wake_w.close()

    def _close_sockets(self) -> None:
        for sock in self._peers.values():
            with contextlib.suppress(OSError):
                sock.close()
