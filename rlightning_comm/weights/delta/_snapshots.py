"""What a source keeps for ``delta=True``: a copy, on the host, of what it last sent, and the version it is.

A :class:`Snapshot` holds one flat run of words per record (:mod:`._encoding`) of what this member sends: a source's own
shard, nothing it does not send. It is made (or refreshed) once a sync that carried a version succeeded everywhere, so
its version is the one every destination of that sync committed; a failed sync leaves it at the version it was, and a
destination that holds another version (a newcomer, a restart, a failed sync: its version is forgotten) gets a full
sync. It is kept in the communicator's memory (:mod:`._memory`), so it goes with the communicator's generation, and so
does the comparison's scratch it holds (a flag per 4 bytes of its largest record, at most one per word).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from rlightning_comm.context import CommContext
from rlightning_comm.modes import CommMode, ParallelMode
from rlightning_comm.weights.core._memory import kept
from rlightning_comm.weights.delta import _changes, _encoding, _writes

Views = Callable[[_encoding.Record], list[torch.Tensor]]  # a record's word views, in this call's tensors


class Offer(NamedTuple):
    """A source's delta, encoded before the members agree on it: the payload (``None`` when it would not be smaller
    than the tensors: then only the changes, for the snapshot) and the change of each record."""

    payload: torch.Tensor | None  # uint8
    changes: list[_changes.Change]
    base: int  # the version it applies to


class Snapshot:
    """A source's words of what it last sent, one flat host tensor per record.

    Args:
        key: What it is a copy of (the plan of a broadcast, the schedule of a reshard): another key, and it is no base.
        records: The records of what this member sends.
    """

    def __init__(self, key: Any, records: list[_encoding.Record]) -> None:
        self.key = key
        self.records = records
        self.flats: list[torch.Tensor] = []
        # the comparison's flags: a bool per word (or per 4 bytes) of its largest record
        self.scratch = _changes.Scratch()
        self.version: int | None = None  # None until a sync that carried a version succeeded
        # the changes taken on while comparing, not yet kept (the sync has not succeeded): record -> (positions, the
        # words they held), undone before the snapshot is next used unless :meth:`advance` keeps them
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _settle(self) -> None:
        """Undo the changes taken on for a sync that did not succeed: the snapshot is again the version it was."""
        pending, self.pending = self.pending, {}
        for i, (pos, old) in pending.items():
            self.flats[i].index_copy_(0, pos, old)

    def base(self, key: Any) -> int:
        """The version a delta against this snapshot applies to, for a call of ``key``; -1 for none."""
        self._settle()
        return self.version if self.version is not None and key == self.key and self.flats else -1

    def changes(self, views: Views) -> tuple[list[torch.Tensor], list[_changes.Change]]:
        """Every record's words now and its change since the snapshot (what it takes on once a sync succeeded).

        A record's few scattered changes (``sparse``) on the host are written into the snapshot at once, while its
        words are in cache (later they cost another pass over the memory), the words they replace kept to undo them:
        they stand once the sync succeeded (:meth:`advance`), else they are undone before the snapshot is next used.
        """
        self._settle()
        curs, changes = [], []
        for i, (record, snap) in enumerate(zip(self.records, self.flats)):
            cur = _changes.record_words(views(record))
            host = cur.device == snap.device
            if not host:
                snap = snap.to(cur.device, non_blocking=True)
            change = _changes.change_of(cur, snap, self.scratch)
            if host and change.kind == _changes.SPARSE:  # a mask's many changes: a pass either way, kept for later
                self.pending[i] = (change.pos, snap.index_select(0, change.pos))
                _writes.advance(snap, change)
            curs.append(cur)
            changes.append(change)
        return curs, changes

    def offer(self, views: Views, device: torch.device, limit: int) -> Offer:
        """Every record's changes since the snapshot, encoded into one payload on ``device`` if it is smaller than
        ``limit`` bytes (else no payload: a full sync, whose delta's bytes are never built)."""
        base = self.base(self.key)  # before the comparison: it writes into the snapshot
        curs, changes = self.changes(views)
        total = sum(_encoding.nbytes(c, cur.numel(), cur.element_size()) for cur, c in zip(curs, changes))
        if total >= limit:
            return Offer(None, changes, base)
        parts = [p.to(device) for cur, c in zip(curs, changes) for p in _encoding.sections(cur, c)]
        payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
        return Offer(payload, changes, base)

    def take(self, views: Views, version: int) -> None:
        """After a full sync that carried ``version`` succeeded: copy every record (into the kept memory when its layout
        is the same; fresh pages cost more to fault in than the copy)."""
        fresh = len(self.flats) != len(self.records)
        self.version, self.pending = None, {}
        for i, record in enumerate(self.records):
            cur = _changes.record_words(views(record))
            if fresh:
                pinned = cur.is_cuda and torch.cuda.is_available()
                self.flats.append(torch.empty(cur.numel(), dtype=cur.dtype, pin_memory=pinned))
            self.flats[i].view(cur.shape).copy_(cur)
        self.version = version

    def advance(self, changes: list[_changes.Change], version: int) -> None:
        """After a delta sync that carried ``version`` succeeded: take on each record's change (those written while
        comparing stand)."""
        self.version = None
        pending, self.pending = self.pending, {}
        for i, (snap, change) in enumerate(zip(self.flats, changes)):
            if i not in pending:
                _writes.advance(snap, change)
        self.version = version


def snapshot_for(memory: Any, key: Any, records: Callable[[], list[_encoding.Record]]) -> Snapshot:
    """The communicator's snapshot of ``key``, made (empty, no base yet) when it keeps none or one of another key."""
    snap = memory.snapshot
    if snap is None or snap.key != key:
        snap = memory.snapshot = None  # the old one goes first
        snap = memory.snapshot = Snapshot(key, records())
    return snap


def forget_delta(comm_mode: CommMode | ParallelMode | str = ParallelMode.WEIGHT_TRANSFER) -> None:
    """Free what this member keeps for ``delta=True`` syncs on ``comm_mode``: a source's snapshot (one copy, on the
    host, of what it sends), a destination's note of the version its tensors hold and its receive buffer.

    The next ``delta=True`` sync from this member, or to it, is full. A destination whose tensors torch wrote into
    other than by a sync (an in-place op on them or a view of them: their version counters moved) gets a full sync
    without it; call it on a destination whose tensors changed where torch does not count (through ``.data``, numpy, a
    raw pointer, another process), or on a source to free the snapshot's memory between syncs. A ``delta=False`` sync
    frees the same, and a new generation of a connected mode (or ``CommContext.destroy``) starts with none. Local: no
    collective, nothing is sent.

    Raises:
        ModeNotBoundError: ``comm_mode`` is not bound on this rank.
    """
    kept(CommContext().get_communicator(comm_mode)).drop_delta()
