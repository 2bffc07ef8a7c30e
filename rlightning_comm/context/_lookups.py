"""CommContext's getters: this rank's place in each bound mode, and the seed's names for the node groups.

Kept apart from the registry in :mod:`rlightning_comm.context`; :class:`CommContext` inherits them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from rlightning_comm._env import launcher_int
from rlightning_comm.config import DistributedConfig, GroupConfig
from rlightning_comm.errors import CommError, ModeNotBoundError
from rlightning_comm.modes import CommMode, mode_name

if TYPE_CHECKING:
    from rlightning_comm.communicators.base import Communicator


class ContextLookups:
    """Mixin of :class:`CommContext`: lock-free reads of the bindings (``get_communicator`` and what reads through it).

    The seed's getters keep the seed's parameter name, ``comm_mode``.
    """

    _configs: dict[str, GroupConfig]
    _weight_versions: dict[str, int]
    _comms: dict[str, Communicator]
    _dist_config: DistributedConfig | None

    # ----------------------------------------------------------------- lookups
    def get_communicator(self, mode: CommMode | str = CommMode.GLOBAL) -> Communicator:
        """Return the communicator bound to ``mode`` on this rank.

        Raises:
            ModeNotBoundError: nothing is bound to ``mode`` (a ``KeyError`` and a ``CommError``); the message lists the
                bound modes.
        """
        try:
            return self._comms[mode]
        except (KeyError, TypeError):
            return self._raise_unbound(mode)

    def _raise_unbound(self, mode: object) -> Communicator:
        name = mode_name(mode)  # TypeError for a non-string mode
        comm = self._comms.get(name)
        if comm is not None:  # bound concurrently since the failed lookup
            return comm
        raise ModeNotBoundError(f"No communicator bound for mode {name!r}; bound modes: {sorted(self._comms)}")

    def is_initialized(self) -> bool:
        """Whether :meth:`init_distributed_env` has run (and :meth:`destroy` has not since)."""
        return self._dist_config is not None

    def bound_modes(self) -> list[str]:
        """Names of the bound modes, sorted."""
        return sorted(self._comms)

    def _require_world(self) -> DistributedConfig:
        config = self._dist_config
        if config is None:
            raise CommError("CommContext is not initialised; call CommContext().init_distributed_env(...) first")
        return config

    # ---------------------------------------------------------------- per mode
    def get_weight_version(self, mode: CommMode | str = CommMode.WEIGHT_TRANSFER) -> int | None:
        """The weight version this process committed on ``mode`` as a destination of a versioned weight sync.

        ``None`` before the first versioned sync on ``mode``, after an unversioned one, and after a non-atomic one
        failed midway (its weights then hold no one version). The record is kept per mode name: it outlives a connected
        mode's generations (a re-formed mode keeps it) and goes with :meth:`destroy`. A process that was never a
        destination on ``mode`` has none, whatever it sent.
        """
        return self._weight_versions.get(mode_name(mode))

    def _record_weight_version(self, mode: str, version: int | None) -> None:
        if version is None:
            self._weight_versions.pop(mode, None)
        else:
            self._weight_versions[mode] = version

    def get_group(self, comm_mode: CommMode | str = CommMode.GLOBAL) -> dist.ProcessGroup | None:
        """The torch process group of ``mode`` (``None`` on a non-member rank, so ``if group is None: return``
        works)."""
        return self.get_communicator(comm_mode).group

    def get_group_config(self, mode: CommMode | str = CommMode.GLOBAL) -> GroupConfig:
        """What ``mode`` was bound with: every group declared for it so far (in declared order), backend name and
        timeout.

        Raises:
            ModeNotBoundError: nothing is bound to ``mode``.
        """
        self.get_communicator(mode)
        return self._configs[mode_name(mode)]

    def get_world_size(self, comm_mode: CommMode | str = CommMode.GLOBAL) -> int:
        """Number of ranks in this rank's group of ``mode``."""
        return self.get_communicator(comm_mode).world_size

    def get_local_rank(self, comm_mode: CommMode | str = CommMode.GLOBAL) -> int:
        """This process's rank within its group of ``mode``: its position in the group's ranks as declared.

        Raises:
            CommError: this rank is not a member of ``mode``.
        """
        return self.get_communicator(comm_mode).rank

    def get_ranks_in_group(self, comm_mode: CommMode | str = CommMode.GLOBAL) -> list[int]:
        """Global ranks of this rank's group of ``mode``, in declared order (entry ``i`` is group rank ``i``).

        On a non-member: the group's ranks if ``mode`` has exactly one group, else ``[]``.
        """
        return list(self.get_communicator(comm_mode).ranks)

    # -------------------------------------------------------------- the world
    def get_global_rank(self) -> int:
        """This process's rank in the world.

        Raises:
            CommError: the context is not initialised.
        """
        return self._require_world().rank

    def is_main_rank(self) -> bool:
        """Whether this process is global rank 0 (the seed's name).

        Raises:
            CommError: the context is not initialised.
        """
        return self._require_world().rank == 0

    # -------------------------------------------------------- the seed's nodes
    def get_in_node_rank(self) -> int:
        """This process's index on its node: the launcher's ``LOCAL_RANK``, read when called (as the seed does).

        Raises:
            CommError: ``LOCAL_RANK`` is not set.
            ValueError: ``LOCAL_RANK`` is not an integer.
        """
        return launcher_int("LOCAL_RANK", "get_in_node_rank()")

    def get_local_world_size(self) -> int:
        """Number of processes on this node: the launcher's ``LOCAL_WORLD_SIZE``, read when called (as the seed does).

        Raises:
            CommError: ``LOCAL_WORLD_SIZE`` is not set.
            ValueError: ``LOCAL_WORLD_SIZE`` is not an integer.
        """
        return launcher_int("LOCAL_WORLD_SIZE", "get_local_world_size()")

    def get_intra_node_process_group(self) -> dist.ProcessGroup | None:
        """``get_group(CommMode.INTRA_NODE)``, the seed's name.

        Raises:
            ModeNotBoundError: ``INTRA_NODE`` is not bound (see :meth:`init_node_groups` or :meth:`init_group`).
        """
        return self.get_group(CommMode.INTRA_NODE)

    def get_inter_node_process_group(self) -> dist.ProcessGroup | None:
        """``get_group(CommMode.INTER_NODE)``, the seed's name.

        Raises:
            ModeNotBoundError: ``INTER_NODE`` is not bound (see :meth:`init_node_groups` or :meth:`init_group`).
        """
        return self.get_group(CommMode.INTER_NODE)
