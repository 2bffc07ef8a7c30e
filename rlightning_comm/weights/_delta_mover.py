"""The data phase of a :func:`reshard_state_dict` in which some destination takes a delta: one message per pair of
members.

Each source sends each destination it serves one message: its delta (the boxes of that pair, in the plan's order), or
to a destination that takes a full sync every piece whole in a delta's format; copies within a member are made as the
plan's own data phase makes them. Each destination decodes what arrives from a source and writes it into its wanted
slices. Over gloo point to point: every receive posted first, a receipt per pair once its message arrived, each source
waiting for its receipts before its sends (a lost member fails its peers at once); a member that fails lets its sends
to the live members finish (bounded) and closes the group's connections. On other backends one grouped
``batch_isend_irecv``.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlightning_comm.errors import CommError
from rlightning_comm.failures import LAUNCH_ERRORS, close_gloo_group
from rlightning_comm.weights import _changes, _delta
from rlightning_comm.weights._delta_reshard import OP, PAIR_WORDS, Offer, by_pair, view, words_of
from rlightning_comm.weights._slices import Named
from rlightning_comm.weights._transport import point_to_point

_TAG, _RECEIPT_TAG = 0x5244, 0x5245  # "RD": a delta's messages, and its receipts
_SETTLE_S = 1.0  # how long a failing member lets its sends to live members finish before closing the group


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
        return view(self._names, p.name, p.src_block, p.lo, p.hi, "held")

    def _dst_view(self, p: Any) -> torch.Tensor:
        return view(self._names, p.name, p.dst_block, p.lo, p.hi, "wanted")

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
                change, at = _delta.decode(payload, at, *words_of(self._names, p))
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
