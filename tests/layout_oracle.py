"""An independent computation of the groups a declared layout must produce, for the tests.

It decodes each rank into grid coordinates and groups ranks by the coordinates off a mode's axes; the library instead
builds groups from strides (Megatron's construction). Only the convention is shared: the first axis of the order string
varies fastest.
"""

from __future__ import annotations

import itertools

ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "sp", "dp"))]
MODE_AXES = {
    "TENSOR_PARALLEL": {"tp"},
    "SEQUENCE_PARALLEL": {"sp"},
    "DATA_PARALLEL": {"dp"},
    "TRAIN_DATA_PARALLEL": {"sp", "dp"},
}


def factorizations(world_size: int) -> list[tuple[int, int, int]]:
    """Every (tp, sp, dp) whose product is ``world_size``."""
    return [
        (tp, sp, world_size // (tp * sp))
        for tp in range(1, world_size + 1)
        for sp in range(1, world_size + 1)
        if world_size % (tp * sp) == 0
    ]


def all_layouts(world_size: int) -> list[tuple[int, int, int, str]]:
    """Every (tp, sp, dp, order) of a world."""
    return [(tp, sp, dp, order) for tp, sp, dp in factorizations(world_size) for order in ORDERS]


def expected_groups(world_size: int, tp: int, sp: int, dp: int, order: str) -> dict[str, list[list[int]]]:
    """Mode -> its groups (each ascending, sorted by first rank)."""
    sizes = {"tp": tp, "sp": sp, "dp": dp}
    axes = order.split("-")
    coords = {}
    for rank in range(world_size):
        rest, c = rank, {}
        for axis in axes:
            rest, c[axis] = divmod(rest, sizes[axis])
        coords[rank] = c
    out = {}
    for mode, spanned in MODE_AXES.items():
        buckets: dict[tuple[int, ...], list[int]] = {}
        for rank in range(world_size):
            key = tuple(coords[rank][a] for a in ("tp", "sp", "dp") if a not in spanned)
            buckets.setdefault(key, []).append(rank)
        out[mode] = sorted(buckets.values())
    return out


def group_of(groups: list[list[int]], rank: int) -> list[int]:
    """The group of ``groups`` that holds ``rank``."""
    return next(g for g in groups if rank in g)
