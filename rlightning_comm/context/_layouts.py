"""CommContext's declarative group layouts: parallel modes, node groups, the weight-transfer group.

Each method validates (every mode, before any group exists), then creates its groups through
:meth:`CommContext.init_group`, the one place that binds; the layouts themselves are pure functions in
:mod:`rlightning_comm.topology`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from rlightning_comm._env import parse_int
from rlightning_comm.communicators._objects import all_gather_objects
from rlightning_comm.config import ParallelConfig
from rlightning_comm.modes import CommMode, mode_name
from rlightning_comm.topology import (
    NodePlacement,
    Partition,
    node_partitions,
    parallel_partitions,
    weight_transfer_ranks,
)

if TYPE_CHECKING:
    from rlightning_comm.communicators.base import Communicator
    from rlightning_comm.config import DistributedConfig

_NODE_ENV = {
    "node_rank": ("GROUP_RANK", "NODE_RANK"),
    "local_rank": ("LOCAL_RANK",),
    "local_world_size": ("LOCAL_WORLD_SIZE",),
}


def _local_placement(
    node_rank: int | None, local_rank: int | None, local_world_size: int | None
) -> NodePlacement | str:
    """This rank's placement from the arguments or the launcher's environment, or what is wrong with it."""
    values = {"node_rank": node_rank, "local_rank": local_rank, "local_world_size": local_world_size}
    for name, value in values.items():
        if value is None:
            names = _NODE_ENV[name]
            found = next((n for n in names if n in os.environ), None)
            if found is None:
                return (
                    f"{name} was not given and {' / '.join(names)} is not set in the environment (launch with "
                    f"torchrun or pass {name}=)"
                )
            try:
                value = parse_int(found, os.environ[found])
            except ValueError as err:
                return str(err)
        elif isinstance(value, bool) or not isinstance(value, int):
            return f"{name} must be an int; got {type(value).__name__} {value!r}"
        values[name] = value
    return NodePlacement(**values)


class ContextLayouts:
    """Mixin of :class:`CommContext`: create every group of a declared layout at once."""

    _transfer_sources: dict[str, int]
    init_group: Callable[..., Communicator]
    get_communicator: Callable[..., Communicator]
    _require_world: Callable[[], DistributedConfig]
    _plan_modes: Callable[..., None]

    def _bind_layout(
        self, partitions: dict[str, Partition], backend: str | None, use_cpu: bool, timeout: float | timedelta | None
    ) -> dict[str, Communicator]:
        self._plan_modes(partitions, backend, use_cpu, timeout)
        return {
            mode: self.init_group([list(p) for p in partition], mode, backend, use_cpu, timeout)
            for mode, partition in partitions.items()
        }

    def init_parallel_groups(
        self,
        config: ParallelConfig,
        backend: str | None = None,
        use_cpu: bool = False,
        timeout: float | timedelta | None = None,
    ) -> dict[str, Communicator]:
        """Create every group of ``config``'s tensor-, sequence- and data-parallel modes and bind this rank's.

        Every rank calls this with the same arguments. The layout is
        :func:`rlightning_comm.topology.parallel_partitions` (Megatron's rank
        order: the first axis of ``config.order`` varies fastest).

        Args:
            config: The declared layout; ``TRAIN_DATA_PARALLEL`` is bound too when ``config.bind_train_data_parallel``.
            backend, use_cpu, timeout: As for :meth:`init_group`, for every mode.

        Returns:
            Mode name -> this rank's communicator.

        Raises:
            TypeError: ``config`` is not a :class:`ParallelConfig`.
            ValueError: the sizes do not tile the world (before any group is created).
            CommError: not initialised, or a mode is already bound to other ranks.
        """
        if not isinstance(config, ParallelConfig):
            raise TypeError(f"config must be a ParallelConfig; got {type(config).__name__}")
        return self._bind_layout(
            parallel_partitions(config, self._require_world().world_size), backend, use_cpu, timeout
        )

    def init_node_groups(
        self,
        node_rank: int | None = None,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        backend: str | None = None,
        use_cpu: bool = False,
        timeout: float | timedelta | None = None,
    ) -> dict[str, Communicator]:
        """Bind ``INTRA_NODE`` (the ranks on this node) and ``INTER_NODE`` (the ranks with this local rank on every
        node).

        Every rank's placement is exchanged over ``GLOBAL`` first (one object all-gather), so a bad or uneven placement
        raises the same ``ValueError`` on every rank before any group is created.

        Args:
            node_rank: This node's index; ``None`` reads ``GROUP_RANK`` (torchrun) or ``NODE_RANK``.
            local_rank: This process's index on its node; ``None`` reads ``LOCAL_RANK``.
            local_world_size: Processes per node; ``None`` reads ``LOCAL_WORLD_SIZE``.
            backend, use_cpu, timeout: As for :meth:`init_group`.

        Returns:
            ``{"INTRA_NODE": ..., "INTER_NODE": ...}``: this rank's communicators.

        Raises:
            ValueError: a placement is missing or not an int on some rank, or the nodes are uneven (see
                :func:`rlightning_comm.topology.node_partitions`).
            CommError: not initialised, or a mode is already bound to other ranks.
        """
        self._require_world()
        global_comm = self.get_communicator(CommMode.GLOBAL)
        mine = _local_placement(node_rank, local_rank, local_world_size)
        # Every rank's placement (or its local problem) reaches every rank, so all raise alike instead of some hanging.
        placements: list[NodePlacement | str] = all_gather_objects(mine, global_comm.group, global_comm.device)
        problems = [f"rank {r}: {p}" for r, p in enumerate(placements) if isinstance(p, str)]
        if problems:
            raise ValueError("cannot build the node groups; " + "; ".join(problems))
        return self._bind_layout(node_partitions(placements), backend, use_cpu, timeout)

    def init_weight_transfer_group(
        self,
        src: int,
        dst_ranks: list[int],
        backend: str | None = None,
        use_cpu: bool = False,
        timeout: float | timedelta | None = None,
    ) -> Communicator:
        """Declare a ``WEIGHT_TRANSFER`` group ``[src] + dst_ranks``; ranks in no such group are non-members.

        The source is group rank 0 and the destinations follow in the order given (as the seed's
        ``get_ranks_in_group(WEIGHT_TRANSFER)[0]`` expects). Every rank makes every call; call it once per source to
        declare several disjoint groups (one trainer and its rollout workers each). On a member, the source is
        remembered as :meth:`get_transfer_source` (the default ``src`` of :func:`rlightning_comm.broadcast_state_dict`).

        Args:
            src: Global rank that sends weights (for example trainer rank 0).
            dst_ranks: Global ranks that receive them (for example the rollout workers).
            backend, use_cpu, timeout: As for :meth:`init_group`.

        Raises:
            TypeError, ValueError: bad ranks (before any group is created).
            CommError: not initialised, or a rank already in another group of the mode.
        """
        mode = CommMode.WEIGHT_TRANSFER.value
        ranks = weight_transfer_ranks(src, dst_ranks, self._require_world().world_size)
        comm = self.init_group(list(ranks), mode, backend, use_cpu, timeout)
        if comm.is_member and comm.ranks == ranks:
            self._transfer_sources[mode] = src
        return comm

    def get_transfer_source(self, mode: CommMode | str = CommMode.WEIGHT_TRANSFER) -> int | None:
        """The source of this rank's group of ``mode`` declared by :meth:`init_weight_transfer_group`, or ``None``.

        ``None`` on a non-member, and when this rank's group was declared with :meth:`init_group`.
        """
        self.get_communicator(mode)
        return self._transfer_sources.get(mode_name(mode))
