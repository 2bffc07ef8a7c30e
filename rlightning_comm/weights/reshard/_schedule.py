"""The static schedule of :func:`reshard_state_dict`: who sends which block of which tensor to whom, in what order.

Every member computes it from every member's metadata (names, dtypes, global shapes, blocks held and wanted, their
strides), so every member holds the same schedule without a further word. Each wanted block is covered by the
intersections of the blocks held: where several members hold an element (data-parallel replicas) exactly one of them
sends it, the one that has sent the least so far (a member that wants what it holds copies it itself). A piece
contiguous on both sides of at least ``min(bucket_bytes, 256 KiB)`` is a unit of its own, moved without staging; the
rest is packed per pair of members into buckets of at most ``bucket_bytes``; a piece contiguous on one side only travels
alone, in place on that side. The buckets of all pairs are cut, in one global order, into chunks in which what each
member stages fits one buffer of ``bucket_bytes``: a member runs its chunks in that order, filling one staging buffer
while the other's chunk moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from rlightning_comm.weights.core._staging import DIRECT_BYTES, dtype_of
from rlightning_comm.weights.reshard._cover import Planner, contiguous, split, volume

_ALIGN = 16  # every piece of a bucket starts on a multiple of the largest element size


class Piece(NamedTuple):
    """The elements ``[lo, hi)`` of tensor ``name``, from block ``src_block`` of member ``src`` into block
    ``dst_block`` of member ``dst``; at byte ``at`` of its bucket."""

    name: str
    src: int
    src_block: int
    dst: int
    dst_block: int
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    nbytes: int
    at: int = 0


class Bucket(NamedTuple):
    """Pieces from ``src`` to ``dst`` that travel packed, in one message; or one piece contiguous on one side only,
    moved in place on that side (``inplace``: ``"src"`` or ``"dst"``) and staged on the other."""

    src: int
    dst: int
    pieces: tuple[Piece, ...]
    nbytes: int
    inplace: str = ""
    src_at: int = 0  # where it lies in the source's staging buffer for its chunk
    dst_at: int = 0  # and in the destination's
    receipt: bool = True  # whether the destination acknowledges it: the pair's last bucket of a chunk whose buffer
    # the source reuses later (its receipt covers every bucket of the pair in the chunk)

    def at(self, member: int) -> int:
        """Where this bucket lies in ``member``'s staging buffer for its chunk."""
        return self.src_at if member == self.src else self.dst_at

    def staged(self, member: int) -> bool:
        """Whether ``member`` moves this bucket through a staging buffer."""
        return self.inplace != ("src" if member == self.src else "dst")


class Schedule(NamedTuple):
    """One member's part of the plan (every member's is cut from the same global plan)."""

    copies: tuple[Piece, ...]  # within this member
    direct: tuple[Piece, ...]  # sent or received in place, in the global order
    chunks: tuple[tuple[Bucket, ...], ...]  # this member's buckets, per chunk, in the global order
    slot_bytes: int  # the largest of this member's buckets
    sent: dict[int, int]  # group rank -> bytes
    received: dict[int, int]
    wanted_names: tuple[str, ...]  # the names this member writes


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def check_and_plan(metas: Sequence[Sequence[Any]], bucket_bytes: int, ranks: Sequence[int]) -> list[Any]:
    """The global plan: every piece, the direct ones in order, and the chunks of buckets.

    Raises:
        ValueError: members disagree on a name's dtype or global shape, or a wanted element is held by no member (the
            same message on every member: the metadata is the same).
    """
    members = len(metas)
    by_name: dict[str, list[tuple[int, Any]]] = {}
    for m, meta in enumerate(metas):
        for entry in meta:
            by_name.setdefault(entry[0], []).append((m, entry))
    planner = Planner(members, ranks)
    pieces: list[Piece] = []
    strides: dict[tuple[str, int, int, str], tuple[tuple[int, ...], tuple[int, ...], bool]] = {}
    problems = []
    for name in sorted(by_name):
        entries = by_name[name]
        kinds = {(e[1], tuple(e[2])) for _, e in entries}
        if len(kinds) > 1:
            told = "; ".join(f"rank {ranks[m]}: {e[1]} {tuple(e[2])}" for m, e in entries)
            problems.append(f"{name!r}: the members disagree on its dtype or global shape ({told})")
            continue
        itemsize = dtype_of(entries[0][1][1]).itemsize
        holders: list[Any] = []
        for m, e in entries:
            for j, (off, shape, st, plain) in enumerate(e[3]):
                strides[(name, m, j, "held")] = (tuple(off), tuple(st), plain)
                if volume((0,) * len(shape), shape):
                    holders.append((m, j, tuple(off), tuple(o + n for o, n in zip(off, shape))))
        holders = tuple(holders)
        layout = planner.layout(holders)
        for d, e in entries:
            for jj, (off, shape, st, plain) in enumerate(e[4]):
                strides[(name, d, jj, "wanted")] = (tuple(off), tuple(st), plain)
                if not volume((0,) * len(shape), shape):
                    continue
                wlo, whi = tuple(off), tuple(o + n for o, n in zip(off, shape))
                try:
                    cover = planner.cover(name, wlo, whi, layout, holders, d, itemsize)
                except ValueError as err:
                    problems.append(str(err))
                    continue
                for m, j, lo, hi in cover:
                    pieces.append(Piece(name, m, j, d, jj, lo, hi, volume(lo, hi) * itemsize))
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ValueError(shown)
    return [pieces, strides]


def _plain_view(strides, piece: Piece, side: str) -> bool:
    off, st, plain = strides[
        (
            piece.name,
            piece.src if side == "held" else piece.dst,
            piece.src_block if side == "held" else piece.dst_block,
            side,
        )
    ]
    return plain and contiguous([h - a for a, h in zip(piece.lo, piece.hi)], st)


def build_schedule(metas: Sequence[Sequence[Any]], bucket_bytes: int, ranks: Sequence[int], me: int) -> Schedule:
    """Member ``me``'s part of the global plan of ``metas`` (every member's metadata, in group-rank order).

    Raises:
        ValueError: as :func:`check_and_plan`.
    """
    pieces, strides = check_and_plan(metas, bucket_bytes, ranks)
    threshold = min(bucket_bytes, DIRECT_BYTES)
    pairs: dict[tuple[int, int], list[Piece]] = {}
    for p in pieces:
        pairs.setdefault((p.src, p.dst), []).append(p)
    direct: list[Piece] = []
    buckets: dict[tuple[int, int], list[Bucket]] = {}
    copies: list[Piece] = []
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    for (src, dst), mine in sorted(pairs.items()):
        if src == dst:
            if src == me:
                copies.extend(mine)
            continue
        if me == src:
            sent[dst] = sum(p.nbytes for p in mine)
        if me == dst:
            received[src] = sum(p.nbytes for p in mine)
        open_: list[Piece] = []
        fill = 0
        out = buckets.setdefault((src, dst), [])
        for piece in mine:
            if piece.nbytes <= bucket_bytes or (
                _plain_view(strides, piece, "held") and _plain_view(strides, piece, "wanted")
            ):
                parts = [piece]  # one bucket holds it, or it moves in place whole
            else:
                itemsize = piece.nbytes // volume(piece.lo, piece.hi)
                parts = [
                    piece._replace(lo=lo, hi=hi, nbytes=volume(lo, hi) * itemsize)
                    for lo, hi in split(piece.lo, piece.hi, max(1, bucket_bytes // itemsize))
                ]
            for part in parts:
                if part.nbytes >= threshold:
                    src_plain, dst_plain = _plain_view(strides, part, "held"), _plain_view(strides, part, "wanted")
                    if src_plain and dst_plain:
                        direct.append(part)
                        continue
                    if src_plain or dst_plain:  # one side moves it in place: one copy, not two
                        out.append(Bucket(src, dst, (part,), part.nbytes, "src" if src_plain else "dst"))
                        continue
                at = _align(fill)
                if open_ and at + part.nbytes > bucket_bytes:
                    out.append(Bucket(src, dst, tuple(open_), fill))
                    open_, at = [], 0
                open_.append(part._replace(at=at))
                fill = at + part.nbytes
        if open_:
            out.append(Bucket(src, dst, tuple(open_), fill))
    # One global order of buckets (round-robin over the pairs), cut into chunks where what each member stages fits one
    # buffer of bucket_bytes: a member fills its next chunk's buffer while its current chunk moves, two buffers in all.
    order = sorted(((k, pair), b) for pair, bs in buckets.items() for k, b in enumerate(bs))
    every: list[list[Bucket]] = []  # every member's chunks, in the global order
    current: list[Bucket] = []
    fill: dict[int, int] = {}
    for _, bucket in order:
        staging = [m for m in (bucket.src, bucket.dst) if bucket.staged(m)]
        if current and any(_align(fill.get(m, 0)) + bucket.nbytes > bucket_bytes for m in staging):
            every.append(current)
            current, fill = [], {}
        at = {m: _align(fill.get(m, 0)) for m in staging}
        current.append(bucket._replace(src_at=at.get(bucket.src, 0), dst_at=at.get(bucket.dst, 0)))
        for m in staging:
            fill[m] = at[m] + bucket.nbytes
    if current:
        every.append(current)
    # A source needs a receipt only to reuse its buffer, and one per pair and chunk covers every bucket the pair moves
    # in it (a pair's buckets arrive in order): the pair's last staged bucket of the chunk is acknowledged alone. In the
    # source's last two chunks the receipt of the whole transfer (one per pair, at the end) covers them.
    count: dict[int, int] = {}
    index: list[dict[int, int]] = []
    for chunk in every:
        mine_here = {m for b in chunk for m in (b.src, b.dst)}
        index.append({m: count.get(m, 0) for m in mine_here})
        for m in mine_here:
            count[m] = count.get(m, 0) + 1
    acknowledged = []
    for chunk, where in zip(every, index):
        last = {(b.src, b.dst): k for k, b in enumerate(chunk) if b.staged(b.src) and where[b.src] + 2 < count[b.src]}
        acknowledged.append(set(last.values()))
    chunks = tuple(
        tuple(b._replace(receipt=k in owed) for k, b in enumerate(chunk) if me in (b.src, b.dst))
        for chunk, where, owed in zip(every, index, acknowledged)
        if me in where
    )
    mine = [p for p in direct if me in (p.src, p.dst)]
    slot = max((b.at(me) + b.nbytes for c in chunks for b in c if b.staged(me)), default=0)
    wanted = sorted({e[0] for e in metas[me] if e[4]})
    return Schedule(tuple(copies), tuple(mine), tuple(chunks), slot, sent, received, tuple(wanted))
