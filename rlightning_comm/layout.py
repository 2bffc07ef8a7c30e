"""Declared layouts on a :class:`CommContext`: create their groups, and read a context's layout back as data.

The rank arithmetic lives in :mod:`rlightning_comm.topology`; this module
only validates, exchanges what every rank must agree on, and binds the
groups through :meth:`CommContext.init_group`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from rlightning_comm.communicators._objects import all_gather_objects
from rlightning_comm.config import ParallelConfig
from rlightning_comm.errors import CommError
from rlightning_comm.modes import CommMode
from rlightning_comm.topology import NodePlacement, Partition, node_partitions, parallel_partitions, weight_transfer_ranks

if TYPE_CHECKING:
    from rlightning_comm.communicators.base import Communicator
    from rlightning_comm.context import CommContext

_NODE_ENV = {"node_rank": ("GROUP_RANK", "NODE_RANK"), "local_rank": ("LOCAL_RANK",), "local_world_size": ("LOCAL_WORLD_SIZE",)}


@dataclass(frozen=True)
class ModeLayout:
    """This rank's view of one bound mode."""

    ranks: tuple[int, ...]
    """Global ranks of this rank's group, in group-rank order (empty on a non-member of a partition)."""
    rank: int | None
    """This rank's index within the group; ``None`` on a non-member."""
    world_size: int
    """Number of ranks in the group."""
    backend: str
    """The registered communicator name the group was created with."""


def _world_size(context: CommContext) -> int:
    if not context.is_initialized():
        raise CommError("CommContext is not initialised; call CommContext().init_distributed_env(...) first")
    return context.get_world_size(CommMode.GLOBAL)


def _bind(
    context: CommContext, partitions: dict[str, Partition], backend: str | None, use_cpu: bool, timeout: float | timedelta | None
) -> dict[str, Communicator]:
    # Check every mode before creating any group, so a conflict leaves nothing half-bound.
    bound = set(context.bound_modes())
    for mode, partition in partitions.items():
        if mode in bound and context.get_group_config(mode).partition != partition:
            raise CommError(
                f"mode {mode!r} is already bound to ranks {context.get_group_config(mode).as_ranks()}; "
                f"the declared layout needs {[list(p) for p in partition]}. Call destroy() first"
            )
    return {mode: context.init_group([list(p) for p in partition], mode, backend, use_cpu, timeout) for mode, partition in partitions.items()}


def init_parallel_groups(
    context: CommContext, config: ParallelConfig, backend: str | None, use_cpu: bool, timeout: float | timedelta | None
) -> dict[str, Communicator]:
    """Implementation of :meth:`CommContext.init_parallel_groups`."""
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"config must be a ParallelConfig; got {type(config).__name__}")
    return _bind(context, parallel_partitions(config, _world_size(context)), backend, use_cpu, timeout)


def _local_placement(node_rank: int | None, local_rank: int | None, local_world_size: int | None) -> NodePlacement | str:
    """This rank's placement from the arguments or the launcher's environment, or what is wrong with it."""
    values = {"node_rank": node_rank, "local_rank": local_rank, "local_world_size": local_world_size}
    for name, value in values.items():
        if value is None:
            names = _NODE_ENV[name]
            raw = next((os.environ[n] for n in names if n in os.environ), None)
            if raw is None:
                return f"{name} was not given and {' / '.join(names)} is not set in the environment (launch with torchrun or pass {name}=)"
            try:
                value = int(raw)
            except ValueError:
                return f"environment variable {' / '.join(names)} must be an integer; got {raw!r}"
        elif isinstance(value, bool) or not isinstance(value, int):
            return f"{name} must be an int; got {type(value).__name__} {value!r}"
        values[name] = value
    return NodePlacement(**values)


def init_node_groups(
    context: CommContext,
    node_rank: int | None,
    local_rank: int | None,
    local_world_size: int | None,
    backend: str | None,
    use_cpu: bool,
    timeout: float | timedelta | None,
) -> dict[str, Communicator]:
    """Implementation of :meth:`CommContext.init_node_groups`."""
    _world_size(context)
    global_comm = context.get_communicator(CommMode.GLOBAL)
    mine = _local_placement(node_rank, local_rank, local_world_size)
    # Every rank's placement (or its local problem) reaches every rank, so all raise alike instead of some hanging.
    placements: list[NodePlacement | str] = all_gather_objects(mine, global_comm.group, global_comm.device)
    problems = [f"rank {r}: {p}" for r, p in enumerate(placements) if isinstance(p, str)]
    if problems:
        raise ValueError("cannot build the node groups; " + "; ".join(problems))
    return _bind(context, node_partitions(placements), backend, use_cpu, timeout)


def init_weight_transfer_group(
    context: CommContext, src: int, dst_ranks: list[int], backend: str | None, use_cpu: bool, timeout: float | timedelta | None
) -> Communicator:
    """Implementation of :meth:`CommContext.init_weight_transfer_group`."""
    ranks = weight_transfer_ranks(src, dst_ranks, _world_size(context))
    mode = CommMode.WEIGHT_TRANSFER.value
    declared = context._transfer_sources.get(mode)
    if declared is not None and declared != src:
        raise CommError(f"mode {mode!r} is already bound with source rank {declared}; call destroy() before declaring source {src}")
    comm = _bind(context, {mode: (ranks,)}, backend, use_cpu, timeout)[mode]
    context._transfer_sources[mode] = src
    return comm


def describe_layout(context: CommContext | None = None) -> dict[str, ModeLayout]:
    """Read a context's layout back as data: every bound mode -> this rank's view of it.

    Args:
        context: The context to read; ``None`` means ``CommContext()``.

    Returns:
        Bound mode name -> :class:`ModeLayout`, sorted by mode name (empty
        when the context is not initialised).
    """
    if context is None:
        from rlightning_comm.context import CommContext

        context = CommContext()
    layout = {}
    for mode in context.bound_modes():
        comm = context.get_communicator(mode)
        rank = comm.rank if comm.is_member else None
        layout[mode] = ModeLayout(ranks=comm.ranks, rank=rank, world_size=comm.world_size, backend=context.get_group_config(mode).backend)
    return layout


def format_layout(layout: dict[str, ModeLayout]) -> str:
    """Render :func:`describe_layout`'s result as a fixed-width table, one line per mode."""
    rows = [("mode", "group ranks", "rank", "size", "backend")]
    for mode, m in layout.items():
        rows.append((mode, str(list(m.ranks)), "-" if m.rank is None else str(m.rank), str(m.world_size), m.backend))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
