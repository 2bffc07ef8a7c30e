"""The geometry of :func:`reshard_state_dict`'s schedule: boxes of global indexes, and which holder covers which cell of
a wanted block (the planner spreads the load over holders of the same elements).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from rlightning_comm.weights.reshard._slices import Box, region


def volume(lo: Sequence[int], hi: Sequence[int]) -> int:
    return math.prod(h - a for a, h in zip(lo, hi))


def _intersect(alo, ahi, blo, bhi) -> Box | None:
    lo = tuple(map(max, alo, blo))
    hi = tuple(map(min, ahi, bhi))
    return (lo, hi) if all(a < h for a, h in zip(lo, hi)) else None


def _disjoint(boxes: list[Box]) -> bool:
    return all(_intersect(*a, *b) is None for a, b in itertools.combinations(boxes, 2))


def _merge(cells: list[tuple[Any, tuple[int, ...], tuple[int, ...]]], ndim: int) -> list[Any]:
    """Adjacent cells of the same owner joined into larger boxes, one dimension after the other."""
    for k in reversed(range(ndim)):
        cells.sort(key=lambda c: (c[0], c[1][:k] + c[1][k + 1 :], c[2][:k] + c[2][k + 1 :], c[1][k]))
        out: list[Any] = []
        for owner, lo, hi in cells:
            if out:
                o, plo, phi = out[-1]
                same = (
                    o == owner
                    and plo[:k] + plo[k + 1 :] == lo[:k] + lo[k + 1 :]
                    and phi[:k] + phi[k + 1 :] == hi[:k] + hi[k + 1 :]
                )
                if same and phi[k] == lo[k]:
                    out[-1] = (o, plo, phi[:k] + (hi[k],) + phi[k + 1 :])
                    continue
            out.append((owner, lo, hi))
        cells = out
    return cells


class Planner:
    def __init__(self, members: int, ranks: Sequence[int]) -> None:
        self.members = members
        self.ranks = ranks
        self.load = [0] * members  # bytes each member sends so far: a replica is chosen by it
        # The geometry of a cover depends only on the holders' blocks and the wanted box, which the tensors of a model
        # share by the hundred: worked out once per distinct (holders, box).
        self._layouts: dict[tuple[Any, ...], int] = {}
        self._geometry: dict[tuple[Any, ...], tuple[bool, list[Any], list[Any]]] = {}

    def _choose(self, owners: list[tuple[int, int]], dst: int) -> tuple[int, int]:
        for m, j in owners:
            if m == dst:
                return m, j
        return min(owners, key=lambda o: (self.load[o[0]], (o[0] - dst) % self.members, o[1]))

    def layout(self, holders: tuple[Any, ...]) -> int:
        """A small id for one name's holders and blocks (equal for names held alike)."""
        return self._layouts.setdefault(holders, len(self._layouts))

    def _cells(self, wlo, whi, holders) -> tuple[bool, list[Any], list[Any]]:
        """Whether the intersections tile the box exactly; the (lo, hi, volume, owners) to choose from; the holes."""
        found: dict[Box, list[tuple[int, int]]] = {}
        for m, j, hlo, hhi in holders:
            box = _intersect(wlo, whi, hlo, hhi)
            if box is not None:
                found.setdefault(box, []).append((m, j))
        boxes = list(found)
        volumes = [volume(*b) for b in boxes]
        if sum(volumes) == volume(wlo, whi) and _disjoint(boxes):
            return True, [(*b, v, found[b]) for b, v in zip(boxes, volumes)], []
        # Held blocks that overlap without lining up: cut the wanted box into cells along every boundary.
        edges = [sorted({wlo[d], whi[d], *(c for b in boxes for c in (b[0][d], b[1][d]))}) for d in range(len(wlo))]
        cells, missing = [], []
        for cell in itertools.product(*(list(zip(e, e[1:])) for e in edges)):
            lo, hi = tuple(c[0] for c in cell), tuple(c[1] for c in cell)
            owners = [
                o for b in boxes if all(bl <= a and h <= bh for a, h, bl, bh in zip(lo, hi, *b)) for o in found[b]
            ]
            if owners:
                cells.append((lo, hi, volume(lo, hi), owners))
            else:
                missing.append((None, lo, hi))
        return False, cells, missing

    def cover(
        self, name: str, wlo, whi, layout: int, holders, dst: int, itemsize: int
    ) -> list[tuple[int, int, tuple, tuple]]:
        """Owners and boxes that cover the wanted box ``[wlo, whi)`` of ``dst`` exactly once."""
        key = (layout, wlo, whi)
        geometry = self._geometry.get(key)
        if geometry is None:
            geometry = self._geometry[key] = self._cells(wlo, whi, holders)
        exact, cells, missing = geometry
        if missing:
            holes = _merge(list(missing), len(wlo))
            shown = ", ".join(region((lo, hi)) for _, lo, hi in holes[:4]) + (" ..." if len(holes) > 4 else "")
            raise ValueError(f"{name!r}: elements {shown} wanted by rank {self.ranks[dst]} are held by no member")
        out = []
        for lo, hi, volume, owners in cells:
            m, j = self._choose(owners, dst) if len(owners) > 1 or owners[0][0] == dst else owners[0]
            self.load[m] += volume * itemsize
            out.append((m, j, lo, hi))
        if exact:
            return out
        return [(m, j, lo, hi) for (m, j), lo, hi in _merge([((m, j), lo, hi) for m, j, lo, hi in out], len(wlo))]


def contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    expected = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1:
            if s != expected:
                return False
            expected *= n
    return True


def split(lo: tuple[int, ...], hi: tuple[int, ...], limit: int):
    """Boxes that cover ``[lo, hi)`` in row-major order, each of at most ``limit`` elements (or one element)."""
    if volume(lo, hi) <= limit or not lo:
        yield lo, hi
        return
    row = volume(lo[1:], hi[1:])
    if row <= limit:
        step = limit // row
        for a in range(lo[0], hi[0], step):
            yield (a, *lo[1:]), (min(a + step, hi[0]), *hi[1:])
    else:
        for a in range(lo[0], hi[0]):
            for sub_lo, sub_hi in split(lo[1:], hi[1:], limit):
                yield (a, *sub_lo), (a + 1, *sub_hi)
