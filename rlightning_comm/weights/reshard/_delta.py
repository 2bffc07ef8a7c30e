""":func:`reshard_state_dict` with ``delta=True``: each holder's offers, and the decision per destination.

Before the agreement's one exchange each holder compares every distinct block it sends (a *box*: a block of one of its
held tensors, sent to one or more members) with its snapshot (:mod:`._snapshots`) and encodes each box's changes once.
Its pair words say, per member, the bytes the kept plan sends it (plain, and in a delta's format) and the bytes of its
delta for it (the boxes of that pair, in the plan's order); each wanter states the version its tensors hold (proven by
content, as for :func:`broadcast_state_dict`). Every member decides the same from every member's words, per destination:
a delta when every member that sends it something holds a snapshot of the version it holds and offered a smaller delta;
else full. When no destination takes a delta the plan's own data phase runs (:class:`~._mover.Mover`); otherwise
:class:`~._delta_mover.DeltaMover`. Once the sync succeeded a holder's snapshot takes on its changes and a wanter notes
the version its tensors hold.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from rlightning_comm.context import CommContext
from rlightning_comm.weights.commit._digest import content_key
from rlightning_comm.weights.commit._versions import SyncOptions
from rlightning_comm.weights.delta import _changes, _encoding
from rlightning_comm.weights.delta._snapshots import snapshot_for
from rlightning_comm.weights.reshard._slices import Named

OP = "reshard_state_dict"

Box = tuple[str, int, tuple[int, ...], tuple[int, ...]]  # name, held block, lo, hi


def view(names: dict[str, Named], name: str, block: int, lo: tuple[int, ...], hi: tuple[int, ...], role: str) -> Any:
    """The elements ``[lo, hi)`` of this member's ``role`` (``"held"`` or ``"wanted"``) block ``block`` of ``name``."""
    b = getattr(names[name], role)[block]
    return b.tensor[tuple(slice(a - o, c - o) for a, c, o in zip(lo, hi, b.offsets))]


def by_pair(schedule: Any) -> dict[tuple[int, int], list[Any]]:
    """The pieces of this member's schedule per (source, destination) group ranks, in the plan's order: the same list
    for a pair on both of its members."""
    out: dict[tuple[int, int], list[Any]] = {}
    for p in schedule.direct:
        out.setdefault((p.src, p.dst), []).append(p)
    for chunk in schedule.chunks:
        for b in chunk:
            out.setdefault((b.src, b.dst), []).extend(b.pieces)
    return out


def _boxes(pairs: dict[tuple[int, int], list[Any]], me: int) -> list[Box]:
    """The distinct boxes this member sends to others, in the plan's order."""
    seen: dict[Box, None] = {}
    for (src, dst), pieces in pairs.items():
        if src == me and dst != me:
            for p in pieces:
                seen.setdefault((p.name, p.src_block, p.lo, p.hi), None)
    return list(seen)


def _records(boxes: list[Box], names: dict[str, Named]) -> list[_encoding.Record]:
    out = []
    for i, (name, _, lo, hi) in enumerate(boxes):
        dtype = _changes.word_dtype(names[name].held[0].tensor.dtype)
        numel = 1
        for a, b in zip(lo, hi):
            numel *= b - a
        out.append(_encoding.Record((i,), (_changes.word_count(names[name].held[0].tensor.dtype, numel),), dtype))
    return out


def _views(boxes: list[Box], names: dict[str, Named]) -> Any:
    def views(record: _encoding.Record) -> list[torch.Tensor]:
        name, block, lo, hi = boxes[record.pieces[0]]
        return [_changes.words(view(names, name, block, lo, hi, "held"))]

    return views


class Offer(NamedTuple):
    """A holder's deltas, encoded before the members agree on them."""

    boxes: list[Box]
    changes: list[_changes.Change]
    payloads: dict[int, torch.Tensor]  # group rank -> its delta
    base: int


PAIR_WORDS = 3  # per group rank: the bytes the kept plan sends it, the same in a delta's format, the bytes of a delta


def prepare(
    comm: Any,
    memory: Any,
    options: SyncOptions,
    names: dict[str, Named],
    kept: Any,
    mine: Any,
    wanted: list[torch.Tensor],
) -> tuple[Offer | None, list[int]]:
    """Before the exchange: this member's offer and its pair words (:data:`PAIR_WORDS` per group rank, -1 for no
    delta); ``options.held`` set on a wanter whose tensors (``wanted``, the live ones) hold the version it committed."""
    held = memory.held
    if wanted and held is not None and held[0] == CommContext().get_weight_version(options.record_as):
        if held[1] == content_key(wanted):
            options.held = held[0]
    me = comm.rank
    if kept is None:
        return None, [0, 0, -1] * comm.world_size
    schedule = kept[1]
    pairs = by_pair(schedule)
    snap = memory.snapshot
    ready = snap is not None and snap.key == (kept[0], mine) and snap.version is not None
    boxes = _boxes(pairs, me) if ready else []
    curs, changes = snap.changes(_views(boxes, names)) if boxes else ([], [])
    at = {box: i for i, box in enumerate(boxes)}
    size = [_encoding.nbytes(c, cur.numel(), cur.element_size()) for cur, c in zip(curs, changes)]
    built: dict[int, list[torch.Tensor]] = {}  # a box's sections, built once for every pair that takes them
    payloads, words = {}, []
    for r in range(comm.world_size):
        pieces = pairs.get((me, r), []) if r != me else []
        full = schedule.sent.get(r, 0) if r != me else 0
        if boxes and full:
            order = [at[(p.name, p.src_block, p.lo, p.hi)] for p in pieces]
            if sum(size[i] for i in order) < full:
                for i in order:
                    if i not in built:
                        built[i] = [p.to(comm.device) for p in _encoding.sections(curs[i], changes[i])]
                payloads[r] = torch.cat([p for i in order for p in built[i]])
        words += [full, dense_bytes(pieces, names), payloads[r].numel() if r in payloads else -1]
    if not boxes:
        return None, words
    options.base = snap.version
    return Offer(boxes, changes, payloads, snap.version), words


def possible(options: SyncOptions, wanters: list[int]) -> bool:
    """Whether a destination may take a delta (some wanter holds a version some holder's snapshot holds): then the
    members exchange their pair words, in a round of their own. The same on every member."""
    bases = {b for b in options.bases.values() if b >= 0}
    return options.delta and any(options.helds[w] in bases for w in wanters)


def decide(
    options: SyncOptions, rows: list[list[int]], ranks: tuple[int, ...], wanters: list[int]
) -> tuple[dict[int, str], dict[int, int]]:
    """Per destination (a rank that wants something): ``"delta"`` or ``"full"``, and the bytes it receives (known when
    the members exchanged their pair words, ``rows``: the plan was kept); the same on every member."""
    kinds: dict[int, str] = {}
    delivered: dict[int, int] = {}
    cached = bool(rows)
    for d, rank in enumerate(ranks):
        if rank not in wanters:
            continue
        if not cached:
            kinds[rank] = "full"
            continue
        at = PAIR_WORDS * d
        sources = [s for s in range(len(ranks)) if s != d and rows[s][at] > 0]
        held = options.helds[rank]
        delta = (
            held >= 0
            and bool(sources)
            and all(options.bases[ranks[s]] == held and rows[s][at + 2] >= 0 for s in sources)
        )
        kinds[rank] = "delta" if delta else "full"
        if cached:
            delivered[rank] = sum(rows[s][at + 2] if delta else rows[s][at] for s in sources)
    if cached and "delta" in kinds.values():  # the destinations of a full sync get their pieces in a delta's format
        for d, rank in enumerate(ranks):
            if kinds.get(rank) == "full":
                delivered[rank] = sum(rows[s][PAIR_WORDS * d + 1] for s in range(len(ranks)) if s != d)
    return kinds, delivered


def words_of(names: dict[str, Named], p: Any) -> tuple[int, torch.dtype]:
    """A piece's words: how many, of which dtype."""
    e = names[p.name]
    dtype = (e.held or e.wanted)[0].tensor.dtype
    return _changes.word_count(dtype, p.nbytes // dtype.itemsize), _changes.word_dtype(dtype)


def dense_bytes(pieces: list[Any], names: dict[str, Named]) -> int:
    """The bytes of ``pieces`` sent whole in a delta's format (a header and the words padded, per piece)."""
    total = 0
    for p in pieces:
        n, word = words_of(names, p)
        total += _changes.sizes(n, n, word.itemsize)[2]
    return total


def refresh(
    sync: Any,
    comm: Any,
    memory: Any,
    options: SyncOptions,
    names: dict[str, Named],
    schedule: Any,
    key: Any,
    offer: Offer | None,
    wanted: list[torch.Tensor],
) -> None:
    """Once the sync succeeded: a holder's snapshot takes on its changes (or, without an offer of this plan, a copy of
    every box it sends), and a wanter notes the version its tensors hold."""
    version = options.version
    held_names = names

    def succeeded() -> None:
        try:
            boxes = _boxes(by_pair(schedule), comm.rank)
            snap = memory.snapshot
            if offer is not None and snap is not None and snap.key == key:
                snap.advance(offer.changes, version)
            elif boxes:
                snapshot_for(memory, key, lambda: _records(boxes, held_names)).take(_views(boxes, held_names), version)
            else:
                memory.snapshot = None
            if wanted:
                memory.held = (version, content_key(wanted))
        except BaseException:
            memory.drop_delta()
            raise

    sync.succeeded = succeeded
