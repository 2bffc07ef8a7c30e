"""What one weight transfer moves: the plan every member builds from the source's manifest.

A tensor is cut along its leading dimensions into pieces of at most one bucket. A piece of at least ``min(bucket_bytes,
DIRECT_BYTES)`` is a unit of its own, moved straight from and into the tensor where it is contiguous; the smaller pieces
of whole tensors are coalesced into buckets. A tensor cut in several pieces has every piece in a unit of its own, one
after the other, so a destination that receives into buffers (a ``load`` callable) finds it whole in one place. Tensors
the source holds more than once (tied weights) travel once.

When a destination passed a ``load`` callable the plan is *layered*: tensors travel layer by layer (:func:`layer_of`),
each layer's together in the order its first tensor has in the manifest, cut into segments (runs of whole layers of at
most one bucket, a larger layer alone), and a bucket never holds pieces of two segments. For a ``load`` destination the
units are grouped into
deliveries: runs of whole segments that fill one buffer of at most one bucket
(a layer larger than a bucket alone, in a buffer of its own size), each handed to ``load`` whole. An engine that reloads
layer by layer (vLLM keeps the tensors of a layer until all of them have arrived) thus gets every layer in one call.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

from rlightning_comm.weights.core._staging import DIRECT_BYTES, dtype_of

_ALIGN = 16  # every piece starts on a multiple of the largest element size, so a bucket slice views as any dtype

# One manifest entry: name, dtype name, shape, and the index of an earlier entry that is the very same tensor on the
# source (-1: none).
Entry = tuple[str, str, tuple[int, ...], int]


class Piece(NamedTuple):
    """``tensors[index][where]`` (``where == ()``: the whole tensor), at byte ``at`` of its unit."""

    index: int
    where: tuple[Any, ...]
    at: int
    nbytes: int


class Unit(NamedTuple):
    """One transfer (a broadcast, or a send to each destination over gloo): a single piece that may travel in place
    (``direct``), or a bucket of coalesced pieces."""

    pieces: tuple[Piece, ...]
    nbytes: int
    direct: bool


class Plan(NamedTuple):
    """Every unit of one transfer, in order, and what to copy afterwards on a destination."""

    manifest: tuple[Entry, ...]  # the source's, in its order: the plan's tensors are indexed by it
    units: tuple[Unit, ...]
    aliases: tuple[tuple[int, int], ...]  # (index, index of the source tensor it is)
    slot_bytes: int  # the largest bucket: the size of a staging buffer (grown for a staged in-place piece)
    total_bytes: int
    bucket_bytes: int
    layered: bool  # layer by layer (for a load destination), buckets never across two segments of whole layers

    @property
    def names(self) -> tuple[str, ...]:
        """The tensors' names, in the plan's order."""
        return tuple(e[0] for e in self.manifest)


class Delivery(NamedTuple):
    """What one ``load`` call gets: the consecutive units ``units`` received into one buffer, and the tensors they
    hold."""

    units: range
    offsets: tuple[int, ...]  # where each unit's bytes land in the buffer
    tensors: tuple[
        tuple[int, int], ...
    ]  # (manifest index, byte offset) of each whole tensor, aliases and empty ones included
    nbytes: int


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: its name up to its first all-digit component (``model.layers.3`` for
    ``model.layers.3.mlp.up_proj.weight``), else its module (the name without its last component); a name without a
    dot is a layer of its own."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def _layers(manifest: tuple[Entry, ...] | list[Entry]) -> list[int]:
    """Each tensor's layer, numbered in the order of its first tensor in ``manifest``."""
    first: dict[str, int] = {}
    return [first.setdefault(layer_of(entry[0]), len(first)) for entry in manifest]


def _segments(manifest: tuple[Entry, ...] | list[Entry], bucket_bytes: int) -> tuple[list[int], list[int]]:
    """Each tensor's layer and segment: runs of consecutive whole layers (in the order of :func:`_layers`) of at most
    ``bucket_bytes`` together, a larger layer alone. A layered plan's buckets end at segments, not at every layer, so a
    model of many small layers keeps a few buckets of its small tensors (each bucket costs the source a receipt)."""
    layers = _layers(manifest)
    size = [0] * (max(layers) + 1 if layers else 0)
    for (_, dtype, shape, alias), layer in zip(manifest, layers):
        if alias < 0:
            size[layer] += _align(dtype_of(dtype).itemsize * math.prod(shape))
    segment_of, segment, fill = [], -1, 0
    for n in size:
        if segment < 0 or (fill and fill + n > bucket_bytes):
            segment, fill = segment + 1, 0
        segment_of.append(segment)
        fill += n
    return layers, [segment_of[layer] for layer in layers]


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _pieces(shape: tuple[int, ...], limit: int, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], int]]:
    """``(index, numel)`` of views that cover a tensor of ``shape`` in order, each of at most ``limit`` elements (or one
    element)."""
    numel = math.prod(shape)
    if numel <= limit:
        yield prefix, numel
        return
    row = math.prod(shape[1:])
    if row <= limit:
        step = limit // row
        for lo in range(0, shape[0], step):
            hi = min(lo + step, shape[0])
            yield (*prefix, slice(lo, hi)), (hi - lo) * row
    else:
        for i in range(shape[0]):
            yield from _pieces(shape[1:], limit, (*prefix, i))


def build_plan(manifest: list[Entry], bucket_bytes: int, layered: bool = False) -> Plan:
    """The units that move every tensor of ``manifest`` (the source's order), with buckets of at most
    ``bucket_bytes``; ``layered``: layer by layer, no bucket across two segments of whole layers."""
    direct_bytes = min(bucket_bytes, DIRECT_BYTES)
    units: list[Unit] = []
    open_: list[Piece] = []
    fill = 0
    aliases = []
    layers, segments = _segments(manifest, bucket_bytes) if layered else ([0] * len(manifest),) * 2
    open_segment = -1
    for index in sorted(range(len(manifest)), key=layers.__getitem__):  # stable: the manifest's order within a layer
        _, dtype, shape, alias = manifest[index]
        if alias >= 0:
            aliases.append((index, alias))
            continue
        if open_ and segments[index] != open_segment:  # the last segment's bucket goes before this one's units
            units.append(Unit(tuple(open_), fill, False))
            open_, fill = [], 0
        open_segment = segments[index]
        size = dtype_of(dtype).itemsize
        pieces = list(_pieces(shape, max(1, bucket_bytes // size)))
        for where, numel in pieces:
            nbytes = numel * size
            if nbytes == 0:
                continue
            if nbytes >= direct_bytes or len(pieces) > 1:
                units.append(Unit((Piece(index, where, 0, nbytes),), nbytes, nbytes >= direct_bytes))
                continue
            at = _align(fill)
            if at + nbytes > bucket_bytes:
                units.append(Unit(tuple(open_), fill, False))
                open_, at = [], 0
            open_.append(Piece(index, where, at, nbytes))
            fill = at + nbytes
    if open_:
        units.append(Unit(tuple(open_), fill, False))
    slot = max((u.nbytes for u in units if not u.direct), default=0)
    total = sum(p.nbytes for u in units for p in u.pieces)
    return Plan(tuple(manifest), tuple(units), tuple(aliases), slot, total, bucket_bytes, layered)


def deliveries(plan: Plan) -> tuple[Delivery, ...]:
    """The plan's units grouped for a ``load`` destination: buffers of whole layers (whole tensors, if the plan is not
    layered) of at most one bucket, a layer larger than that alone.

    The aliases of tied tensors go with the delivery of their first tensor, tensors of no elements with their layer's
    (or the first one).
    """
    units = plan.units
    layers = _segments(plan.manifest, plan.bucket_bytes)[1] if plan.layered else list(range(len(plan.manifest)))
    # Atoms: a unit of whole tensors, or every unit of one tensor cut in several pieces (back to back).
    atoms: list[tuple[int, int, int, list[tuple[int, int]], list[int]]] = []
    i = 0
    while i < len(units):
        first = units[i].pieces[0]
        if first.where == () or len(units[i].pieces) > 1:
            atoms.append((i, i + 1, units[i].nbytes, [(p.index, p.at) for p in units[i].pieces], [0]))
            i += 1
            continue
        j, at, offsets = i, 0, []
        while j < len(units) and len(units[j].pieces) == 1 and units[j].pieces[0].index == first.index:
            offsets.append(at)
            at += units[j].nbytes
            j += 1
        atoms.append((i, j, at, [(first.index, 0)], offsets))
        i = j
    # A segment's atoms back to back: a layer is never split over two deliveries.
    groups: list[tuple[int, int, int, list[tuple[int, int]], list[int]]] = []
    for atom in atoms:
        if groups and layers[groups[-1][3][0][0]] == layers[atom[3][0][0]]:
            lo, _, size, tensors, offsets = groups[-1]
            base = _align(size)
            tensors += [(index, base + rel) for index, rel in atom[3]]
            offsets += [base + rel for rel in atom[4]]
            groups[-1] = (lo, atom[1], base + atom[2], tensors, offsets)
        else:
            groups.append(atom)
    out: list[Delivery] = []
    where: dict[int, int] = {}  # tensor index -> its delivery
    run: list[Any] = []
    fill = 0

    def close() -> None:
        lo, hi = run[0][0][0], run[-1][0][1]
        offsets = tuple(o for _, base, atom in run for o in (base + rel for rel in atom[4]))
        tensors = tuple((index, base + rel) for _, base, atom in run for index, rel in atom[3])
        where.update((index, len(out)) for index, _ in tensors)
        out.append(Delivery(range(lo, hi), offsets, tensors, fill))

    for atom in groups:
        at = _align(fill)
        if run and at + atom[2] > plan.bucket_bytes:
            close()
            run, at = [], 0
        run.append(((atom[0], atom[1]), at, atom))
        fill = at + atom[2]
    if run:
        close()
    if not out and plan.manifest:
        out.append(Delivery(range(0), (), (), 0))
    extra: dict[int, list[tuple[int, int]]] = {}
    offset_of = {index: off for d in out for index, off in d.tensors}
    layer_at = {layers[index]: k for index, k in where.items()}  # segment -> its delivery
    aliased = dict(plan.aliases)
    for index in range(len(plan.manifest)):
        if index in where:
            continue
        target = aliased.get(index)
        if target is not None and target in where:
            extra.setdefault(where[target], []).append((index, offset_of[target]))
        else:  # no element: a view of nothing, with its layer's delivery
            extra.setdefault(layer_at.get(layers[index], 0), []).append((index, 0))
    return tuple(d._replace(tensors=d.tensors + tuple(extra.get(k, ()))) for k, d in enumerate(out))
