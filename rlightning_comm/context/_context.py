"""CommContext: the process-wide registry mode -> communicator, and group creation."""

from __future__ import annotations

import threading
import warnings
from datetime import timedelta
from typing import ClassVar

import torch.distributed as dist
from typing_extensions import Self

from rlightning_comm import debug, rendezvous
from rlightning_comm import stats as _stats
from rlightning_comm._env import argument_from_env, env_debug
from rlightning_comm.communicators import _objects
from rlightning_comm.communicators.base import Communicator
from rlightning_comm.communicators.nccl import enable_blocking_wait
from rlightning_comm.communicators.registry import get_communicator_class
from rlightning_comm.config import DEFAULT_BACKEND, DEFAULT_TIMEOUT, DefaultTimeout, DistributedConfig, GroupConfig
from rlightning_comm.connect import Connections
from rlightning_comm.context._connect import ContextConnect
from rlightning_comm.context._groups import new_group
from rlightning_comm.context._layouts import ContextLayouts
from rlightning_comm.context._lookups import ContextLookups
from rlightning_comm.context._planning import ContextPlanning
from rlightning_comm.context._policies import ContextPolicies
from rlightning_comm.errors import CommError
from rlightning_comm.modes import CommMode, mode_name

_GLOBAL = CommMode.GLOBAL.value


def initialize_distributed_env(
    rank: int,
    world_size: int,
    backend: str = DEFAULT_BACKEND,
    dist_url: str = "env://",
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    *,
    bounded_wait: bool | None = None,
) -> Communicator:
    """The seed's module function:
    ``CommContext().init_distributed_env(world_size, rank, backend, dist_url, timeout, bounded_wait=...)``.

    Note the argument order, ``rank`` first, as in the seed.

    Returns:
        The communicator bound to ``CommMode.GLOBAL``.
    """
    return CommContext().init_distributed_env(
        world_size=world_size, rank=rank, backend=backend, dist_url=dist_url, timeout=timeout, bounded_wait=bounded_wait
    )


class CommContext(ContextLookups, ContextLayouts, ContextConnect, ContextPolicies, ContextPlanning):
    """The one process-wide registry that binds a :class:`Communicator` to each mode.

    ``CommContext()`` always returns the same object. Initialise the world with :meth:`init_distributed_env` (which
    binds ``CommMode.GLOBAL``), then create further groups with :meth:`init_group`. Every method that takes a mode
    accepts a :class:`CommMode`, a :class:`ParallelMode` or a plain string.

    Lookups (:meth:`get_communicator` and the getters) are lock-free dictionary reads; initialisation and
    :meth:`destroy` hold a lock, so lookups from other threads see either the old or the new binding, never a partial
    one. Initialising the world again with the same arguments is a no-op; with different arguments it is a
    :class:`CommError` until :meth:`destroy` is called. A mode's groups accumulate over :meth:`init_group` calls (one
    group per call or a partition at once), each rank bound to the one that holds it; this registry is the only place
    that binds a mode.

    Debug mode (:meth:`set_debug`, or ``RLIGHTNING_COMM_DEBUG=1`` when the world is initialised) makes every collective
    first compare a fingerprint of the call across its group; see :mod:`rlightning_comm.debug`.
    """

    _instance: ClassVar[CommContext | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    _comms: dict[str, Communicator]
    _configs: dict[str, GroupConfig]
    _dist_config: DistributedConfig | None
    _owns_world: bool
    _launched: bool
    _debug: bool
    _lock: threading.RLock

    def __new__(cls) -> Self:
        instance = cls._instance
        if instance is None:
            with cls._instance_lock:
                if cls._instance is None:
                    instance = super().__new__(cls)
                    instance._lock = threading.RLock()
                    instance._reset()
                    cls._instance = instance
                instance = cls._instance
        return instance

    def _reset(self) -> None:
        self._comms = {}
        self._configs = {}
        self._transfer_sources: dict[str, int] = {}
        self._weight_versions: dict[str, int] = {}  # mode -> the weight version this process committed there
        self._connections = Connections()
        self._dist_config = None
        self._owns_world = False
        self._launched = False
        self._debug = False
        _objects.set_defaults(False, None)
        _stats.disable()  # recording is per initialisation, as debug mode is; the figures stay until reset_stats()

    # ------------------------------------------------------------ initialising
    def init_distributed_env(
        self,
        world_size: int | None = None,
        rank: int | None = None,
        backend: str = DEFAULT_BACKEND,
        dist_url: str = "env://",
        timeout: float | timedelta = DEFAULT_TIMEOUT,
        *,
        bounded_wait: bool | None = None,
    ) -> Communicator:
        """Initialise torch.distributed and bind ``CommMode.GLOBAL`` to the whole world.

        If torch.distributed is already initialised (by the caller), that world is adopted when its size, rank and
        backend match, and left alone by :meth:`destroy`.

        Args:
            world_size: Number of processes; read from ``WORLD_SIZE`` with ``env://`` when omitted.
            rank: Global rank of this process; read from ``RANK`` with ``env://`` when omitted.
            backend: A registered communicator name, ``"nccl"`` or ``"gloo"`` or a custom one.
            dist_url: The torch.distributed init method.
            timeout: Default timeout of every collective, in seconds or a ``timedelta``.
            bounded_wait: On NCCL, make every call of every group this context creates wait on the host for its work,
                within the group's timeout, and raise :class:`CommTimeoutError` / :class:`CommError` as on gloo, instead
                of returning at once and leaving a failure to torch's watchdog, which tears the process down. It sets
                ``TORCH_NCCL_BLOCKING_WAIT=1`` for the process before any group is created (torch then runs no NCCL
                watchdog thread). The cost: no call returns before its data has arrived. No effect on gloo. See the
                failure guide, docs/failures.md. ``None`` (the default) is ``False``.

        With a loopback rendezvous address (``tcp://127.0.0.1:port``, or ``env://`` with such a ``MASTER_ADDR`` outside
        torchrun) the store listens on loopback only; see :mod:`rlightning_comm.rendezvous`.

        In a function run by :func:`rlightning_comm.launch.run` the launcher has initialised the world already: a call
        that asks for that world returns its communicator (every argument left out, or the same as the launcher's:
        ``init_distributed_env()`` asks for nothing in particular), and any other raises ``CommError`` naming what the
        launcher set up.

        Returns:
            The communicator bound to ``CommMode.GLOBAL``.

        Raises:
            KeyError: ``backend`` is not registered.
            ValueError: a bad or missing value (validated before torch.distributed is touched), or ``bounded_wait=True``
                while ``TORCH_NCCL_BLOCKING_WAIT`` turns blocking wait off.
            CommError: already initialised with different arguments.
        """
        with self._lock:
            cls = get_communicator_class(backend)
            if self._launched:
                refusal = self._require_world().refuse_relaunch(
                    world_size, rank, backend, dist_url, timeout, bounded_wait
                )
                if refusal:
                    raise CommError(refusal)
                return self._comms[_GLOBAL]
            if world_size is None or rank is None:
                if not str(dist_url).startswith("env://"):
                    raise ValueError(
                        f"world_size and rank are required with dist_url={dist_url!r}; only env:// reads them from the "
                        "environment"
                    )
                world_size = argument_from_env("WORLD_SIZE", "world_size") if world_size is None else world_size
                rank = argument_from_env("RANK", "rank") if rank is None else rank
            config = DistributedConfig(
                world_size=world_size,
                rank=rank,
                backend=str(backend),
                dist_url=dist_url,
                timeout=float(timeout) if isinstance(timeout, DefaultTimeout) else timeout,
                bounded_wait=bool(bounded_wait),
            )
            debug_from_env = env_debug()
            if self._dist_config is not None:
                if config == self._dist_config:
                    return self._comms[_GLOBAL]
                raise CommError(
                    f"CommContext is already initialised with {self._dist_config!r}; call destroy() before "
                    f"initialising with {config!r}"
                )
            blocking_before = enable_blocking_wait() if config.bounded_wait else False
            if dist.is_initialized():
                got = (dist.get_world_size(), dist.get_rank(), dist.get_backend())
                if got[:2] != (config.world_size, config.rank) or cls.backend not in got[2]:
                    raise CommError(
                        f"torch.distributed is already initialised with world_size={got[0]}, rank={got[1]}, "
                        f"backend={got[2]!r}; "
                        f"expected world_size={config.world_size}, rank={config.rank}, backend {cls.backend!r}"
                    )
                self._owns_world = False
                if config.bounded_wait and cls.backend == "nccl" and not blocking_before:
                    warnings.warn(
                        "init_distributed_env(bounded_wait=True) adopts an NCCL world created without "
                        "TORCH_NCCL_BLOCKING_WAIT=1: "
                        "its calls keep torch's behaviour (no host wait; torch's watchdog handles a failure); groups "
                        "created from now on wait "
                        "within their timeout. Set TORCH_NCCL_BLOCKING_WAIT=1 before initialising the world to bound "
                        "it too",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            else:
                cls.setup_process()
                limit = timedelta(seconds=config.timeout)
                rendezvous.init_process_group(
                    cls.backend, config.dist_url, config.world_size, config.rank, limit, cls.bind_device()
                )
                self._owns_world = True
            self._dist_config = config
            world = tuple(range(config.world_size))
            self._configs[_GLOBAL] = GroupConfig(
                partition=(world,), world_size=config.world_size, backend=backend, timeout=config.timeout
            )
            bounded = config.bounded_wait and (self._owns_world or blocking_before)
            comm = cls(group=dist.group.WORLD, ranks=world, mode=_GLOBAL, timeout=config.timeout, bounded_wait=bounded)
            debug.new_generation(rendezvous.world_store(), config.world_size)
            self._debug = self._debug or debug_from_env
            self._bind(_GLOBAL, comm)
            return comm

    def _mark_launched(self) -> None:
        """Record that :func:`rlightning_comm.launch.run` initialised this process's world (until :meth:`destroy`)."""
        self._launched = True

    def init_group(
        self,
        ranks: list[int] | list[list[int]],
        mode: CommMode | str,
        backend: str | None = None,
        use_cpu: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Communicator:
        """Create process group(s) for ``mode`` and bind this rank to the one that holds it.

        Every rank of the world makes every call, with the same arguments, as torch requires for group creation. Two
        forms, which can be mixed:

        - a partition in one call: ``init_group([[0, 1], [2, 3]], mode)``;
        - one group per call, repeated on every rank (the seed's form): ``init_group([0, 1], mode)`` then
          ``init_group([2, 3], mode)``.

        A call whose group does not hold this rank takes part in creating it and leaves this rank's binding alone; a
        rank in no group of ``mode`` is a non-member (its collectives return ``None``). Group rank ``i`` is the ``i``-th
        rank as declared: ``init_group([3, 0, 1], mode)`` makes global rank 3 group rank 0. Declaring a group again
        (same ranks, same order) is a no-op.

        Args:
            ranks: One list of global ranks, or a list of disjoint lists.
            mode: The mode to bind (not ``GLOBAL``, which the world binds).
            backend: A registered communicator name; ``None`` means the world's.
            use_cpu: Use gloo (CPU) whatever ``backend`` and the world's backend say (as the seed does); a registered
                backend built on gloo is kept.
            timeout: Timeout of this group's collectives; ``None`` means the world's.

        Returns:
            The communicator bound to ``mode`` on this rank after this call (a non-member one if this rank is in none of
            the mode's groups yet).

        Raises:
            ValueError: bad ranks, backend or timeout (before any group is created).
            CommError: not initialised; a rank declared in two different groups of ``mode``, or another backend or
                timeout than the mode's groups so far; an unsorted group on a torch without declared order (all before
                any group is created).
        """
        name = mode_name(mode)
        with self._lock:
            cls, config, new = self._plan_group(ranks, name, backend, use_cpu, timeout)
            comm = self._comms.get(name)
            if not new:
                return comm
            world = self._require_world()
            for part in new:
                group = new_group(part, cls.backend, config.timeout, name)
                if world.rank in part:
                    comm = cls(
                        group=group, ranks=part, mode=name, timeout=config.timeout, bounded_wait=world.bounded_wait
                    )
            if comm is None or not comm.is_member:
                # A non-member of a mode with one group still reports that group's ranks.
                comm = cls(
                    group=None,
                    ranks=config.partition[0] if len(config.partition) == 1 else (),
                    mode=name,
                    timeout=config.timeout,
                )
            self._configs[name] = config
            self._bind(name, comm)
            return comm

    def _bind(self, name: str, comm: Communicator) -> None:
        if self._comms.get(name) is comm:
            return
        if self._debug:
            debug.enable(comm, comm.timeout)
        self._comms[name] = comm
        _stats.on_bind(comm)

    # ---------------------------------------------------------------- teardown
    def destroy(self) -> None:
        """Destroy every group this context created (and the world if it created it), and unbind every mode.

        The context can be initialised again afterwards, with debug mode, stats recording and the object defaults back
        to off. Safe to call when nothing is initialised, and after a peer died or a collective failed: it sends nothing
        to the peers (but tells a connected mode's members that this process leaves), never raises for a group it cannot
        tear down (it warns) and always unbinds every mode.
        """
        with self._lock:
            try:
                connected = self._connections.modes()
                self._connections.close_all()  # tells their members, destroys nothing of torch's
                if dist.is_initialized():
                    world = dist.group.WORLD
                    groups = [
                        comm.group
                        for name, comm in self._comms.items()
                        if comm.group is not None and comm.group is not world and name not in connected
                    ]
                    if self._owns_world:
                        groups.append(None)
                    for group in groups:
                        try:
                            dist.destroy_process_group(group)
                        except Exception as err:  # noqa: BLE001 - a broken group must not stop the teardown
                            warnings.warn(
                                "CommContext.destroy: could not destroy "
                                f"{'the world' if group is None else 'a group'}: {err!r}",
                                RuntimeWarning,
                                stacklevel=2,
                            )
            finally:
                self._reset()
