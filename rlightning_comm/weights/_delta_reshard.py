""":func:`reshard_state_dict` with ``delta=True``: each holder's offers, the decision per destination, the delta's data
phase.

Before the agreement's one exchange each holder compares every distinct block it sends (a *box*: a block of one of its
held tensors, sent to one or more members) with its snapshot (:mod:`._snapshots`) and encodes each box's changes once.
Its words say, per member, the bytes the kept plan sends it and the bytes of its delta for it (the boxes of that pair,
in the plan's order), and each wanter states the version its tensors hold. From every member's words every member
decides the same, per destination: a delta when every member that sends it something holds a snapshot of the version it
holds and offered a smaller delta; else full. When no destination takes a delta the plan's own data phase runs
(:class:`~._mover.Mover`). Otherwise :class:`DeltaMover` moves one message per pair of members: a delta, or (to a
destination that takes a full sync) every piece whole in the delta's format; each destination writes what arrives
into its slices. Over gloo point to point with a receipt per pair (a lost member fails its peers at once); on other
backends in one grouped ``batch_isend_irecv``.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from rlightning_comm.context import CommContext
from rlightning_comm.errors import CommError
from rlightning_comm.failures import LAUNCH_ERRORS, close_gloo_group
from rlightning_comm.weights import _changes, _delta
from rlightning_comm.weights._slices import Named
from rlightning_comm.weights._snapshots import identity, snapshot_for
from rlightning_comm.weights._transport import point_to_point
from rlightning_comm.weights._versions import SyncOptions

OP = "reshard_state_dict"
_TAG, _RECEIPT_TAG = 0x5244, 0x5245  # "RD": a delta's messages, and its receipts
_SETTLE_S = 1.0

Box = tuple[str, int, tuple[int, ...], tuple[int, ...]]  # name, held block, lo, hi


def _view(names: dict[str, Named], name: str, block: int, lo: tuple[int, ...], hi: tuple[int, ...], role: str) -> Any:
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


def _records(boxes: list[Box], names: dict[str, Named]) -> list[_delta.Record]:
    out = []
    for i, (name, _, lo, hi) in enumerate(boxes):
        dtype = _changes.word_dtype(names[name].held[0].tensor.dtype)
        numel = 1
        for a, b in zip(lo, hi):
            numel *= b - a
        out.append(_delta.Record((i,), (_changes.word_count(names[name].held[0].tensor.dtype, numel),), dtype))
    return out


def _views(boxes: list[Box], names: dict[str, Named]) -> Any:
    def views(record: _delta.Record) -> list[torch.Tensor]:
        name, block, lo, hi = boxes[record.pieces[0]]
        return [_changes.words(_view(names, name, block, lo, hi, "held"))]

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
        if held[1] == identity(wanted):
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
    size = [_delta.nbytes(c, cur.numel(), cur.element_size()) for cur, c in zip(curs, changes)]
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
                        built[i] = [p.to(comm.device) for p in _delta.sections(curs[i], changes[i])]
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


def _words_of(names: dict[str, Named], p: Any) -> tuple[int, torch.dtype]:
    """A piece's words: how many, of which dtype."""
    e = names[p.name]
    dtype = (e.held or e.wanted)[0].tensor.dtype
    return _changes.word_count(dtype, p.nbytes // dtype.itemsize), _changes.word_dtype(dtype)


def dense_bytes(pieces: list[Any], names: dict[str, Named]) -> int:
    """The bytes of ``pieces`` sent whole in a delta's format (a header and the words padded, per piece)."""
    total = 0
    for p in pieces:
        n, word = _words_of(names, p)
        total += _changes.sizes(n, n, word.itemsize)[2]
    return total


class DeltaMover:
    """A delta reshard's data phase on one member: one message per pair, each destination writing what arrives.

    Args:
        comm: The communicator.
        schedule: This member's part of the kept plan.
        names: This member's blocks (an atomic destination's wanted ones are its staging).
        offer: This member's offer (``None`` when it sends nothing or offered nothing).
        kinds: Per destination rank: ``"delta"`` or ``"full"``.
        rows: Every member's pair words (from the agreement).
        live: An atomic destination's ``(live, staged)`` tensors: the staging is filled from the live ones first.
    """

    def __init__(
        self,
        comm: Any,
        schedule: Any,
        names: dict[str, Named],
        offer: Offer | None,
        kinds: dict[int, str],
        rows: list[list[int]],
        live: tuple[list, list] | None,
    ) -> None:
        self._comm, self._s, self._names, self._offer = comm, schedule, names, offer
        self._kinds, self._rows, self._live = kinds, rows, live
        self._me = comm.rank
        self._pairs = by_pair(schedule)
        self._p2p = point_to_point(comm)
        self._sends: list[tuple[int, Any]] = []
        self._touched: set[str] = set()
        self._failed_peer: int | None = None
        self.tally: Any = None
        self.staging = live is not None
        wanted = [b.tensor for n in names.values() for b in n.wanted]
        self._writes = torch.inference_mode if any(t.is_inference() for t in wanted) else torch.no_grad

    # ------------------------------------------------------------------ what Sync calls
    def start(self) -> None:
        """Nothing is launched before :meth:`finish`."""

    def finish(self) -> None:
        """Move every pair's message and write what arrives."""
        try:
            with self._writes():
                self._run()
        except CommError as err:
            if self._p2p:
                self._settle()
                close_gloo_group(self._comm.group)
            raise type(err)(f"{err}\n{OP} failed midway: {self._account()}", *err.args[1:]) from err
        finally:
            self._names = {}
            self._offer = None

    # ------------------------------------------------------------------ the messages
    def _kind(self, dst: int) -> str:
        return self._kinds.get(self._comm.ranks[dst], "full")

    def _outgoing(self, dst: int) -> torch.Tensor:
        if self._kind(dst) == "delta":
            return self._offer.payloads[dst]
        parts = []
        for p in self._pairs.get((self._me, dst), []):
            parts += _delta.dense(_changes.flat([_changes.words(self._src_view(p))]))
        return torch.cat(parts)

    def _incoming_bytes(self, src: int) -> int:
        return self._rows[src][PAIR_WORDS * self._me + (2 if self._kind(self._me) == "delta" else 1)]

    def traffic(self) -> tuple[dict[int, int], dict[int, int]]:
        """The bytes this member sends and receives, per group rank."""
        me, s = self._me, self._s
        sent = {r: self._rows[me][PAIR_WORDS * r + (2 if self._kind(r) == "delta" else 1)] for r in sorted(s.sent)}
        return sent, {r: self._incoming_bytes(r) for r in sorted(s.received)}

    def _src_view(self, p: Any) -> torch.Tensor:
        return _view(self._names, p.name, p.src_block, p.lo, p.hi, "held")

    def _dst_view(self, p: Any) -> torch.Tensor:
        return _view(self._names, p.name, p.dst_block, p.lo, p.hi, "wanted")

    def _launch(self, post: Any) -> list[Any]:
        comm = self._comm
        try:
            works = post()
        except LAUNCH_ERRORS as err:
            raise comm._failure(OP, err) from err
        return [comm._handle(work, OP) for work in works]

    def _wait(self, peer: int, work: Any) -> None:
        try:
            work.wait()
        except CommError:
            self._failed_peer = peer
            raise

    def _run(self) -> None:
        me, s, group = self._me, self._s, self._comm.group
        sources = sorted(r for r in s.received)
        dests = sorted(r for r in s.sent)
        if self._live is not None and self._kind(me) == "delta":  # the staging starts from the live slices
            for live, staged in zip(*self._live):
                staged.copy_(live)
        inbox = {r: torch.empty(self._incoming_bytes(r), dtype=torch.uint8, device=self._comm.device) for r in sources}
        outbox = {r: self._outgoing(r) for r in dests}
        if not self._p2p:
            ops = [dist.P2POp(dist.irecv, inbox[r], group=group, group_peer=r) for r in sources]
            ops += [dist.P2POp(dist.isend, outbox[r], group=group, group_peer=r) for r in dests]
            for work in self._launch(lambda: dist.batch_isend_irecv(ops) if ops else []):
                work.wait()
            self._copies()
            self._tally_sent(dests)
            for r in sources:
                self._apply(r, inbox[r])
            return
        incoming = [(r, *self._launch(lambda r=r: [group.recv([inbox[r]], r, _TAG)])) for r in sources]
        receipts = [
            (r, *self._launch(lambda r=r: [group.recv([torch.empty(1, dtype=torch.uint8)], r, _RECEIPT_TAG)]))
            for r in dests
        ]
        for r in dests:
            (work,) = self._launch(lambda r=r: [group.send([outbox[r]], r, _TAG)])
            self._sends.append((r, work))
        self._copies()
        self._tally_sent(dests)
        for r, work in incoming:
            self._wait(r, work)
            (receipt,) = self._launch(lambda r=r: [group.send([torch.zeros(1, dtype=torch.uint8)], r, _RECEIPT_TAG)])
            self._sends.append((r, receipt))
            self._apply(r, inbox[r])
        for r, work in receipts:
            self._wait(r, work)  # everything sent to r has arrived there
        sends, self._sends = self._sends, []
        for r, work in sends:
            self._wait(r, work)

    def _copies(self) -> None:
        for p in self._s.copies:
            self._touched.add(p.name)
            self._dst_view(p).copy_(self._src_view(p))
            if self.tally is not None:
                self.tally.copied(self._me, p.name, self._dst_view(p), p.lo)

    def _tally_sent(self, dests: list[int]) -> None:
        if self.tally is None:
            return
        for r in dests:
            for p in self._pairs.get((self._me, r), []):
                self.tally.sent(r, p.name, self._src_view(p), p.lo)

    def _apply(self, src: int, payload: torch.Tensor) -> None:
        """Decode the message from ``src`` and write it into the wanted slices."""
        pieces = self._pairs.get((src, self._me), [])
        changes, at = [], 0
        try:
            for p in pieces:
                change, at = _delta.decode(payload, at, *_words_of(self._names, p))
                changes.append(change)
        except ValueError as err:
            self._failed_peer = src
            raise CommError(f"{OP}: the message from rank {self._comm.ranks[src]} could not be read ({err})") from err
        for p, change in zip(pieces, changes):
            view = self._dst_view(p)
            self._touched.add(p.name)
            into = _changes.writable(view)
            w = _changes.words(into)
            _changes.apply([[w]], [w.numel()], change)
            if into is not view:
                view.copy_(into)
            if self.tally is not None:
                self.tally.received(p.name, view, p.lo)

    def _settle(self) -> None:
        deadline = time.monotonic() + _SETTLE_S
        for peer, work in self._sends:
            left = deadline - time.monotonic()
            if peer == self._failed_peer or left <= 0:
                continue
            with contextlib.suppress(Exception):  # it failed or did not finish: the group is closed next anyway
                work.wait(timedelta(seconds=left))
        self._sends = []

    def _account(self) -> str:
        ranks = self._comm.ranks
        parts = []
        if self._s.wanted_names and self.staging:
            parts.append("this member received into staging; its live slices were not written")
        elif self._s.wanted_names:
            touched = sorted(self._touched)
            untouched = [n for n in self._s.wanted_names if n not in self._touched]
            if touched:
                parts.append(
                    f"this member's wanted tensors {touched} may be partly written (a mix of old and new weights)"
                )
            parts.append(
                f"its wanted tensors {untouched} were not written"
                if untouched
                else "every wanted tensor may be partly written"
            )
        if self._s.sent:
            lost = "" if self._failed_peer is None else f"the transfer with rank {ranks[self._failed_peer]} failed; "
            parts.append(
                f"{lost}destinations at ranks {sorted(ranks[r] for r in self._s.sent)} may hold partial weights"
            )
        elif self._failed_peer is not None:
            parts.append(f"the transfer with rank {ranks[self._failed_peer]} failed")
        return "; ".join(parts) or "this member neither sent nor wanted anything"


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
                memory.held = (version, identity(wanted))
        except BaseException:
            memory.drop_delta()
            raise

    sync.succeeded = succeeded
