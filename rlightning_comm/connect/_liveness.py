"""The watch of one generation of a connected mode: one socket from every member to rank 0, one thread per process.

gloo does not always notice a member's death (a send to a receiver that died after posting its receive waits out the
group's timeout), so a connected mode keeps connections of its own. Every other member connects to rank 0's watch as
soon as it has found the generation to join, before the preflight, proves on it that it holds the mode's secret, and
keeps it open while the generation lives. A thread per generation waits on its sockets (blocked in ``select``; no
collective ever looks at it) and reports a loss once:

* a closed connection: the kernel closes a dead process's sockets, so a death is seen within milliseconds, whatever the
  members are doing;
* silence: both ends send a heartbeat every ``liveness / 4`` seconds, and a peer not heard from for ``liveness`` seconds
  is lost (stopped, hung with its threads, or on a node that went away without closing anything);
* a message: a member "leaving" (it called ``connect`` again, or ``destroy``); rank 0 naming a lost member to the
  others, or "closing" (rank 0 re-forms the mode or left).

On rank 0 the watch starts before the generation opens: it accepts every connection at once and reads each one's proof
with a short read timeout, so a silent connection (a port scanner, a health check) is dropped without delaying anyone; a
connection without the proof is refused. Until rank 0's verdict the connected processes are *candidates*, and the death
of one fails the forming on every member; the verdict admits the counted ones and drops the others (late arrivals),
which leave quietly.

A member alive but absent (blocked elsewhere, in a long step) keeps
answering: its thread sends the heartbeats. That is a timeout of the group,
not a loss.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable

from rlightning_comm.connect._admission import Admission, Peer
from rlightning_comm.connect._messages import (
    ACK,
    CHALLENGE,
    CLOSING,
    DIED,
    DROPPED,
    HELLO,
    LEAVING,
    LEFT,
    LOST,
    PING,
    SILENT,
    connect_to,
    proof,
    recv_note,
    send,
)
from rlightning_comm.errors import CommError, CommTimeoutError

# (lost member or None, what happened): called once, on the watch's thread.
OnLost = Callable[[int | None, str], None]


class Watch(Admission):
    """The sockets of one generation and the thread that watches them.

    Build it with :meth:`host` on rank 0 (before the generation opens) or :meth:`join` on the other members.
    """

    def __init__(self, is_host: bool, on_lost: OnLost, liveness: float, where: str) -> None:
        self._is_host = is_host
        self._on_lost = on_lost
        self._liveness = liveness
        self._interval = liveness / 4
        self._where = where
        self._lock = threading.Lock()
        self._peers: dict[socket.socket, Peer] = {}
        self._admitted: set[str] | None = None  # rank 0: the tokens the verdict counted (None: no verdict yet)
        self._listener: socket.socket | None = None
        self._secret: str | None = None
        self._handshakes: dict[socket.socket, tuple[bytes, float]] = {}  # rank 0: challenge sent, read deadline
        self._closing = False
        self._dropped = False  # a member: rank 0 did not count it (it leaves quietly)
        self._rank: int | None = None  # a member: its rank (rank 0 may name it as the lost one)
        self._awake = time.monotonic()  # when the thread last looked at its sockets
        self._suspect_until = 0.0  # until then the others may have left this process behind (see stalled)
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name=f"rlightning-comm-watch {where}", daemon=True)

    # ----------------------------------------------------------------- building
    @classmethod
    def host(cls, listener: socket.socket, secret: str | None, on_lost: OnLost, liveness: float, where: str) -> Watch:
        """On rank 0: accept the members' connections on ``listener`` (which the watch closes) from now on."""
        watch = cls(True, on_lost, liveness, where)
        listener.setblocking(False)
        watch._listener, watch._secret = listener, secret
        watch._thread.start()
        return watch

    @classmethod
    def join(
        cls,
        address: tuple[str, int],
        rank: int,
        token: str,
        secret: str | None,
        deadline: float,
        on_lost: OnLost,
        liveness: float,
        where: str,
    ) -> Watch:
        """On a member: connect to rank 0's watch, prove the secret, and watch rank 0.

        Raises:
            CommTimeoutError: rank 0's watch could not be reached by ``deadline``, or did not answer.
            CommError: rank 0 refused the proof (the address carries no secret, or another one).
        """
        host, port = address
        try:
            sock = connect_to(address, deadline)
            challenge = sock.recv(CHALLENGE, socket.MSG_WAITALL)
            if len(challenge) == CHALLENGE:
                sock.sendall(HELLO.pack(rank, bytes.fromhex(token), proof(secret, challenge.hex(), rank, token)))
                note = recv_note(sock)
            else:
                note = None
        except OSError as err:
            raise CommTimeoutError(f"{where}: could not reach rank 0's watch at {host}:{port}: {err}") from err
        if note is not None and note[0] == DROPPED:  # the verdict was given without this process
            sock.close()
            watch = cls(False, on_lost, liveness, where)
            watch._dropped = True
            return watch
        if note is None or note[0] != ACK:
            sock.close()
            raise CommError(
                f"{where}: rank 0 refused this process: it could not prove the mode's secret. Pass every member the "
                "address listen() returned on rank 0 (host:port/secret), not the bare host:port"
            )
        sock.settimeout(None)
        watch = cls(False, on_lost, liveness, where)
        watch._rank = rank
        watch._peers[sock] = Peer(sock, 0, "")
        watch._thread.start()
        return watch

    # ------------------------------------------------------------------ rank 0
    def candidates(self) -> dict[str, int]:
        """On rank 0: the tokens of the processes that proved the secret and are connected, with the rank each
        claims."""
        with self._lock:
            return {peer.token: peer.rank for peer in self._peers.values()}

    def admit(self, tokens: set[str]) -> None:
        """On rank 0: the verdict counted ``tokens``; every other candidate is dropped (and leaves quietly)."""
        with self._lock:
            self._admitted = set(tokens)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"a")

    def stalled(self) -> bool:
        """Whether the others may have left this process behind: the watch has not run for three quarters of the
        liveness bound (the process is stopped, or was until a moment ago), or it found such a gap less than the
        liveness bound ago (a loss the others saw meanwhile may still be on its way)."""
        now = time.monotonic()
        return now - self._awake >= 0.75 * self._liveness or now < self._suspect_until

    def dropped(self) -> bool:
        """On a member: whether rank 0 dropped this process (it was not counted)."""
        return self._dropped

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        if self._listener is not None:
            selector.register(self._listener, selectors.EVENT_READ, "listener")
        for sock in self._peers:
            selector.register(sock, selectors.EVENT_READ, "peer")
        next_ping = time.monotonic()
        try:
            while not self._closing:
                now = time.monotonic()
                if now - self._awake > self._liveness / 2:
                    # This thread did not run for that long (the process was stopped, or starved): the silence since is
                    # this process's own. What the peers sent meanwhile (a loss rank 0 named) is read before any of
                    # them is judged silent, and the others may have given up on this process.
                    with self._lock:
                        for peer in self._peers.values():
                            peer.heard = now
                    if now - self._awake >= 0.75 * self._liveness:
                        self._suspect_until = now + self._liveness
                self._awake = now
                if now >= next_ping:
                    next_ping = now + self._interval
                    if self._beat(now):
                        return
                waits = [next_ping] + [deadline for _, deadline in self._handshakes.values()]
                for key, _ in selector.select(max(0.0, min(waits) - time.monotonic())):
                    if self._closing:
                        return
                    if key.data == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                        self._prune(selector)
                    elif key.data == "listener":
                        self._accept(selector)
                    elif key.data == "handshake":
                        self._handshake(selector, key.fileobj)
                    elif self._note(selector, key.fileobj):
                        return
                now = time.monotonic()
                for sock, (_, deadline) in list(self._handshakes.items()):
                    if now >= deadline:  # silent or slow: it cannot hold up the forming
                        self._forget(selector, sock)
        finally:
            selector.close()
            self._close_sockets()

    def _beat(self, now: float) -> bool:
        """Send every peer a heartbeat; report a peer not heard from for ``liveness`` seconds. Whether one was lost."""
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            send(peer.sock, PING)
        for peer in peers:
            if now - peer.heard > self._liveness:
                what = (
                    f"stopped answering (no heartbeat for {self._liveness:g} s: stopped, hung, or its node is "
                    "unreachable)"
                )
                self._report(peer, what, code=SILENT)
                return True
        return False

    def _note(self, selector: selectors.BaseSelector, sock: socket.socket) -> bool:
        """One message (or a closed connection) from a peer; whether a loss was reported."""
        peer = self._peers[sock]
        note = recv_note(sock)
        if note is not None and note[0] == PING:
            peer.heard = time.monotonic()
            return False
        if not self._is_host:
            if note is not None and note[0] == DROPPED:
                self._dropped = True
                return True
            if note is not None and note[0] == SILENT and note[1] == self._rank:
                what = "(this process) stopped answering (rank 0 heard no heartbeat from it): the others left it behind"
                self._report(peer, what, note[1])
            elif note is not None and note[0] in LOST:
                self._report(peer, LOST[note[0]], note[1])
            elif note is not None and note[0] == CLOSING:
                self._report(peer, "closed this generation (rank 0 re-forms the mode, or left)")
            else:
                self._report(peer, "died (its connection closed)")
            return True
        with self._lock:
            counted = self._admitted is None or peer.token in self._admitted
        if not counted:  # a late arrival leaving: not a member of this generation
            self._forget(selector, sock)
            return False
        if note is not None and note[0] == LEAVING:
            self._report(peer, "left the mode (it called connect again, or destroy)", code=LEFT)
        elif note is not None and note[0] == SILENT:  # a member gave up on this process while it was stopped
            what = f"(this process) stopped answering: member {peer.rank} heard no heartbeat from it and left it behind"
            self._report(peer, what, member=0, code=SILENT)
        else:
            self._report(peer, "died (its connection closed)", code=DIED)
        return True

    def _prune(self, selector: selectors.BaseSelector) -> None:
        """On rank 0 after the verdict: drop the candidates it did not count, and stop accepting."""
        with self._lock:
            admitted = self._admitted or set()
            dropped = [sock for sock, peer in self._peers.items() if peer.token not in admitted]
        for sock in dropped:
            send(sock, DROPPED)
            self._forget(selector, sock)

    def _forget(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(sock)
        self._handshakes.pop(sock, None)
        with self._lock:
            self._peers.pop(sock, None)
        sock.close()

    def _report(self, peer: Peer, what: str, member: int | None = None, code: bytes = DIED) -> None:
        """A loss: told to the other members on rank 0 (``code`` says what rank 0 saw), then to this process (once)."""
        lost = peer.rank if member is None else member
        if not self._is_host and code == SILENT:  # rank 0, if it was only stopped, reads why when it resumes
            send(peer.sock, SILENT, lost)
        if self._is_host:
            with self._lock:
                others = [p for p in self._peers.values() if p is not peer or code == SILENT]
            for other in others:  # a silent member too: one that was stopped reads, when it resumes, that it was lost
                send(other.sock, code, lost)
        self._on_lost(lost, what)

    def close(self) -> None:
        """Leave: tell the other end (rank 0 tells every member it closes; a member tells rank 0 it leaves), stop the
        thread."""
        kind = CLOSING if self._is_host else LEAVING
        with self._lock:  # the thread reports nothing more, and closes no socket before the others were told
            self._closing = True
            for peer in self._peers.values():
                send(peer.sock, kind)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._close_sockets()
        self._wake_r.close()
        self._wake_w.close()

    def _close_sockets(self) -> None:
        with self._lock:
            socks = [*self._peers, *self._handshakes]
            if self._listener is not None:
                socks.append(self._listener)
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.close()
