"""Read a context's group layout back as data, and print it.

A facade over :class:`CommContext` (the layouts are declared with :meth:`CommContext.init_parallel_groups`,
:meth:`CommContext.init_node_groups`, :meth:`CommContext.init_weight_transfer_group` and
:meth:`CommContext.init_group`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlightning_comm.context import CommContext


@dataclass(frozen=True)
class ModeLayout:
    """This rank's view of one bound mode."""

    ranks: tuple[int, ...]
    """Global ranks of this rank's group in group-rank order, as declared (empty on a non-member of a mode with several
    groups)."""
    rank: int | None
    """This rank's index within the group; ``None`` on a non-member."""
    world_size: int
    """Number of ranks in the group."""
    backend: str
    """The registered communicator name the group was created with."""


def describe_layout(context: CommContext | None = None) -> dict[str, ModeLayout]:
    """Read a context's layout back as data: every bound mode -> this rank's view of it.

    Args:
        context: The context to read; ``None`` means ``CommContext()``.

    Returns:
        Bound mode name -> :class:`ModeLayout`, sorted by mode name (empty when the context is not initialised).
    """
    if context is None:
        context = CommContext()
    layout = {}
    for mode in context.bound_modes():
        comm = context.get_communicator(mode)
        rank = comm.rank if comm.is_member else None
        layout[mode] = ModeLayout(
            ranks=comm.ranks, rank=rank, world_size=comm.world_size, backend=context.get_group_config(mode).backend
        )
    return layout


def format_layout(layout: dict[str, ModeLayout]) -> str:
    """Render :func:`describe_layout`'s result as a fixed-width table, one line per mode."""
    rows = [("mode", "group ranks", "rank", "size", "backend")]
    for mode, m in layout.items():
        rows.append((mode, str(list(m.ranks)), "-" if m.rank is None else str(m.rank), str(m.world_size), m.backend))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
