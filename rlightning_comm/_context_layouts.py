"""CommContext's declarative group layouts: parallel modes, node groups, the weight-transfer group.

Each method validates, then creates its groups through :meth:`CommContext.init_group`;
the layouts themselves are pure functions in :mod:`rlightning_comm.topology`.
"""

from __future__ import annotations

from datetime import timedelta

from rlightning_comm import layout
from rlightning_comm.communicators.base import Communicator
from rlightning_comm.config import ParallelConfig
from rlightning_comm.modes import CommMode, mode_name


class ContextLayouts:
    """Mixin of :class:`CommContext`: create every group of a declared layout at once."""

    _transfer_sources: dict[str, int]

    def init_parallel_groups(
        self, config: ParallelConfig, backend: str | None = None, use_cpu: bool = False, timeout: float | timedelta | None = None
    ) -> dict[str, Communicator]:
        """Create every group of ``config``'s tensor-, sequence- and data-parallel modes and bind this rank's.

        Every rank calls this with the same arguments. The layout is
        :func:`rlightning_comm.topology.parallel_partitions` (Megatron's rank
        order: the first axis of ``config.order`` varies fastest).

        Args:
            config: The declared layout; ``TRAIN_DATA_PARALLEL`` is bound too
                when ``config.bind_train_data_parallel``.
            backend, use_cpu, timeout: As for :meth:`init_group`, for every mode.

        Returns:
            Mode name -> this rank's communicator.

        Raises:
            TypeError: ``config`` is not a :class:`ParallelConfig`.
            ValueError: the sizes do not tile the world (before any group is created).
            CommError: not initialised, or a mode is already bound to other ranks.
        """
        return layout.init_parallel_groups(self, config, backend, use_cpu, timeout)

    def init_node_groups(
        self,
        node_rank: int | None = None,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        backend: str | None = None,
        use_cpu: bool = False,
        timeout: float | timedelta | None = None,
    ) -> dict[str, Communicator]:
        """Bind ``INTRA_NODE`` (the ranks on this node) and ``INTER_NODE`` (the ranks with this local rank on every node).

        Every rank's placement is exchanged over ``GLOBAL`` first (one
        object all-gather), so a bad or uneven placement raises the same
        ``ValueError`` on every rank before any group is created.

        Args:
            node_rank: This node's index; ``None`` reads ``GROUP_RANK`` (torchrun) or ``NODE_RANK``.
            local_rank: This process's index on its node; ``None`` reads ``LOCAL_RANK``.
            local_world_size: Processes per node; ``None`` reads ``LOCAL_WORLD_SIZE``.
            backend, use_cpu, timeout: As for :meth:`init_group`.

        Returns:
            ``{"INTRA_NODE": ..., "INTER_NODE": ...}``: this rank's communicators.

        Raises:
            ValueError: a placement is missing or not an int on some rank, or
                the nodes are uneven (see :func:`rlightning_comm.topology.node_partitions`).
            CommError: not initialised, or a mode is already bound to other ranks.
        """
        return layout.init_node_groups(self, node_rank, local_rank, local_world_size, backend, use_cpu, timeout)

    def init_weight_transfer_group(
        self, src: int, dst_ranks: list[int], backend: str | None = None, use_cpu: bool = False, timeout: float | timedelta | None = None
    ) -> Communicator:
        """Bind ``WEIGHT_TRANSFER``: one group of ``src`` and ``dst_ranks``; other ranks are non-members.

        The group's ranks are numbered in global-rank order, as torch does; the
        source is remembered as :meth:`get_transfer_source` (the default ``src``
        of :func:`broadcast_state_dict`).

        Use it with :func:`rlightning_comm.broadcast_state_dict`.

        Args:
            src: Global rank that sends weights (for example trainer rank 0).
            dst_ranks: Global ranks that receive them (for example the rollout workers).
            backend, use_cpu, timeout: As for :meth:`init_group`.

        Raises:
            TypeError, ValueError: bad ranks (before any group is created).
            CommError: not initialised, or the mode is already bound to other ranks.
        """
        return layout.init_weight_transfer_group(self, src, dst_ranks, backend, use_cpu, timeout)

    def get_transfer_source(self, mode: CommMode | str = CommMode.WEIGHT_TRANSFER) -> int | None:
        """The source global rank declared by :meth:`init_weight_transfer_group` for ``mode``, or ``None``."""
        self.get_communicator(mode)
        return self._transfer_sources.get(mode_name(mode))

