"""Weight sync without the gather: every member sends the blocks it holds straight into the blocks others want.

A call agrees on a plan, then moves bytes. The agreement is one exchange of a
few words per member (its verdict on its own arguments, a hash of its
metadata, the key of the plan it kept); when every member kept the plan of the
current metadata (the steady state of a training loop) that is all.
Otherwise every member's metadata travels (two more rounds), and every member
computes the same plan from it (:mod:`._schedule`), refusing the same way on
every member what cannot be served. Nothing is written before both.

The bytes then move (:mod:`._mover`): over gloo point to point with receipts, so
that a lost member fails every survivor at once; on other backends in grouped
``batch_isend_irecv`` calls.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

from rlightning_comm.context import CommContext
from rlightning_comm.modes import CommMode, ParallelMode
from rlightning_comm.weights._handshake import _ERRORS, _exchange_texts, _hash, exchange, kept
from rlightning_comm.weights._mover import OP, Mover
from rlightning_comm.weights._report import WeightSyncReport
from rlightning_comm.weights._schedule import Schedule, build_schedule
from rlightning_comm.weights._slices import Named, collect, metadata

DEFAULT_BUCKET_BYTES = 64 * 2**20

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
    with comm._exclusive(OP):
        memory = kept(comm)
        if memory.unfinished is not None:  # an unwaited broadcast_state_dict on this mode: it holds the group's order
            memory.unfinished.finish()
            memory.unfinished = None
        names, schedule, cached = _agree(comm, held, wanted, bucket_bytes, memory)
        mover = Mover(comm, schedule, names, memory.slots)
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
    raise _ERRORS.get(found[0][1], RuntimeError)(f"{OP}: nothing was transferred; {detail}")


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
        raise ValueError(f"{OP}: nothing was transferred; {err}") from None
    _plans[comm] = (key, schedule)
    return names, schedule, False
