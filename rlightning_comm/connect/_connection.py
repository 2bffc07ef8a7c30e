"""This process's connected modes: the stores it hosts, and per mode the generation it is in and how it forms.

:class:`Connections` is what :meth:`CommContext.connect`, :meth:`CommContext.listen` and :meth:`CommContext.destroy`
delegate to; each generation is a :class:`~rlightning_comm.connect._generation.Connection`.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from rlightning_comm import rendezvous
from rlightning_comm.communicators.base import Communicator
from rlightning_comm.connect._forming import (
    Opening,
    await_verdict,
    find_generation,
    format_address,
    is_loopback,
    member_info,
    open_generation,
    parse_address,
    post,
    post_verdict,
)
from rlightning_comm.connect._generation import DESTROY, Connection
from rlightning_comm.connect._groups import build_on_thread
from rlightning_comm.connect._judging import Late, decide, judge_late, lost_verdict, raise_error
from rlightning_comm.connect._liveness import Watch
from rlightning_comm.errors import CommError, CommTimeoutError, ModeNotBoundError, PeerLostError
from rlightning_comm.failures import comm_failure

_PREFIX = "rlightning_comm/connect"


class _Hosted:
    """A store this process hosts for connected modes (as their rank 0), its secret, and the last generation it opened
    per mode."""

    def __init__(self, store: dist.TCPStore, secret: str | None) -> None:
        self.store = store
        # A client of its own for what the watch threads post: a client serves one request at a time, and the forming's
        # (gloo's rendezvous among them) may block it for long.
        self.notes = dist.TCPStore(store.host, store.port, None, False, timedelta(seconds=30), use_libuv=True)
        self.secret = secret  # None: a mode formed without listen() on a bare host:port (membership not proven)
        self.nonce = uuid.uuid4().hex  # tells a restarted host's generations from the old one's
        self.generations: dict[str, int] = {}


class Connections:
    """This process's connected modes: the stores it hosts (by address) and each mode's current :class:`Connection`.

    Its own lock guards its tables only: a forming (which waits for the members) holds no lock, so other threads may use
    the context meanwhile.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hosted: dict[tuple[str, int], _Hosted] = {}
        self._current: dict[str, Connection] = {}
        self._forming: dict[str, Connection] = {}  # mode -> the generation being formed by a connect in progress
        self._modes: set[str] = (
            set()
        )  # every mode connect was called for (its binding stays, refusing, after a failure)
        self._joined: dict[str, tuple[tuple[str, int], str, int]] = {}  # mode -> (address, store nonce, key joined)
        self._last: dict[str, int] = {}  # mode -> the number of the last generation this process was in

    def modes(self) -> list[str]:
        """The modes :meth:`connect` was called for, sorted (their last generation may have failed to form)."""
        with self._lock:
            return sorted(self._modes)

    def generation(self, mode: str) -> int:
        """The generation this process is in on ``mode``.

        Raises:
            ModeNotBoundError: ``mode`` is not connected here.
        """
        conn = self._current.get(mode)
        if conn is None:
            raise ModeNotBoundError(
                f"mode {mode!r} is not connected here (its last connect failed, or it never connected); connected "
                f"modes: {sorted(self._current)}"
            )
        return conn.generation

    def listen(self, address: str) -> str:
        """Host the store of connected modes at ``address`` (port 0: one the OS picks); returns
        ``"host:port/secret"``."""
        host, port, secret = parse_address(address)
        with self._lock:
            hosted = self._hosted.get((host, port)) if port else None
            if hosted is None:
                hosted = self._host(host, port, secret or secrets.token_hex(16), address)
            elif secret is not None and secret != hosted.secret:
                raise ValueError(f"this process already hosts {format_address(host, port)} with another secret")
            return format_address(host, hosted.store.port, hosted.secret)

    def _host(self, host: str, port: int, secret: str | None, address: str) -> _Hosted:
        fd = rendezvous.listen_fd(host, port, 128, f"connected modes at {address!r}")
        store = dist.TCPStore(
            host, port, None, True, timedelta(seconds=300), master_listen_fd=fd, use_libuv=True, wait_for_workers=False
        )
        hosted = self._hosted[(host, store.port)] = _Hosted(store, secret)
        return hosted

    def connect(
        self,
        mode: str,
        cls: type[Communicator],
        backend: str,
        rank: int,
        world_size: int,
        address: str,
        timeout: float,
        connect_timeout: float,
        liveness: float,
    ) -> Communicator:
        """Form the next generation of ``mode`` (see :meth:`CommContext.connect`); the previous one on this process is
        closed first."""
        host, port, secret = parse_address(address)
        if rank == 0 and port == 0:
            raise ValueError(
                f"rank 0 cannot connect at {address!r} (port 0): call listen({address!r}) first and pass the address "
                "it returns to every member"
            )
        with self._lock:
            if mode in self._forming:
                raise CommError(f"connect on mode {mode!r} is already in progress in another thread of this process")
            hosted = self._hosted.get((host, port)) if rank == 0 else None
            if hosted is not None and secret is not None and secret != hosted.secret:
                raise ValueError(
                    f"address {address!r} carries another secret than the one this process hosts "
                    f"{format_address(host, port)} with: pass the address listen() returned"
                )
            self._modes.add(mode)
            old = self._current.pop(mode, None)
            last = self._last.get(mode, -1)
            conn = self._forming[mode] = Connection(mode, last + 1, timeout)
            conn.arrival = connect_timeout
        if old is not None:
            old.close("left this generation (connect was called again)")
        deadline = time.monotonic() + connect_timeout
        info = member_info(rank, world_size, backend, cls.backend == "nccl", last)
        info["token"] = uuid.uuid4().hex
        try:
            if rank == 0:
                store, opening, verdict = self._open(conn, mode, host, port, secret, info, deadline, liveness)
            else:
                store, opening, verdict = self._join(conn, mode, host, port, secret, info, deadline, liveness)
            conn.generation = verdict["generation"]
            conn.name = f"connected/{mode}/{opening.nonce[:8]}/{opening.generation}"
            conn.group = build_on_thread(
                cls.backend,
                dist.PrefixStore(f"{opening.generation}/group", store),
                rank,
                world_size,
                conn.timeout,
                host if is_loopback(host) else None,
                conn.name,
                conn.server,
                conn.interrupt,
            )
        except BaseException as err:
            lost = conn.lost  # what the watch saw, before closing marks this process as the one that left
            conn.close("could not form the generation")
            with self._lock:
                self._forming.pop(mode, None)
                if conn.opening is not None:  # decided with this process: the next connect joins a later one
                    self._joined[mode] = ((host, port), conn.opening.nonce, conn.opening.generation)
            if isinstance(err, RuntimeError) and not isinstance(err, CommError):
                if lost is not None and lost[0] is not None:  # the backend failed because a member was lost
                    conn.lost = lost
                    raise conn._lost_error("connect") from err
                # The store failed: on a member, its host (rank 0) is gone; on rank 0, it cannot be.
                if rank != 0:
                    conn.lost = (0, "died (its store closed)")
                    raise conn._lost_error("connect") from err
                error = comm_failure(err, mode, "connect", timeout)
                raise type(error)(str(error).replace(DESTROY, "call connect again on every member")) from err
            raise
        comm = cls(group=conn.group, ranks=range(world_size), mode=mode, timeout=timeout, rank=rank)
        rendezvous.register_store(conn.group, store)  # debug mode's checks go through it
        conn.attach(comm)
        with self._lock:
            self._forming.pop(mode, None)
            if conn.lost is None or conn.lost[0] is not None:  # not closed by destroy() meanwhile
                self._current[mode] = conn
                self._joined[mode] = ((host, port), opening.nonce, opening.generation)
                self._last[mode] = conn.generation
        if conn.lost is not None and conn.lost[0] is None:  # destroy() closed it meanwhile
            raise conn._lost_error("connect")
        # A member lost after this process built the group: the generation formed, and its communicator refuses every
        # call (PeerLostError), as after any loss.
        return comm

    @staticmethod
    def _where(conn: Connection) -> str:
        """How the forming's messages start."""
        return f"connect on mode {conn.mode!r} (generation {conn.generation}, connect_timeout {conn.arrival:g} s)"

    def _open(
        self,
        conn: Connection,
        mode: str,
        host: str,
        port: int,
        secret: str | None,
        info: dict[str, Any],
        deadline: float,
        liveness: float,
    ) -> tuple[dist.Store, Opening, dict[str, Any]]:
        """On rank 0: open the next generation of ``mode`` in the store hosted at the address, watch who comes, decide
        its preflight."""
        with self._lock:
            hosted = self._hosted.get((host, port))
            if hosted is None:  # connect without listen: the secret is the address's, or none (see connect)
                hosted = self._host(host, port, secret, format_address(host, port))
            key = hosted.generations[mode] = hosted.generations.get(mode, -1) + 1
        store = dist.PrefixStore(f"{_PREFIX}/{mode}", hosted.store)
        # The group is built through a client of its own: a build abandoned after a loss keeps its client busy until the
        # group's timeout, and the next generation must not wait for it.
        client = dist.TCPStore(
            hosted.store.host, hosted.store.port, None, False, timedelta(seconds=conn.timeout), use_libuv=True
        )
        listener = socket.create_server(
            (host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=128
        )
        where = f"connect on mode {mode!r}"
        conn.watch = Watch.host(listener, hosted.secret, conn.lose, liveness, where)  # closes the listener
        conn.store, conn.key, conn.server = dist.PrefixStore(f"{_PREFIX}/{mode}", hosted.notes), key, hosted.store
        opening = Opening(key, hosted.nonce, listener.getsockname()[1])
        open_generation(store, opening)
        post(store, opening, info, hosted.secret)
        try:
            verdict = decide(
                store,
                opening,
                info["world_size"],
                hosted.secret,
                info["token"],
                conn.watch.candidates,
                deadline,
                conn.interrupt,
                self._where(conn),
            )
        except PeerLostError as err:
            post_verdict(store, key, lost_verdict(opening, str(err), err.member))
            raise
        conn.watch.admit(set(verdict["admitted"]))
        post_verdict(store, key, verdict)
        conn.generation = verdict["generation"]
        raise_error(verdict, mode)
        return dist.PrefixStore(f"{_PREFIX}/{mode}", client), opening, verdict

    def _join(
        self,
        conn: Connection,
        mode: str,
        host: str,
        port: int,
        secret: str | None,
        info: dict[str, Any],
        deadline: float,
        liveness: float,
    ) -> tuple[dist.Store, Opening, dict[str, Any]]:
        """On another member: find the generation of ``mode`` to join, connect to rank 0's watch, pass the
        preflight."""
        timeout = max(0.001, deadline - time.monotonic())
        try:
            client = dist.TCPStore(host, port, None, False, timedelta(seconds=timeout), use_libuv=True)
        except RuntimeError as err:
            raise CommTimeoutError(
                f"connect on mode {mode!r}: could not reach rank 0's store at {format_address(host, port)} within "
                f"{timeout:g} s: rank 0 has not called connect (or listen) there yet, or it died"
            ) from err
        store = dist.PrefixStore(f"{_PREFIX}/{mode}", client)  # keeps the client alive
        joined = self._joined.get(mode)
        after = joined[1:] if joined is not None and joined[0] == (host, port) else None
        where = f"connect on mode {mode!r}"
        while True:
            opening, decided = find_generation(store, after, deadline, mode, conn.interrupt)
            if not decided:
                try:
                    watch: Watch | None = Watch.join(
                        (host, opening.watch_port),
                        info["rank"],
                        info["token"],
                        secret,
                        deadline,
                        conn.lose,
                        liveness,
                        where,
                    )
                except CommError:
                    # Rank 0 gave its verdict without this process and closed the generation (its watch) meanwhile: this
                    # process reads the verdict, as a late arrival does.
                    if not store.check([f"{opening.generation}/verdict"]):
                        raise
                    watch = None
                if watch is not None and watch.dropped():  # the verdict was given without it
                    watch.close()
                elif watch is not None:
                    conn.watch = watch
                    post(store, opening, info, secret)
            verdict = await_verdict(store, opening, deadline, conn.interrupt, self._where(conn))
            conn.generation, conn.opening = verdict["generation"], opening
            if info["token"] in verdict["admitted"]:
                raise_error(verdict, mode)
                return store, opening, verdict
            if conn.watch is not None:
                conn.watch.close()  # not counted: rank 0 dropped it already
                conn.watch = None
            try:
                judge_late(store, opening, verdict, info, deadline, conn.interrupt, mode, self._where(conn))
            except Late:
                after = (opening.nonce, opening.generation)

    def close_all(self) -> None:
        """Leave every connected mode (and stop a forming in progress) and stop hosting: what
        :meth:`CommContext.destroy` does for them."""
        with self._lock:
            conns = [*self._current.values(), *self._forming.values()]
            self._current.clear()
            self._forming.clear()
            self._modes.clear()
            self._hosted.clear()
            self._joined.clear()
        for conn in conns:
            conn.close("left the mode (destroy)")
