"""Weight sync without the gather: every member sends the blocks it holds straight into the blocks others want.

A call agrees on a plan, then moves bytes. The agreement is one exchange of a
few words per member (its verdict on its own arguments, a hash of its
metadata, the key of the plan it kept); when every member kept the plan of the
current metadata (the steady state of a training loop) that is all.
Otherwise every member's metadata travels (two more rounds), and every member
computes the same plan from it (:mod:`._schedule`), refusing the same way on
every member what cannot be served. Nothing is written before both.

The bytes move, over gloo on host tensors, point to point: the pieces that
travel in place are launched first, then the buckets chunk by chunk through
two staging buffers. A destination sends its source a receipt (one small
message) once a bucket has arrived and once every piece from it has, and a
source waits for the receipt before its sends: gloo does not fail a send whose
receiver died, while a receive from a dead peer fails at once. A member that
fails lets its sends to the live members finish (a receive cut mid-message
waits out the group's timeout) and closes the group's connections, so every
member's next wait fails within milliseconds. Other backends (NCCL) move each
phase as one grouped ``batch_isend_irecv``.
"""

from __future__ import annotations

import contextlib
import json
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlightning_comm.context import CommContext
from rlightning_comm.errors import CommError
from rlightning_comm.failures import LAUNCH_ERRORS, close_gloo_group
from rlightning_comm.modes import CommMode, ParallelMode
from rlightning_comm.weights._handshake import _ERRORS, _exchange_texts, _hash, exchange, kept
from rlightning_comm.weights._plan import dtype_of
from rlightning_comm.weights._report import WeightSyncReport
from rlightning_comm.weights._schedule import Bucket, Piece, Schedule, build_schedule
from rlightning_comm.weights._slices import Block, Named, collect, metadata
from rlightning_comm.weights._transport import point_to_point

DEFAULT_BUCKET_BYTES = 64 * 2**20
_OP = "reshard_state_dict"
_DATA_TAG = 0x5253  # "RS": every piece and bucket, matched in order per pair of members
_RECEIPT_TAG = 0x5252  # a destination's receipts to a source
_SETTLE_S = 1.0  # how long a failing member lets its sends to live members finish before closing the group

# Per communicator: (the plan's key, this member's schedule). Dies with the communicator.
_plans: weakref.WeakKeyDictionary[Any, tuple[tuple[int, int], Schedule]] = weakref.WeakKeyDictionary()


def reshard_state_dict(
    *,
    held: Any = None,
    wanted: Any = None,
    comm_mode: CommMode | ParallelMode | str = ParallelMode.WEIGHT_TRANSFER,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> WeightSyncReport | None:
    """Write every block each member wants with the bytes of the members that hold it, with no gather.

    Every member of ``comm_mode`` calls this. Each says what it can send
    (``held``) and what it needs (``wanted``), as blocks of named global
    tensors; a member may hold and want at once, or neither. The members agree
    on one plan, and each source sends each destination only the intersection
    of what it holds and what that destination wants: no member materialises
    a tensor it does not itself want, and no gather runs anywhere.

    Guarantees:

    * Every wanted element is written exactly once, with the bytes of one
      holder; an element held by several members (data-parallel replicas) is
      sent by exactly one of them, the load spread across them (a member that
      holds what it wants copies it itself).
    * Before any byte moves, every member checks its own arguments and the
      plan checks everyone's: an element wanted and held by no member (named,
      with its region), members that disagree on a name's dtype or global
      shape, a slice out of bounds, two wanted slices of one member that
      overlap, a bad argument. Any of these raises the same error on every
      member, no destination is touched, and the mode stays usable.
    * The plan is kept: a repeat call whose metadata (names, dtypes, shapes,
      blocks, strides) is unchanged on every member exchanges one fingerprint
      of a few words, then moves bytes.
    * A piece contiguous on both sides (at least ``min(bucket_bytes, 256
      KiB)``) moves in place; the rest goes through at most two staging
      buffers per member of at most ``bucket_bytes`` each.
    * A member lost midway raises :class:`CommError` (:class:`PeerLostError`
      on a connected mode) on every survivor within seconds, not at the
      group's timeout; each destination's error names the tensors it may have
      partly written, each source the destinations it was sending to.

    Args:
        held: What this member can send: a mapping of names to a tensor (the
            whole tensor), a ``DTensor`` (its local shard, where its placements
            put it: FSDP2's parameters, tensor-parallel ``Shard``/``Replicate``,
            uneven shards), a :class:`TensorSlice`, or a sequence of those;
            ``None`` for nothing. Only read.
        wanted: What this member needs: a mapping of names to
            :class:`TensorSlice` (or a sequence of them; a plain tensor or a
            ``DTensor`` is taken as above), each written in place through its
            tensor, which may be any strided view; ``None`` for nothing.
        comm_mode: A mode whose members are the holders and wanters: of the
            world, or a connected mode.
        bucket_bytes: Largest staging buffer, in bytes; the value of the
            member of group rank 0 is used.

    Returns:
        A :class:`WeightSyncReport` (bytes sent and received per peer, whether
        the plan was reused); ``None`` on a rank that is not a member of ``comm_mode``.

    Raises:
        TypeError, ValueError: a bad argument or a plan that cannot be served,
            on every member, before any byte moves.
        ModeNotBoundError: ``comm_mode`` is not bound on this rank.
        CommError, CommTimeoutError, PeerLostError: a transfer failed midway.

    Tensors live on the communicator's device: the host for gloo, the
    member's GPU for NCCL. Until the call returns, a source may not modify its
    tensors, nor a destination read or write its slices.
    """
    comm = CommContext().get_communicator(comm_mode)
    return reshard(comm, held, wanted, bucket_bytes)


def reshard(comm: Any, held: Any, wanted: Any, bucket_bytes: Any) -> WeightSyncReport | None:
    """:func:`reshard_state_dict` on the communicator ``comm`` (bound to a mode, or built by the caller)."""
    if not comm.is_member:
        return None
    with comm._exclusive(_OP):
        memory = kept(comm)
        if memory.unfinished is not None:  # an unwaited broadcast_state_dict on this mode: it holds the group's order
            memory.unfinished.finish()
            memory.unfinished = None
        names, schedule, cached = _agree(comm, held, wanted, bucket_bytes, memory)
        mover = _Mover(comm, schedule, names, memory.slots)
        mover.run()
        ranks = comm.ranks
        return WeightSyncReport(
            sent={ranks[r]: n for r, n in sorted(schedule.sent.items())},
            received={ranks[r]: n for r, n in sorted(schedule.received.items())},
            plan_cached=cached,
        )


def _raise_shared(comm: Any, problem: Any, memory: Any) -> None:
    texts = _exchange_texts(comm, None if problem is None else f"{problem[0].__name__}\0{problem[1]}", memory)
    found = [(rank, *text.split("\0", 1)) for rank, text in zip(comm.ranks, texts) if text is not None]
    detail = "; ".join(f"rank {rank}: {msg}" for rank, _, msg in found)
    raise _ERRORS.get(found[0][1], RuntimeError)(f"{_OP}: nothing was transferred; {detail}")


def _agree(
    comm: Any, held: Any, wanted: Any, bucket_bytes: Any, memory: Any
) -> tuple[dict[str, Named], Schedule, bool]:
    """This member's blocks and schedule, and whether the schedule was kept; or the same error on every member."""
    names, problem = collect(held, wanted, comm.device)
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        problem = problem or (ValueError, f"bucket_bytes must be a positive int; got {bucket_bytes!r}")
    text = "" if problem is not None else json.dumps(metadata(names), separators=(",", ":"))
    mine = _hash(text)
    kept_plan = _plans.get(comm)
    kept_key = kept_plan[0] if kept_plan is not None else (0, 0)
    words = [int(problem is not None), bucket_bytes if problem is None else 0, *mine, *kept_key]
    rows = exchange(comm, words, memory)
    if any(row[0] for row in rows):
        _raise_shared(comm, problem, memory)
    bucket = rows[0][1]
    key = _hash((tuple(tuple(row[2:4]) for row in rows), bucket))
    if kept_plan is not None and all(tuple(row[4:6]) == key for row in rows):
        return names, kept_plan[1], True
    metas = [json.loads(t) for t in _exchange_texts(comm, text, memory)]
    _plans.pop(comm, None)
    try:
        schedule = build_schedule(metas, bucket, comm.ranks, comm.rank)
    except ValueError as err:  # the same on every member: the metadata is
        raise ValueError(f"{_OP}: nothing was transferred; {err}") from None
    _plans[comm] = (key, schedule)
    return names, schedule, False


def _view(block: Block, lo: tuple[int, ...], hi: tuple[int, ...]) -> torch.Tensor:
    return block.tensor[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, block.offsets))]


class _Mover:
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
        self._sent_to: set[int] = set()
        self._failed_peer: int | None = None
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
        for p in bucket.pieces:
            view = self._src_view(p) if pack else self._dst_view(p)
            typed = buffer[p.at : p.at + p.nbytes].view(dtype_of(self._names[p.name].dtype)).view(view.shape)
            if pack:
                typed.copy_(view)
            else:
                self._touched.add(p.name)
                view.copy_(typed)

    # ------------------------------------------------------------------ point to point
    def _group_peer(self, peer: int) -> int:
        return peer  # schedules are in group ranks

    def _launch(self, post: Any) -> list[Any]:
        comm = self._comm
        try:
            works = post()
        except LAUNCH_ERRORS as err:
            raise comm._failure(_OP, err) from err
        return [comm._handle(work, _OP) for work in works]

    def _send(self, data: torch.Tensor, peer: int, tag: int) -> Any:
        self._sent_to.add(peer)
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
            work.wait()
        except CommError:
            self._failed_peer = peer
            raise

    def _receipt(self, peer: int) -> None:
        self._send(torch.zeros(1, dtype=torch.uint8), peer, _RECEIPT_TAG)

    # ------------------------------------------------------------------ the run
    def run(self) -> None:
        try:
            with self._writes():
                self._run() if self._p2p else self._run_batched()
        except CommError as err:
            if self._p2p:
                self._settle()
                close_gloo_group(self._comm.group)
            # The same type with the account added, its other arguments kept (PeerLostError's mode, generation, member).
            raise type(err)(f"{err}\n{_OP} failed midway: {self._account()}", *err.args[1:]) from err
        finally:
            self._names = {}

    def _copies(self) -> None:
        for p in self._s.copies:
            self._touched.add(p.name)
            self._dst_view(p).copy_(self._src_view(p))

    def _run(self) -> None:
        me, s = self._me, self._s
        incoming: list[tuple[int, Any]] = []
        direct_sources: dict[int, None] = {}
        direct_dests: dict[int, None] = {}
        for p in s.direct:
            if p.src == me:
                self._send(self._bytes(self._src_view(p)), p.dst, _DATA_TAG)
                self._direct.append(self._sends.pop())
                direct_dests[p.dst] = None
            else:
                self._touched.add(p.name)  # written as its bytes arrive
                incoming.append(self._recv(self._bytes(self._dst_view(p)), p.src, _DATA_TAG))
                direct_sources[p.src] = None
        self._copies()
        # Chunk j moves through buffer j % 2: chunk j + 1 is filled and launched before chunk j is waited for.
        pending = None
        for j, chunk in enumerate(s.chunks):
            launched = self._launch_chunk(chunk, j % 2)
            if pending is not None:
                self._complete_chunk(*pending)
            pending = (chunk, launched)
        if pending is not None:
            self._complete_chunk(*pending)
        # Wait for the last receive from each source first: a pair's messages complete in order.
        for peer, work in reversed(incoming):
            self._wait(peer, work)
        for peer in direct_sources:
            self._receipt(peer)
        finals = [self._recv(torch.empty(1, dtype=torch.uint8), peer, _RECEIPT_TAG) for peer in direct_dests]
        for peer, work in finals:
            self._wait(peer, work)  # every piece from here has arrived there: the sends have completed
        self._sends += self._direct
        self._direct = []
        self._wait_sends()

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
                receipt = self._recv(torch.empty(1, dtype=torch.uint8), bucket.dst, _RECEIPT_TAG)
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
            self._wait(*first)
            self._receipt(bucket.src)
            if second is not None:
                self._pack(bucket, second, pack=False)
        for bucket, (first, second) in zip(chunk, launched):
            if bucket.src == me:
                self._wait(*first)  # the destination has the bucket: the send has completed
                self._wait(*second)
                sent.append(second)
        self._sends = [entry for entry in self._sends if not any(entry is done for done in sent)]

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
        """Other backends (NCCL): each phase as one grouped ``batch_isend_irecv``, on the mode's own group."""
        me, group = self._me, self._comm.group

        def batch(ops: list[tuple[Any, torch.Tensor, int]]) -> None:
            if not ops:
                return
            p2p = [dist.P2POp(op, t, group=group, group_peer=peer) for op, t, peer in ops]
            works = self._launch(lambda: dist.batch_isend_irecv(p2p))
            for work in works:
                work.wait()

        ops = []
        for p in self._s.direct:
            if p.src == me:
                self._sent_to.add(p.dst)
                ops.append((dist.isend, self._bytes(self._src_view(p)), p.dst))
            else:
                self._touched.add(p.name)
                ops.append((dist.irecv, self._bytes(self._dst_view(p)), p.src))
        batch(ops)
        self._copies()
        for j, chunk in enumerate(self._s.chunks):
            ops, staged = [], []
            whole = self._slot(j % 2, max((b.at(me) + b.nbytes for b in chunk if b.staged(me)), default=0))
            for bucket in chunk:
                buffer = whole[bucket.at(me) : bucket.at(me) + bucket.nbytes] if bucket.staged(me) else None
                if bucket.src == me:
                    self._sent_to.add(bucket.dst)
                    if buffer is not None:
                        self._pack(bucket, buffer, pack=True)
                    ops.append(
                        (
                            dist.isend,
                            buffer if buffer is not None else self._bytes(self._src_view(bucket.pieces[0])),
                            bucket.dst,
                        )
                    )
                elif buffer is not None:
                    ops.append((dist.irecv, buffer, bucket.src))
                    staged.append((bucket, buffer))
                else:
                    self._touched.add(bucket.pieces[0].name)
                    ops.append((dist.irecv, self._bytes(self._dst_view(bucket.pieces[0])), bucket.src))
            batch(ops)
            for bucket, buffer in staged:
                self._pack(bucket, buffer, pack=False)

    def _account(self) -> str:
        ranks = self._comm.ranks
        parts = []
        if self._s.wanted_names:
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
