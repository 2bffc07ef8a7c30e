"""This process's connected modes: the stores it hosts, and per mode the generation it is in.

:class:`Connections` is what :meth:`CommContext.connect`, :meth:`CommContext.listen`
and :meth:`CommContext.destroy` delegate to; :class:`Connection` is one
generation of one mode on this process: its store, its group, its
communicator, its watch (:mod:`._liveness`), and what a loss does to them.

A loss costs the hot path nothing: when the watch reports one,
:meth:`Connection.lose` swaps the communicator's group for a stand-in whose
every method raises :class:`PeerLostError` (so later calls refuse at once,
with no check of their own) and breaks the real group, so calls in flight
fail at once too. The communicator's failure translation, which only runs
when the backend raised, turns what they raise into :class:`PeerLostError`.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from rlightning_comm import rendezvous
from rlightning_comm.communicators.base import Communicator
from rlightning_comm.connect._forming import (
    Late,
    Opening,
    find_generation,
    format_address,
    is_loopback,
    member_info,
    open_generation,
    parse_address,
    preflight,
)
from rlightning_comm.connect._groups import break_group, build_group
from rlightning_comm.connect._liveness import Watch
from rlightning_comm.errors import CommError, CommTimeoutError, ModeNotBoundError, PeerLostError
from rlightning_comm.failures import comm_failure

_PREFIX = "rlightning_comm/connect"
# After a backend error that is not a timeout, how long a call waits for the watch's word on a loss (it comes within
# milliseconds of a death; the backend may notice the closed connection first).
_VERDICT_WAIT = 2.0
_DESTROY = "destroy() the context"  # the advice of comm_failure for a broken group, which a connected mode replaces
_OWN_TIMEOUT = "Application timeout caused pair closure"  # gloo, when a wait of this process timed out


class _Refused:
    """Stands in for the group of a lost (or closed) generation: every method raises :class:`PeerLostError`."""

    def __init__(self, error: Callable[[str], PeerLostError]) -> None:
        self._error = error

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise self._error(name)

        return refuse


class Connection:
    """One generation of a connected mode on this process."""

    def __init__(self, mode: str, generation: int, timeout: float) -> None:
        self.mode = mode
        self.generation = generation
        self.timeout = timeout
        self.comm: Communicator | None = None
        self.group: Any = None
        self.watch: Watch | None = None
        self.lost: tuple[int | None, str] | None = None
        self.lost_at: float | None = None  # time.monotonic() of the loss
        self.name = f"connected/{mode}/{generation}"  # the group's name (debug mode keys its checks by it)
        self._lost_event = threading.Event()
        self._lock = threading.Lock()
        self._failed = False  # a backend error was translated already: the group is broken since

    def attach(self, comm: Communicator) -> None:
        """Make ``comm`` this generation's: its failures are translated here (an instance attribute over the
        class's)."""
        self.comm = comm
        comm._failure = self.failure  # type: ignore[method-assign]
        if self.lost is not None:  # lost while the group was being built
            self._refuse()

    def lose(self, member: int | None, what: str) -> None:
        """A member was lost (on the watch's thread, or by :meth:`close`): refuse every later call, fail every call in
        flight."""
        with self._lock:
            if self.lost is not None:
                return
            self.lost = (member, what)
            self.lost_at = time.monotonic()
        self._refuse()
        if self.group is not None:
            break_group(self.group)
        self._lost_event.set()

    def _refuse(self) -> None:
        if self.comm is not None:
            self.comm._group = _Refused(self._lost_error)

    def _lost_error(self, op: str) -> PeerLostError:
        member, what = self.lost or (None, "was lost")
        mode, g = self.mode, self.generation
        if member is None:
            message = f"{op} on mode {mode!r} (generation {g}) is refused: this process {what}"
        else:
            died = member == 0 and what.startswith("died")
            host = (
                " (rank 0, the store's host: re-form the mode at an address the new rank 0 listens on)" if died else ""
            )
            message = (
                f"{op} on mode {mode!r} (generation {g}) failed: member {member}{host} {what}. The mode refuses every "
                "call until it is "
                f"re-formed: every surviving member, and a replacement for the lost one, calls connect({mode!r}, ...) "
                f"again (generation {g + 1})"
            )
        return PeerLostError(message, mode, g, member)

    def failure(self, op: str, err: BaseException) -> CommError:
        """The communicator's failure translation: :class:`PeerLostError` once a loss is known, else the usual error.

        A timeout of the group stays a :class:`CommTimeoutError` (a member was
        absent) unless the loss was known well before it (then the timeout is
        the loss's doing: gloo's sends to a receiver that died mid-message wait
        it out); any other backend error waits briefly for the watch, which
        tells a death within milliseconds.
        """
        if isinstance(err, PeerLostError):  # the stand-in of a lost generation
            return self._lost_error(op)
        error = comm_failure(err, self.mode, op, self.timeout)
        if _DESTROY not in str(error):  # the backend's own check refused the call here: the group still works
            return error
        first, self._failed = not self._failed, True
        if first and self.lost is None and _OWN_TIMEOUT in str(err):
            # This process's own timeout closed the group's connections during this very call (gloo reports it on the
            # call's other waits); only a later call's failure with that text is a group broken before it.
            error = CommTimeoutError(
                f"{op} on mode {self.mode!r} timed out after {self.timeout:g} s (the group's timeout): a peer did not "
                f"join it; {_DESTROY}. Backend: {err}"
            )
        if isinstance(error, CommTimeoutError):
            if self.lost_at is None or time.monotonic() - self.lost_at < _VERDICT_WAIT:
                return self._re_form_hint(error)
        elif self.lost is None and not self._lost_event.wait(_VERDICT_WAIT):
            return self._re_form_hint(error)
        return self._lost_error(op)

    def _re_form_hint(self, error: CommError) -> CommError:
        """``error`` telling to re-form the mode (all of this process's context need not go)."""
        hint = (
            f"re-form the mode: every member calls connect({self.mode!r}, ...) again (generation {self.generation + 1})"
        )
        return type(error)(str(error).replace(_DESTROY, hint))

    def close(self, what: str) -> None:
        """Leave this generation (the members are told); the communicator refuses every call from now on."""
        if self.watch is not None:
            self.watch.close()
        self.lose(None, what)
        self.group = None  # the backend goes with its last reference (its connections close)


class _Hosted:
    """A store this process hosts for connected modes (as their rank 0), and the last generation it opened per mode."""

    def __init__(self, store: dist.TCPStore) -> None:
        self.store = store
        self.nonce = uuid.uuid4().hex  # tells a restarted host's generations from the old one's
        self.generations: dict[str, int] = {}


class Connections:
    """This process's connected modes: the stores it hosts (by address) and each mode's current :class:`Connection`."""

    def __init__(self) -> None:
        self._hosted: dict[tuple[str, int], _Hosted] = {}
        self._current: dict[str, Connection] = {}
        self._modes: set[str] = (
            set()
        )  # every mode connect was called for (its binding stays, refusing, after a failed re-form)
        self._joined: dict[str, tuple[tuple[str, int], str, int]] = {}  # mode -> (address, store nonce, generation)

    def modes(self) -> list[str]:
        """The modes :meth:`connect` was called for, sorted (their last generation may have failed to form)."""
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
        """Host the store of connected modes at ``address`` (port 0: one the OS picks); returns ``"host:port"``."""
        host, port = parse_address(address)
        if port and (host, port) in self._hosted:
            return format_address(host, port)
        fd = rendezvous.listen_fd(host, port, 128, f"connected modes at {address!r}")
        store = dist.TCPStore(
            host, port, None, True, timedelta(seconds=300), master_listen_fd=fd, use_libuv=True, wait_for_workers=False
        )
        self._hosted[(host, store.port)] = _Hosted(store)
        return format_address(host, store.port)

    def connect(
        self, mode: str, cls: type[Communicator], backend: str, rank: int, world_size: int, address: str, timeout: float
    ) -> Communicator:
        """Form the next generation of ``mode`` (see :meth:`CommContext.connect`); the previous one on this process is
        closed first."""
        host, port = parse_address(address)
        if rank == 0 and port == 0:
            raise ValueError(
                f"rank 0 cannot connect at {address!r} (port 0): call listen({address!r}) first and pass the address "
                "it returns to every member"
            )
        self._modes.add(mode)
        old = self._current.pop(mode, None)
        if old is not None:
            old.close("left this generation (connect was called again)")
        deadline = time.monotonic() + timeout
        info = member_info(rank, world_size, backend, cls.backend == "nccl")
        try:
            if rank == 0:
                conn, store, opening = self._open(mode, host, port, info, deadline, timeout)
            else:
                conn, store, opening = self._join(mode, host, port, info, deadline, timeout)
            try:
                conn.group = build_group(
                    cls.backend,
                    dist.PrefixStore(f"{opening.generation}/group", store),
                    rank,
                    world_size,
                    timeout,
                    host if is_loopback(host) else None,
                    conn.name,
                )
            except BaseException:
                conn.close("could not build the group")
                raise
        except (
            RuntimeError
        ) as err:  # the store or the group build failed: the store's host is gone, or a member never came
            if isinstance(err, CommError):
                raise
            error = comm_failure(err, mode, "connect", timeout)
            raise type(error)(str(error).replace(_DESTROY, "call connect again on every member")) from err
        comm = cls(group=conn.group, ranks=range(world_size), mode=mode, timeout=timeout, rank=rank)
        rendezvous.register_store(conn.group, store)  # debug mode's checks go through it
        conn.attach(comm)
        self._current[mode] = conn
        self._joined[mode] = ((host, port), opening.nonce, opening.generation)
        if conn.lost is not None:  # a member died while the group was being built
            raise conn._lost_error("connect")
        return comm

    @staticmethod
    def _where(mode: str, generation: int, timeout: float) -> str:
        return f"connect on mode {mode!r} (generation {generation}, timeout {timeout:g} s)"

    def _open(
        self, mode: str, host: str, port: int, info: dict[str, Any], deadline: float, timeout: float
    ) -> tuple[Connection, dist.Store, Opening]:
        """On rank 0: open the next generation of ``mode`` in the store hosted at the address, decide its preflight,
        accept its watch."""
        hosted = self._hosted.get((host, port))
        if hosted is None:
            self.listen(format_address(host, port))
            hosted = self._hosted[(host, port)]
        store = dist.PrefixStore(f"{_PREFIX}/{mode}", hosted.store)
        generation = hosted.generations[mode] = hosted.generations.get(mode, -1) + 1
        listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            opening = Opening(generation, hosted.nonce, listener.getsockname()[1])
            open_generation(store, opening)
            preflight(store, generation, info, deadline, self._where(mode, generation, timeout))
        except BaseException:
            listener.close()
            raise
        conn = Connection(mode, generation, timeout)
        conn.watch = Watch.host(listener, info["world_size"], deadline, conn.lose, conn.name)  # closes the listener
        return conn, store, opening

    def _join(
        self, mode: str, host: str, port: int, info: dict[str, Any], deadline: float, timeout: float
    ) -> tuple[Connection, dist.Store, Opening]:
        """On another member: find the generation of ``mode`` to join, pass its preflight, connect to rank 0's watch."""
        try:
            client = dist.TCPStore(host, port, None, False, timedelta(seconds=timeout), use_libuv=True)
        except RuntimeError as err:
            raise CommTimeoutError(
                f"connect on mode {mode!r}: could not reach rank 0's store at {format_address(host, port)} within "
                f"{timeout:g} s: "
                "rank 0 has not called connect (or listen) there yet, or it died"
            ) from err
        store = dist.PrefixStore(f"{_PREFIX}/{mode}", client)  # keeps the client alive
        joined = self._joined.get(mode)
        after = joined[1:] if joined is not None and joined[0] == (host, port) else None
        while True:
            opening = find_generation(store, after, deadline, mode)
            try:
                preflight(store, opening.generation, info, deadline, self._where(mode, opening.generation, timeout))
                break
            except Late:
                after = (opening.nonce, opening.generation)
        conn = Connection(mode, opening.generation, timeout)
        conn.watch = Watch.join((host, opening.watch_port), info["rank"], deadline, conn.lose, conn.name)
        return conn, store, opening

    def close_all(self) -> None:
        """Leave every connected mode and stop hosting: what :meth:`CommContext.destroy` does for them."""
        for conn in self._current.values():
            conn.close("left the mode (destroy)")
        self._current.clear()
        self._modes.clear()
        self._hosted.clear()
