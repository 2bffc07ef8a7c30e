"""The data phase of :func:`reshard_state_dict` on one member: copies within it, pieces in place, buckets staged.

Over gloo on host tensors every message is point to point. The buckets move chunk by chunk through two staging buffers
(chunk ``j`` through buffer ``j % 2``: the next chunk is filled and launched before the current one is waited for); the
pieces that travel in place are launched after the first chunk, on a tag of their own. Nothing is copied but what is
strided: a piece contiguous on both sides travels straight from one tensor into the other, a piece contiguous on one
side is staged on the other only (:mod:`._schedule`), and small pieces share buckets. A destination unpacks each staged
bucket as it arrives and waits for what arrives in place only at the end, source by source, the last message first (a
pair's messages on a tag complete in order: it wakes about once per source, not once per piece). It sends each source a
receipt (one small message) once everything from it has arrived, and one per chunk for the buckets whose staging buffer
the source reuses later (after the pair's last such bucket of the chunk: a pair's buckets arrive in order); a source
waits for the receipt before waiting for its sends: gloo does not fail a send whose receiver died, while a receive from
a dead peer fails at once. So a source never returns while a destination it sent to died before confirming (no member
forwards what it received: every byte goes from a holder to a wanter). A member that fails lets its sends to the live
members finish (a receive cut mid-message waits out the group's timeout; at most a second) and closes the group's
connections, so every member's next wait fails within milliseconds. Other backends (NCCL) move each phase as one grouped
``batch_isend_irecv`` on the mode's group.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any

import torch

from rlightning_comm.errors import CommError
from rlightning_comm.failures import LAUNCH_ERRORS, await_work, close_gloo_group
from rlightning_comm.weights.core._staging import copy_pieces, typed
from rlightning_comm.weights.core._wire import point_to_point
from rlightning_comm.weights.reshard._batched import run_batched
from rlightning_comm.weights.reshard._schedule import Bucket, Piece, Schedule
from rlightning_comm.weights.reshard._slices import Block, Named

OP = "reshard_state_dict"
_DATA_TAG = 0x5253  # "RS": the buckets, matched in order per pair of members
_DIRECT_TAG = 0x5254  # the pieces in place: a stream of their own, so a pair's buckets need not queue behind them
_RECEIPT_TAG = 0x5252  # a destination's receipts to a source
_SETTLE_S = 1.0  # how long a failing member lets its sends to live members finish before closing the group


def _view(block: Block, lo: tuple[int, ...], hi: tuple[int, ...]) -> torch.Tensor:
    return block.tensor[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, block.offsets))]


class Mover:
    """Runs one member's schedule: copies within the member, pieces in place, buckets through two buffers."""

    def __init__(self, comm: Any, schedule: Schedule, names: dict[str, Named], slots: list[Any]) -> None:
        self._comm = comm
        self._s = schedule
        self._names = names
        self._me = comm.rank
        self._slots = slots
        self._p2p = point_to_point(comm)
        self._sends: list[tuple[int, Any]] = []  # (peer, handle) of the buckets' and receipts' sends not yet waited
        self._direct: list[tuple[int, Any]] = []  # the in-place pieces' sends: waited after the final receipts
        self._touched: set[str] = set()  # names whose wanted bytes may have changed here
        self._failed_peer: int | None = None
        # On a destination, what arrives in place and is waited at the end: (source, receive, piece).
        self._late: list[tuple[int, Any, Piece]] = []
        self.tally: Any = None  # a Tally fed with every piece as it passes (verify=True)
        self.staging = False  # the wanted tensors are an atomic sync's staging, not the live slices
        wanted = [b.tensor for n in names.values() for b in n.wanted]
        self._writes = torch.inference_mode if any(t.is_inference() for t in wanted) else torch.no_grad

    # ------------------------------------------------------------------ views and buffers
    def _src_view(self, p: Piece) -> torch.Tensor:
        return _view(self._names[p.name].held[p.src_block], p.lo, p.hi)

    def _dst_view(self, p: Piece) -> torch.Tensor:
        return _view(self._names[p.name].wanted[p.dst_block], p.lo, p.hi)

    @staticmethod
    def _bytes(view: torch.Tensor) -> torch.Tensor:
        return view.reshape(-1).view(torch.uint8)

    def _slot(self, k: int, nbytes: int) -> torch.Tensor:
        buffer = self._slots[k]
        if buffer is None or buffer.numel() < nbytes or buffer.device != self._comm.device:
            self._slots[k] = None  # free the old one first
            buffer = self._slots[k] = torch.empty(
                max(nbytes, self._s.slot_bytes), dtype=torch.uint8, device=self._comm.device
            )
        return buffer[:nbytes]

    def _pack(self, bucket: Bucket, buffer: torch.Tensor, pack: bool) -> None:
        views = [(p, self._src_view(p) if pack else self._dst_view(p)) for p in bucket.pieces]
        if not pack:
            self._touched.update(p.name for p in bucket.pieces)
        copy_pieces(buffer, views, pack)
        if self.tally is not None:
            for p, view in views:
                if pack:
                    self.tally.sent(p.dst, p.name, typed(buffer, p, view), p.lo)
                else:
                    self.tally.received(p.name, typed(buffer, p, view), p.lo)

    # ------------------------------------------------------------------ point to point
    def _launch(self, post: Any) -> list[Any]:
        comm = self._comm
        try:
            works = post()
        except LAUNCH_ERRORS as err:
            raise comm._failure(OP, err) from err
        return [comm._handle(work, OP) for work in works]

    def _send(self, data: torch.Tensor, peer: int, tag: int) -> Any:
        try:
            (work,) = self._launch(lambda: [self._comm.group.send([data], peer, tag)])
        except CommError:
            self._failed_peer = peer
            raise
        self._sends.append((peer, work))
        return work

    def _recv(self, data: torch.Tensor, peer: int, tag: int) -> tuple[int, Any]:
        (work,) = self._launch(lambda: [self._comm.group.recv([data], peer, tag)])
        return peer, work

    def _wait(self, peer: int, work: Any) -> None:
        try:
            # On a connected mode, given up once a loss is known: gloo does not wake a receive it is reading a message
            # into when the sender's connection closes (a member that died or went dark mid-message).
            await_work(self._comm, work, OP)
        except CommError:
            self._failed_peer = peer
            raise

    def _receipt(self, peer: int) -> None:
        self._send(torch.zeros(1, dtype=torch.uint8), peer, _RECEIPT_TAG)

    # ------------------------------------------------------------------ the run
    def start(self) -> None:
        """Nothing is launched before :meth:`finish` (what :class:`~._commit.Sync` calls first)."""

    def finish(self) -> None:
        """:meth:`run`."""
        self.run()

    def run(self) -> None:
        try:
            with self._writes():
                self._run() if self._p2p else self._run_batched()
        except CommError as err:
            if self._p2p:
                self._settle()
                close_gloo_group(self._comm.group)
            # The same type with the account added, its other arguments kept (PeerLostError's mode, generation, member).
            raise type(err)(f"{err}\n{OP} failed midway: {self._account()}", *err.args[1:]) from err
        finally:
            self._names = {}

    def _copies(self) -> None:
        for p in self._s.copies:
            self._touched.add(p.name)
            self._dst_view(p).copy_(self._src_view(p))
            if self.tally is not None:
                self.tally.copied(self._me, p.name, self._dst_view(p), p.lo)

    def _sent_whole(self, p: Piece) -> None:
        """Tally a piece that travels from its own memory (in place, or alone in a bucket)."""
        if self.tally is not None:
            self.tally.sent(p.dst, p.name, self._src_view(p), p.lo)

    def _received_whole(self, p: Piece) -> None:
        if self.tally is not None:
            self.tally.received(p.name, self._dst_view(p), p.lo)

    def _run(self) -> None:
        me, s = self._me, self._s
        for p in s.direct:  # the receives first: a source's bytes then find them posted
            if p.dst == me:
                self._touched.add(p.name)  # written as its bytes arrive
                self._late.append((*self._recv(self._bytes(self._dst_view(p)), p.src, _DIRECT_TAG), p))
        # Chunk j moves through buffer j % 2: chunk j + 1 is filled and launched before chunk j is waited for. The first
        # chunk goes before the pieces in place: its buckets (small tensors, strided blocks) would otherwise wait for
        # this member to write every large piece.
        pending = (s.chunks[0], self._launch_chunk(s.chunks[0], 0)) if s.chunks else None
        for p in s.direct:
            if p.src == me:
                self._send(self._bytes(self._src_view(p)), p.dst, _DIRECT_TAG)
                self._direct.append(self._sends.pop())
                self._sent_whole(p)
        self._copies()
        for j in range(1, len(s.chunks)):
            launched = self._launch_chunk(s.chunks[j], j % 2)
            self._complete_chunk(*pending)
            pending = (s.chunks[j], launched)
        if pending is not None:
            self._complete_chunk(*pending)
        # Every pair that moves anything ends with the destination's receipt of the whole transfer, sent to each source
        # once everything from it has arrived.
        finals = [self._recv(torch.empty(1, dtype=torch.uint8), peer, _RECEIPT_TAG) for peer in s.sent]
        self._arrived()
        for peer, work in finals:
            self._wait(peer, work)  # every piece from here has arrived there: the sends have completed
        self._sends += self._direct
        self._direct = []
        self._wait_sends()

    def _arrived(self) -> None:
        """On a destination: wait for what arrives in place (its pieces in place, and the buckets it need not unpack
        nor acknowledge alone), source by source, each one's last receive on a tag first (a tag's messages of one pair
        complete in order: this thread wakes about once per source); then its receipt of the whole transfer."""
        late, self._late = self._late, []
        for peer in self._s.received:
            mine = [entry for entry in late if entry[0] == peer]
            for _, work, p in reversed(mine):
                self._wait(peer, work)
                self._received_whole(p)
            self._receipt(peer)

    def _launch_chunk(self, chunk: tuple[Bucket, ...], slot: int) -> list[tuple[Any, ...]]:
        """Fill and launch this member's buckets of one chunk; what to wait for, per bucket."""
        me, launched = self._me, []
        whole = self._slot(slot, max((b.at(me) + b.nbytes for b in chunk if b.staged(me)), default=0))
        for bucket in chunk:
            staged = bucket.staged(me)
            buffer = whole[bucket.at(me) : bucket.at(me) + bucket.nbytes] if staged else None
            if bucket.src == me:
                if staged:
                    self._pack(bucket, buffer, pack=True)
                    data = buffer
                else:
                    data = self._bytes(self._src_view(bucket.pieces[0]))
                    self._sent_whole(bucket.pieces[0])
                receipt = (
                    self._recv(torch.empty(1, dtype=torch.uint8), bucket.dst, _RECEIPT_TAG) if bucket.receipt else None
                )
                self._send(data, bucket.dst, _DATA_TAG)
                launched.append((receipt, self._sends[-1]))
            else:
                if not staged:
                    self._touched.add(bucket.pieces[0].name)  # written as its bytes arrive
                data = buffer if staged else self._bytes(self._dst_view(bucket.pieces[0]))
                launched.append((self._recv(data, bucket.src, _DATA_TAG), buffer))
        return launched

    def _complete_chunk(self, chunk: tuple[Bucket, ...], launched: list[tuple[Any, ...]]) -> None:
        me, sent = self._me, []
        for bucket, (first, second) in zip(chunk, launched):
            if bucket.src == me:
                continue
            if second is None and not bucket.receipt:  # in place here, owed no receipt alone: waited at the end
                self._late.append((*first, bucket.pieces[0]))
                continue
            self._wait(*first)
            if bucket.receipt:
                self._receipt(bucket.src)
            if second is not None:
                self._pack(bucket, second, pack=False)
            else:
                self._received_whole(bucket.pieces[0])
        for bucket, (first, second) in zip(chunk, launched):
            if bucket.src == me and first is not None:
                self._wait(*first)  # the destination has the bucket: the send has completed
                self._wait(*second)
                sent.append(second)
            elif bucket.src == me:  # covered by the final receipt: waited after it
                self._direct.append(second)
                sent.append(second)
        done = {id(work) for work in sent}
        self._sends = [entry for entry in self._sends if id(entry) not in done]

    def _wait_sends(self) -> None:
        sends, self._sends = self._sends, []
        for k, (peer, work) in enumerate(sends):
            try:
                self._wait(peer, work)
            except CommError:
                self._sends = sends[k + 1 :]
                raise

    def _settle(self) -> None:
        """Let the sends to live members finish (bounded) before the group is closed under them."""
        deadline = time.monotonic() + _SETTLE_S
        for peer, work in self._sends + self._direct:
            left = deadline - time.monotonic()
            if peer == self._failed_peer or left <= 0:
                continue
            with contextlib.suppress(Exception):  # it failed or did not finish: the group is closed next anyway
                work.wait(timedelta(seconds=left))
        self._sends = self._direct = []

    def _run_batched(self) -> None:
        run_batched(self)

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
            dests = sorted(ranks[r] for r in self._s.sent)
            parts.append(f"{lost}destinations at ranks {dests} may hold partial weights")
        elif self._failed_peer is not None:
            parts.append(f"the transfer with rank {ranks[self._failed_peer]} failed")
        return "; ".join(parts) or "this member neither sent nor wanted anything"
