"""The data phase of a :func:`reshard_state_dict` in which some destination takes a delta: one message per pair of
members.

Each source sends each destination it serves one message: its delta (the boxes of that pair, in the plan's order), or
to a destination that takes a full sync every piece whole in a delta's format; copies within a member are made as the
plan's own data phase makes them. Each destination decodes what arrives from a source and writes it into its wanted
slices. Over gloo point to point: every receive posted first, a receipt per pair once its message arrived, each source
waiting for its receipts before its sends (a lost member fails its peers at once); on other backends one grouped
``batch_isend_irecv``. It is the plan's :class:`~._mover.Mover` with other messages: the copies, the failure handling
(a member that fails lets its sends to live members finish, bounded, and closes the group's connections) and the
account of what a failure left are the Mover's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlightning_comm.errors import CommError
from rlightning_comm.weights.delta import _changes, _encoding, _writes
from rlightning_comm.weights.reshard._delta import OP, PAIR_WORDS, Offer, by_pair, words_of
from rlightning_comm.weights.reshard._mover import _RECEIPT_TAG, Mover
from rlightning_comm.weights.reshard._slices import Named

_TAG = 0x5244  # "RD": a delta's messages (their receipts go on the Mover's tag)


class DeltaMover(Mover):
    """A delta reshard's data phase on one member: one message per pair, each destination writing what arrives.

    Args:
        comm, schedule, names, slots: As for :class:`~._mover.Mover` (an atomic destination's wanted blocks are its
            staging).
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
        slots: list[Any],
        offer: Offer | None,
        kinds: dict[int, str],
        rows: list[list[int]],
        live: tuple[list, list] | None,
    ) -> None:
        super().__init__(comm, schedule, names, slots)
        self._offer, self._kinds, self._rows, self._live = offer, kinds, rows, live
        self._pairs = by_pair(schedule)

    def run(self) -> None:
        try:
            super().run()
        finally:
            self._offer = None

    # ------------------------------------------------------------------ the messages
    def _kind(self, dst: int) -> str:
        return self._kinds.get(self._comm.ranks[dst], "full")

    def _outgoing(self, dst: int) -> torch.Tensor:
        if self._kind(dst) == "delta":
            return self._offer.payloads[dst]
        parts = []
        for p in self._pairs.get((self._me, dst), []):
            parts += _encoding.dense(_changes.flat([_changes.words(self._src_view(p))]))
        return torch.cat(parts)

    def _incoming_bytes(self, src: int) -> int:
        return self._rows[src][PAIR_WORDS * self._me + (2 if self._kind(self._me) == "delta" else 1)]

    def traffic(self) -> tuple[dict[int, int], dict[int, int]]:
        """The bytes this member sends and receives, per group rank."""
        me, s = self._me, self._s
        sent = {r: self._rows[me][PAIR_WORDS * r + (2 if self._kind(r) == "delta" else 1)] for r in sorted(s.sent)}
        return sent, {r: self._incoming_bytes(r) for r in sorted(s.received)}

    def _boxes(self) -> tuple[list[int], list[int], dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """The sources and destinations of this member, a buffer per incoming message, and each outgoing one."""
        s = self._s
        sources, dests = sorted(s.received), sorted(s.sent)
        if self._live is not None and self._kind(self._me) == "delta":  # the staging starts from the live slices
            for live, staged in zip(*self._live):
                staged.copy_(live)
        device = self._comm.device
        inbox = {r: torch.empty(self._incoming_bytes(r), dtype=torch.uint8, device=device) for r in sources}
        return sources, dests, inbox, {r: self._outgoing(r) for r in dests}

    def _run(self) -> None:
        """Over gloo point to point (see the module's docstring)."""
        sources, dests, inbox, outbox = self._boxes()
        incoming = [self._recv(inbox[r], r, _TAG) for r in sources]
        receipts = [self._recv(torch.empty(1, dtype=torch.uint8), r, _RECEIPT_TAG) for r in dests]
        for r in dests:
            self._send(outbox[r], r, _TAG)
        self._copies()
        self._tally_sent(dests)
        for r, work in incoming:
            self._wait(r, work)
            self._apply(r, inbox[r])
            self._receipt(r)  # after the writes: a source returns only once this member holds its bytes
        for r, work in receipts:
            self._wait(r, work)  # everything sent to r has arrived there
        self._wait_sends()

    def _run_batched(self) -> None:
        """Other backends (NCCL): every message in one grouped ``batch_isend_irecv`` on the mode's own group."""
        sources, dests, inbox, outbox = self._boxes()
        group = self._comm.group
        ops = [dist.P2POp(dist.irecv, inbox[r], group=group, group_peer=r) for r in sources]
        ops += [dist.P2POp(dist.isend, outbox[r], group=group, group_peer=r) for r in dests]
        for work in self._launch(lambda: dist.batch_isend_irecv(ops) if ops else []):
            work.wait()
        self._copies()
        self._tally_sent(dests)
        for r in sources:
            self._apply(r, inbox[r])

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
                change, at = _encoding.decode(payload, at, *words_of(self._names, p))
                changes.append(change)
        except ValueError as err:
            self._failed_peer = src
            raise CommError(f"{OP}: the message from rank {self._comm.ranks[src]} could not be read ({err})") from err
        for p, change in zip(pieces, changes):
            view = self._dst_view(p)
            self._touched.add(p.name)
            into = _writes.writable(view)
            w = _changes.words(into)
            _writes.apply([[w]], [w.numel()], change)
            if into is not view:
                view.copy_(into)
            if self.tally is not None:
                self.tally.received(p.name, view, p.lo)
