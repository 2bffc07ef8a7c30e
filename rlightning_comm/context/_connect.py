"""CommContext's connected modes: groups of processes from different worlds (or none) that meet at an address.

Kept apart from the registry in :mod:`rlightning_comm.context`, which binds what :mod:`rlightning_comm.connect` forms;
:class:`CommContext` inherits them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import torch

from rlightning_comm.communicators.base import Communicator
from rlightning_comm.communicators.registry import get_communicator_class
from rlightning_comm.config import GroupConfig
from rlightning_comm.connect import Connections
from rlightning_comm.errors import CommError
from rlightning_comm.modes import CommMode, mode_name

_GLOBAL = CommMode.GLOBAL.value


class ContextConnect:
    """Mixin of :class:`CommContext`: :meth:`listen` and :meth:`connect`."""

    _configs: dict[str, GroupConfig]
    _connections: Connections
    _lock: threading.RLock
    _bind: Callable[[str, Communicator], None]

    def listen(self, address: str = "127.0.0.1:0") -> str:
        """Host the store that connected modes meet at, in this process (their rank 0), listening on ``address``'s host
        only, and issue the modes' secret.

        The store stays up until :meth:`destroy` (every generation of every connected mode at this address meets there).
        The returned address carries a secret (``"host:port/secret"``, 32 random hex digits, or the one ``address``
        carries): every member passes that string to :meth:`connect`, and proves on rank 0's watch that it holds the
        secret; a process given only ``"host:port"`` is refused. The secret never goes through the store.

        Args:
            address: ``"host:port"``; port 0 lets the OS pick one. ``"host:port/secret"`` sets the secret (letters,
                digits, ``_``, ``-``; for a launcher that hands every member the same secret).

        Returns:
            ``"host:port/secret"`` with the real port: pass it to every member's :meth:`connect`.

        Raises:
            TypeError, ValueError: a bad address, or another secret than the one this process hosts the address with.
            CommError: the address cannot be listened on.
        """
        with self._lock:
            connections = self._connections
        return connections.listen(address)

    def connect(
        self,
        mode: CommMode | str,
        *,
        rank: int,
        world_size: int,
        address: str,
        backend: str = "gloo",
        timeout: float | timedelta = 1800,
        connect_timeout: float | timedelta | None = None,
        liveness_timeout: float = 10.0,
    ) -> Communicator:
        """Bind ``mode`` to a group of ``world_size`` processes that meet at ``address``, whatever world each is in (or
        none).

        Rank 0 hosts the group's store at ``address`` (see :meth:`listen`); the others connect to it. Each call forms a
        new *generation*: the members prove they hold the secret of ``address``, check that they match (world size,
        ranks, backend, torch version, and NCCL's version and ``NCCL_CUMEM_ENABLE`` for NCCL) and build their own group
        outside torch's world, which nothing of the world touches. The mode is then a mode like any other (every
        collective, ``broadcast_state_dict``, debug mode and stats), whose ranks (``src``, ``dst``, the getters) are its
        own, 0 to ``world_size - 1``.

        When a member dies or leaves, every other member's call in flight and every later call on the mode raises
        :class:`PeerLostError` within milliseconds; when it stops answering (stopped, hung, its node gone without
        closing its connections), within ``liveness_timeout`` plus a quarter of it. A member dying while the generation
        forms makes every other member's ``connect`` raise :class:`PeerLostError` the same way. Re-form the mode by
        calling ``connect`` again on every survivor and on the lost member's replacement (same arguments): that forms
        the next generation. The communicator of an older generation refuses every call. If rank 0 dies, re-form at an
        address the new rank 0 listens on. To grow or shrink the group, every member calls ``connect`` with the new
        ``world_size`` (a departing member stops calling), in any order: a process whose arguments differ from the
        generation formed without it waits for the next one (within ``connect_timeout``) and is judged there.

        The forming holds no lock of the context: other threads may use it meanwhile (another connect on the same mode
        is refused).

        Args:
            mode: The mode to bind (not ``GLOBAL``, nor a mode bound by :meth:`init_group`).
            rank: This process's rank in the mode, 0 to ``world_size - 1``; rank 0 hosts the store.
            world_size: Number of members.
            address: What :meth:`listen` returned on rank 0 (``"host:port/secret"``). On rank 0, a ``"host:port"`` it
                does not host yet makes it host one there, with the secret the address carries, or none: the mode then
                proves no membership (any process that reaches the address may join).
            backend: ``"gloo"``, ``"nccl"`` or a registered communicator built on one of them.
            timeout: The collectives' timeout, in seconds or a ``timedelta``: a member alive but not calling makes the
                others raise :class:`CommTimeoutError` after it.
            connect_timeout: How long this call waits for the members to arrive (``None``: ``timeout``); a member that
                does not come makes the others raise :class:`CommTimeoutError`, naming it. Also how long a process
                whose arguments differ from a generation formed without it waits for the next one.
            liveness_timeout: Seconds without a heartbeat after which a member (or rank 0) counts as lost. Heartbeats
                are sent by a thread of the watch, so a long step or a busy main thread does not count; a process
                stopped (SIGSTOP, a debugger) or frozen longer than this (a garbage collection pause holding the
                interpreter, a C extension holding the GIL) does.

        Returns:
            The communicator bound to ``mode`` on this process.

        Raises:
            TypeError, ValueError, KeyError: a bad argument (before anything is sent).
            RuntimeError: an NCCL backend without CUDA (before anything is sent).
            CommError: rank 0 refused this process (it could not prove the secret), or another thread is connecting the
                mode.
            CommMismatchError: the members do not match (raised on every member, naming who differs); also on a process
                that arrives after the others formed without it, once no later generation opened within
                ``connect_timeout`` (its arguments differ), or whose rank a live member holds.
            CommTimeoutError: a member did not arrive within ``connect_timeout`` (named), or rank 0 could not be
                reached.
            PeerLostError: a member died, left or stopped answering while the generation formed (rank 0
                included: re-form at a new address then), or this process's context was destroyed meanwhile.
        """
        name = mode_name(mode)
        with self._lock:
            cls, config = self._plan_connect(name, rank, world_size, backend, timeout)
            arrival = config.timeout if connect_timeout is None else _seconds(connect_timeout, "connect_timeout")
            if isinstance(liveness_timeout, bool) or not isinstance(liveness_timeout, int | float):
                raise TypeError(f"liveness_timeout must be a number of seconds; got {liveness_timeout!r}")
            if not liveness_timeout > 0:
                raise ValueError(f"liveness_timeout must be > 0 seconds; got {liveness_timeout!r}")
            connections = self._connections
        # The forming waits for the other members: no lock of the context is held meanwhile.
        comm = connections.connect(
            name, cls, backend, rank, world_size, address, config.timeout, arrival, float(liveness_timeout)
        )
        with self._lock:
            if connections is not self._connections:  # destroy() ran meanwhile (and closed the generation)
                raise CommError(f"connect on mode {name!r}: the context was destroyed while the mode formed")
            self._configs[name] = config
            self._bind(name, comm)
            return comm

    def _plan_connect(
        self, name: str, rank: object, world_size: object, backend: str, timeout: float | timedelta
    ) -> tuple[type[Communicator], GroupConfig]:
        """Validate a :meth:`connect` call; creates nothing."""
        if name == _GLOBAL or (name in self._configs and name not in self._connections.modes()):
            raise CommError(
                f"mode {name!r} is bound by {'init_distributed_env' if name == _GLOBAL else 'init_group'}; pick "
                "another mode to connect"
            )
        cls = get_communicator_class(backend)
        if cls.backend not in ("gloo", "nccl"):
            raise ValueError(
                f"backend {backend!r} is built on {cls.backend!r}; a connected mode needs a backend built on 'gloo' or "
                "'nccl'"
            )
        if cls.backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError(
                f"backend {backend!r} needs CUDA, and torch.cuda.is_available() is False; connect with backend='gloo' "
                "on CPU"
            )
        for label, value in (("rank", rank), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{label} must be an int; got {type(value).__name__} {value!r}")
        if not 0 <= rank < world_size:
            raise ValueError(
                f"rank must be in 0..world_size-1 = 0..{world_size - 1}; got rank={rank}, world_size={world_size}"
            )
        config = GroupConfig(
            partition=[list(range(world_size))], world_size=world_size, backend=backend, timeout=timeout
        )
        return cls, config

    def get_generation(self, mode: CommMode | str) -> int:
        """The generation of the connected ``mode`` this process is in (0 for the first :meth:`connect` at an address,
        then 1, 2, ...).

        Raises:
            ModeNotBoundError: ``mode`` is not a connected mode bound on this process.
        """
        return self._connections.generation(mode_name(mode))


def _seconds(value: object, label: str) -> float:
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{label} must be seconds or a timedelta; got {type(value).__name__} {value!r}")
    if not value > 0:
        raise ValueError(f"{label} must be > 0 seconds; got {value!r}")
    return float(value)
