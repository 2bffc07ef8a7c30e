"""Pure rank-layout computations: which global ranks form each group of a declared layout.

Nothing here touches torch.distributed, so every layout can be checked without processes. A *partition* is a tuple of
disjoint groups, each a tuple of global ranks in group-rank order (as declared): the shape
:meth:`CommContext.init_group` takes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from rlightning_comm.config import ParallelConfig

Partition = tuple[tuple[int, ...], ...]

# Mode name -> the axes its groups span (the other axes are fixed within a group).
_PARALLEL_MODE_AXES: dict[str, tuple[str, ...]] = {
    "TENSOR_PARALLEL": ("tp",),
    "SEQUENCE_PARALLEL": ("sp",),
    "DATA_PARALLEL": ("dp",),
    "TRAIN_DATA_PARALLEL": ("sp", "dp"),
}


class NodePlacement(NamedTuple):
    """Where one global rank runs, as a launcher reports it."""

    node_rank: int
    """The node (torchrun's ``GROUP_RANK``)."""
    local_rank: int
    """The process's index on its node (``LOCAL_RANK``)."""
    local_world_size: int
    """Number of processes on its node (``LOCAL_WORLD_SIZE``)."""


def _first_fastest(shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every coordinate of ``shape``, the first axis varying fastest."""
    for coords in itertools.product(*(range(n) for n in reversed(shape))):
        yield coords[::-1]


def _orthogonal_groups(shape: Sequence[int], spanned: Sequence[bool]) -> Partition:
    """Groups of the ranks of a grid numbered first-axis-fastest, each spanning the ``spanned`` axes.

    This is Megatron's ``generate_masked_orthogonal_rank_groups``: a group holds the ranks whose coordinates differ only
    on spanned axes.
    """
    strides = [1]
    for n in shape[:-1]:
        strides.append(strides[-1] * n)
    inner = [i for i, s in enumerate(spanned) if s]
    outer = [i for i, s in enumerate(spanned) if not s]
    offsets = [
        sum(c * strides[i] for c, i in zip(coords, inner)) for coords in _first_fastest([shape[i] for i in inner])
    ]
    groups = []
    for coords in _first_fastest([shape[i] for i in outer]):
        base = sum(c * strides[i] for c, i in zip(coords, outer))
        groups.append(tuple(base + off for off in offsets))
    return tuple(groups)


def parallel_partitions(config: ParallelConfig, world_size: int) -> dict[str, Partition]:
    """The groups of every parallel mode of ``config`` in a world of ``world_size`` ranks.

    Ranks fill the grid of :meth:`ParallelConfig.sizes` with the first axis of ``config.order`` varying fastest: with
    ``order="tp-sp-dp"``, tensor parallel size 2 and sequence parallel size 2, ranks 0 and 1 form a tensor-parallel
    group, 0 and 2 a sequence-parallel one, 0 and 4 a data-parallel one.

    Args:
        config: The declared layout.
        world_size: Number of ranks in the world.

    Returns:
        Mode name -> partition, for ``TENSOR_PARALLEL``, ``SEQUENCE_PARALLEL``, ``DATA_PARALLEL`` and, if
        ``config.bind_train_data_parallel``, ``TRAIN_DATA_PARALLEL``.

    Raises:
        ValueError: the sizes do not tile the world.
    """
    sizes = config.sizes(world_size)
    axes = config.axes
    shape = [sizes[a] for a in axes]
    modes = [m for m in _PARALLEL_MODE_AXES if m != "TRAIN_DATA_PARALLEL" or config.bind_train_data_parallel]
    return {m: _orthogonal_groups(shape, [a in _PARALLEL_MODE_AXES[m] for a in axes]) for m in modes}


def node_partitions(placements: Sequence[NodePlacement | tuple[int, int, int]]) -> dict[str, Partition]:
    """``INTRA_NODE`` and ``INTER_NODE`` groups from every rank's placement.

    ``INTRA_NODE`` groups the ranks of one node, by local rank; ``INTER_NODE`` groups the ranks with the same local
    rank, by node rank.

    Args:
        placements: ``placements[r]`` is global rank ``r``'s ``(node_rank, local_rank, local_world_size)``.

    Returns:
        ``{"INTRA_NODE": ..., "INTER_NODE": ...}``.

    Raises:
        ValueError: uneven nodes (local world sizes differ, or a node holds a different number of ranks), local ranks
            that repeat or fall outside ``[0, local_world_size)``, or node ranks that are not ``0 .. number of nodes -
            1``.
    """
    world = len(placements)
    if not world:
        raise ValueError("placements must hold one (node_rank, local_rank, local_world_size) per rank; got none")
    places = [NodePlacement(*p) for p in placements]
    by_node: dict[int, list[int]] = {}
    for r, p in enumerate(places):
        by_node.setdefault(p.node_rank, []).append(r)
    sizes = {p.local_world_size for p in places}
    if len(sizes) > 1:
        detail = ", ".join(
            f"node {n}: LOCAL_WORLD_SIZE {sorted({places[r].local_world_size for r in rs})} on ranks {rs}"
            for n, rs in sorted(by_node.items())
        )
        raise ValueError(f"uneven nodes: every rank must report the same LOCAL_WORLD_SIZE; got {detail}")
    local_size = sizes.pop()
    counts = {n: len(rs) for n, rs in by_node.items()}
    if local_size < 1 or any(c != local_size for c in counts.values()):
        raise ValueError(
            f"uneven nodes: every node must run LOCAL_WORLD_SIZE={local_size} ranks; got ranks per node "
            f"{dict(sorted(counts.items()))}"
        )
    nodes = world // local_size
    if sorted(by_node) != list(range(nodes)):
        raise ValueError(
            f"node ranks must be 0 .. {nodes - 1} for {world} ranks, {local_size} per node; got {sorted(by_node)}"
        )
    intra = []
    for n in range(nodes):
        ranks = sorted(by_node[n], key=lambda r: places[r].local_rank)
        locals_ = [places[r].local_rank for r in ranks]
        if locals_ != list(range(local_size)):
            raise ValueError(
                f"node {n}: local ranks must be 0 .. {local_size - 1} once each; got {locals_} on ranks {ranks}"
            )
        intra.append(tuple(ranks))
    inter = tuple(tuple(intra[n][local] for n in range(nodes)) for local in range(local_size))
    return {"INTRA_NODE": tuple(intra), "INTER_NODE": inter}


def weight_transfer_ranks(src: int, dst_ranks: Sequence[int], world_size: int) -> tuple[int, ...]:
    """The ``WEIGHT_TRANSFER`` group's global ranks in group-rank order: ``(src, *dst_ranks)``.

    The source is group rank 0 and destination ``i`` is group rank ``i + 1``, whatever their global ranks
    (:meth:`CommContext.init_group` keeps the declared order).

    Raises:
        TypeError: a rank is not an int, or ``dst_ranks`` is not a sequence.
        ValueError: a rank outside the world, no destination, a repeated destination, or the source among the
            destinations.
    """
    if isinstance(dst_ranks, (str, bytes)) or not isinstance(dst_ranks, Sequence):
        raise TypeError(f"dst_ranks must be a list of global ranks; got {type(dst_ranks).__name__}")
    for name, r in [("src", src), *((f"dst_ranks[{i}]", d) for i, d in enumerate(dst_ranks))]:
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"{name} must be an int global rank; got {type(r).__name__} {r!r}")
        if not 0 <= r < world_size:
            raise ValueError(
                f"{name}={r} is out of range for world size {world_size}; expected 0 <= rank < {world_size}"
            )
    if not dst_ranks:
        raise ValueError("dst_ranks must name at least one destination rank; got []")
    if len(set(dst_ranks)) != len(dst_ranks):
        raise ValueError(f"dst_ranks must not repeat a rank; got {list(dst_ranks)}")
    if src in dst_ranks:
        raise ValueError(f"src={src} must not be one of dst_ranks {list(dst_ranks)}")
    return (src, *dst_ranks)
