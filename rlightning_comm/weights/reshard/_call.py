"""Weight sync without the gather: every member sends the blocks it holds straight into the blocks others want.

A call agrees on a plan, then moves bytes. The agreement is one exchange of a few words per member (its verdict on its
own arguments, a hash of its metadata, the key of the plan it kept); when every member kept the plan of the current
metadata (the steady state of a training loop) that is all. Otherwise every member's metadata travels (two more rounds),
and every member computes the same plan from it (:mod:`._schedule`), refusing the same way on every member what cannot
be served. Nothing is written before both.

The bytes then move (:mod:`._mover`): over gloo point to point with receipts, so that a lost member fails every survivor
at once; on other backends in grouped ``batch_isend_irecv`` calls.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import torch

from rlightning_comm.context import CommContext
from rlightning_comm.errors import CommError
from rlightning_comm.modes import CommMode, ParallelMode
from rlightning_comm.weights.commit._report import WeightSyncReport
from rlightning_comm.weights.commit._sync import Sync
from rlightning_comm.weights.commit._versions import SyncOptions
from rlightning_comm.weights.core._memory import hash_key, kept
from rlightning_comm.weights.core._publish import StateDictTransfer, captures, drain
from rlightning_comm.weights.core._rounds import exchange, exchange_texts, raise_shared, rounds
from rlightning_comm.weights.core._wire import mode_store
from rlightning_comm.weights.reshard._delta import decide, possible, prepare, refresh
from rlightning_comm.weights.reshard._delta_mover import DeltaMover
from rlightning_comm.weights.reshard._mover import OP, Mover
from rlightning_comm.weights.reshard._schedule import Schedule, build_schedule
from rlightning_comm.weights.reshard._slices import Block, Named, TensorSlice, collect, metadata
from rlightning_comm.weights.reshard._tally import Tally

DEFAULT_BUCKET_BYTES = 64 * 2**20


def reshard_state_dict(
    *,
    held: Any = None,
    wanted: Any = None,
    comm_mode: CommMode | ParallelMode | str = ParallelMode.WEIGHT_TRANSFER,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    version: int | Literal["any"] | None = None,
    verify: bool = False,
    atomic: bool = False,
    staging_device: torch.device | str | None = None,
    delta: bool = False,
    async_op: bool = False,
) -> WeightSyncReport | StateDictTransfer | None:
    """Write every block each member wants with the bytes of the members that hold it, with no gather.

    Every member of ``comm_mode`` calls this. Each says what it can send (``held``) and what it needs (``wanted``), as
    blocks of named global tensors; a member may hold and want at once, or neither. The members agree on one plan, and
    each source sends each destination only the intersection of what it holds and what that destination wants: no member
    materialises a tensor it does not itself want, and no gather runs anywhere.

    Guarantees:

    * Every wanted element is written exactly once, with the bytes of one holder; an element held by several members
      (data-parallel replicas) is sent by exactly one of them, the load spread across them (a member that holds what it
      wants copies it itself).
    * Before any byte moves, every member checks its own arguments and the plan checks everyone's: an element wanted and
      held by no member (named, with its region), members that disagree on a name's dtype or global shape, a slice out
      of bounds, two wanted slices of one member that overlap, a bad argument. Any of these raises the same error on
      every member, no destination is touched, and the mode stays usable.
    * The plan is kept: a repeat call whose metadata (names, dtypes, shapes, blocks, strides) is unchanged on every
      member exchanges one fingerprint of a few words, then moves bytes.
    * A piece contiguous on both sides (at least ``min(bucket_bytes, 256 KiB)``) moves in place; the rest goes through
      at most two staging buffers per member of at most ``bucket_bytes`` each.
    * A member lost midway raises :class:`CommError` (:class:`PeerLostError` on a connected mode) on every survivor
      within seconds, not at the group's timeout; each destination's error names the tensors it may have partly written,
      each source the destinations it was sending to.

    Versions, verification and atomic updates work as for :func:`broadcast_state_dict`, with every member that wants
    something as a destination and every member that holds something as a source: with ``version``, a destination
    records the version it committed (:meth:`CommContext.get_weight_version`) and the call is refused on every member
    before any byte moves when a destination has committed this version or a later one (or a holder that wants nothing
    holds another version). With ``verify``, each piece's digest is computed by its sender as it is packed and by its
    destination as it is unpacked, and every destination's total is checked against what the holders sent it: a mismatch
    raises :class:`CommMismatchError` on every member naming the tensors. With ``atomic``, the destinations receive into
    staging, verify, and write their live slices only once every member staged and verified (a two-phase commit through
    the mode's store): a death or a mismatch before that point leaves every live slice as it was ("version 7 not
    committed; live weights are version 6").

    With ``delta`` (and a ``version``), each holder sends each destination only the elements of its pieces that changed
    since the version that destination holds: it keeps a copy of every block it sends (on the host: one copy of its
    shard, or of the part of it it sends), compares bit for bit, and sends the changed elements; the destination writes
    them in place. Decided per destination, on every member, before any byte moves: a destination gets a full sync when
    it holds another version than its holders' copies (a newcomer, a restart, a failed sync) or other tensors than the
    last sync wrote, when a holder's delta to it would not be smaller, and whenever the plan is made anew (the first
    call, or changed metadata: other blocks, or ``atomic`` switched on or off where staging lays a block out otherwise).
    ``report.kinds`` and ``report.delivered`` say which each destination got, and how many bytes.

    Args:
        held: What this member can send: a mapping of names to a tensor (the whole tensor), a ``DTensor`` (its local
            shard, where its placements put it: FSDP2's parameters, tensor-parallel ``Shard``/``Replicate``, uneven
            shards), a :class:`TensorSlice`, or a sequence of those; ``None`` for nothing. Only read.
        wanted: What this member needs: a mapping of names to :class:`TensorSlice` (or a sequence of them; a plain
            tensor or a ``DTensor`` is taken as above), each written in place through its tensor, which may be any
            strided view; ``None`` for nothing.
        comm_mode: A mode whose members are the holders and wanters: of the world, or a connected mode.
        bucket_bytes: Largest staging buffer, in bytes; the value of the member of group rank 0 is used.
        version: The version these weights are, or ``None`` (an unversioned sync, which clears the destinations'
            record). Every member passes the same, except that a destination may pass ``"any"``: it takes the version
            the sources name (and still refuses one at or below the version it committed), which the report and its
            record then hold (an engine that receives in the background before it knows the trainer's next version).
        verify: Check every wanted slice's digest against the bytes the holders sent.
        atomic: All or nothing (implies ``verify``): stage, verify, then commit through the mode's store. Staging holds
            one more copy of this member's wanted slices, allocated for the call.
        staging_device: Where an atomic destination stages: ``None`` or the communicator's device (the only one
            supported here).
        delta: Send only what changed since the last sync (needs ``version``; see above). ``False`` keeps nothing and
            frees what an earlier ``delta=True`` kept. Every member passes the same.
        async_op: Publish and step on: a holder returns as soon as the blocks it holds are captured (copied, on their
            own devices, into buffers kept for the next publish: one more copy of its held blocks) and may change its
            tensors at once; the call runs on a thread of its own and the returned :class:`StateDictTransfer`'s
            ``wait()`` gives its report once every destination holds the version (committed, with ``atomic``), or
            raises what the call raised, on every member as the blocking call does. A member that wants blocks has them
            written in the background: it must not read or write them until ``wait()`` returns. Publishes on a mode
            queue as for :func:`broadcast_state_dict`. Members may mix blocking and ``async_op`` calls.

    Returns:
        A :class:`WeightSyncReport` (bytes sent and received per peer, whether the plan was reused, the version; with
        ``verify``, the digest of each name this member wants, over its wanted slices of it: members that want the same
        slices report the same digests), or with ``async_op`` a :class:`StateDictTransfer` whose ``wait()`` returns it;
        ``None`` on a rank that is not a member of ``comm_mode``.

    Raises:
        TypeError, ValueError: a bad argument or a plan that cannot be served,
            on every member, before any byte moves.
        ModeNotBoundError: ``comm_mode`` is not bound on this rank.
        CommMismatchError: a stale version (before anything moves), or digests that differ after the transfer.
        CommError, CommTimeoutError, PeerLostError: a transfer failed midway.

    Tensors live on the communicator's device: the host for gloo, the member's GPU for NCCL. A holder may not modify its
    tensors until the call returns (with ``async_op``, the return comes once they are captured); a member that wants
    blocks may not read or write them until the call returns (with ``async_op``, until ``wait()`` returns).
    """
    comm = CommContext().get_communicator(comm_mode)
    options = SyncOptions(version, verify, atomic, staging_device, None, comm.mode, delta)
    if async_op and comm.is_member:
        return _publish(comm, held, wanted, bucket_bytes, options)
    return reshard(comm, held, wanted, bucket_bytes, options)


def _publish(comm: Any, held: Any, wanted: Any, bucket_bytes: Any, options: SyncOptions) -> StateDictTransfer:
    """``async_op=True``: the blocks this member holds captured, the call on a thread of its own."""
    memory = kept(comm)
    release = None
    names, problem = collect(held, None, comm.device) if held is not None else ({}, None)
    if problem is None and names:  # else the call itself reports it, on every member
        pool = captures(memory)
        blocks = [(name, e.global_shape, b) for name, e in names.items() for b in e.held]
        try:
            copies, token = pool.take([b.tensor for _, _, b in blocks])
        except Exception as err:  # noqa: BLE001 - raised by the call on every member, before any byte moves
            options.problem = options.problem or (RuntimeError, f"async_op: its tensors could not be captured: {err}")
        else:
            held = {}
            for (name, shape, b), copy in zip(blocks, copies):
                held.setdefault(name, []).append(TensorSlice(copy, b.offsets, shape))

            def release() -> None:
                pool.give_back(token)

    captured = held
    return StateDictTransfer(memory, lambda: reshard(comm, captured, wanted, bucket_bytes, options), OP, release)


def reshard(
    comm: Any, held: Any, wanted: Any, bucket_bytes: Any, options: SyncOptions | None = None
) -> WeightSyncReport | None:
    """:func:`reshard_state_dict` on the communicator ``comm`` (bound to a mode, or built by the caller)."""
    if not comm.is_member:
        return None
    if options is None:
        options = SyncOptions(None, False, False, None, None, comm.mode)
    if options.problem is None and options.atomic is True:
        if mode_store(comm) is None:
            options.problem = (ValueError, f"atomic=True needs a store every member of mode {comm.mode!r} reaches")
        elif options.staging_device is not None and options.staging_device != comm.device:
            options.problem = (
                ValueError,
                f"staging_device={options.staging_device} is not supported by {OP}; expected None or the "
                f"communicator's device {comm.device}",
            )
    drain(kept(comm))  # the publishes made before this call on the mode, in order
    with comm._exclusive(OP):
        memory = kept(comm)
        try:
            names, schedule, cached, live, wanters, delta = _agree(comm, held, wanted, bucket_bytes, memory, options)
        except CommError as err:  # a member lost in the handshake: nothing moved
            failed = options.not_committed(OP, err)
            if failed is None:
                raise
            raise failed from err
        ranks = comm.ranks
        tally = Tally(comm, {n: e.global_shape for n, e in names.items()}) if options.verify else None
        kinds, delivered = decide(options, delta[1], ranks, wanters) if options.delta else ({}, {})
        if "delta" in kinds.values():
            mover = DeltaMover(comm, schedule, names, memory.slots, delta[0], kinds, delta[1], live)
            sent, received = mover.traffic()
        else:
            mover = Mover(comm, schedule, names, memory.slots)
            sent, received = schedule.sent, schedule.received
        mover.tally, mover.staging = tally, live is not None
        sync = Sync(
            comm,
            mover,
            options,
            ranks[0],
            {ranks[r]: n for r, n in sorted(sent.items())},
            {ranks[r]: n for r, n in sorted(received.items())},
            tally,
            live,
            cached,
            rounds(comm, memory, OP),
            OP,
            applies=bool(schedule.wanted_names),
            coordinator=ranks[0],
            check=tally,
            destinations=wanters,
        )
        if options.delta:
            sync._report.kinds, sync._report.delivered = kinds, delivered
            key = (memory.reshard_plan[0], delta[2])
            refresh(sync, comm, memory, options, names, schedule, key, delta[0], delta[3])
        sync.start()
        return sync.finish()


def _staged(names: dict[str, Named]) -> tuple[dict[str, Named], tuple[list, list]]:
    """``names`` with every wanted block replaced by a contiguous staging tensor; ``(live, staged)`` tensors."""
    live, staged, out = [], [], {}
    for name, e in names.items():
        blocks = []
        for b in e.wanted:
            t = torch.empty(b.shape, dtype=b.tensor.dtype, device=b.tensor.device)
            live.append(b.tensor.detach())
            staged.append(t)
            blocks.append(Block(t, b.offsets, b.shape, tuple(t.stride()), True))
        out[name] = e._replace(wanted=blocks)
    return out, (live, staged)


def _agree(
    comm: Any, held: Any, wanted: Any, bucket_bytes: Any, memory: Any, options: SyncOptions
) -> tuple[dict[str, Named], Schedule, bool, tuple[list, list] | None, list[int], tuple[Any, ...]]:
    """This member's blocks and schedule, whether the schedule was kept, its ``(live, staged)`` tensors (atomic), the
    ranks that want something, and for ``delta=True`` (this member's offer, every member's pair words, its metadata's
    hash, its live wanted tensors); or the same error on every member."""
    names, problem = collect(held, wanted, comm.device)
    problem = problem or options.problem
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        problem = problem or (ValueError, f"bucket_bytes must be a positive int; got {bucket_bytes!r}")
    live_wanted = [b.tensor for _, e in sorted(names.items()) for b in e.wanted] if options.delta else []
    live = None
    if problem is None and options.atomic is True:
        names, live = _staged(names)  # the plan is made for the staging tensors: the live ones wait for the commit
    wants = any(e.wanted for e in names.values())
    holds = any(e.held for e in names.values())
    meta = None if problem is not None else metadata(names)
    kept_plan = memory.reshard_plan
    same = kept_plan is not None and meta == kept_plan[3]  # this member's metadata as when the plan was made
    text = None if same else "" if meta is None else json.dumps(meta, separators=(",", ":"))
    mine = kept_plan[2] if same else hash_key(text)
    kept_key = kept_plan[0] if kept_plan is not None else (0, 0)
    words = [int(problem is not None), bucket_bytes if problem is None else 0, *mine, *kept_key, int(wants), int(holds)]
    offer, pairs = None, [0, 0, -1] * comm.world_size
    if problem is None and options.delta:  # each holder encodes its deltas before the exchange; their sizes follow
        offer, pairs = prepare(comm, memory, options, names, kept_plan, mine, live_wanted)
    elif not options.delta:
        memory.drop_delta()  # delta=False keeps nothing: a later delta=True starts with a full sync
    rows = exchange(comm, [*words, *options.words()], memory, OP)
    if any(row[0] for row in rows):
        raise_shared(comm, problem, memory, OP)
    ranks = comm.ranks
    wanters = [r for r, row in zip(ranks, rows) if row[6]]
    holders = {r for r, row in zip(ranks, rows) if row[7]}
    options.check(ranks, [row[8:] for row in rows], ranks[0], OP, set(wanters), holders)
    bucket = rows[0][1]
    key = hash_key((tuple(tuple(row[2:4]) for row in rows), bucket))
    cached = kept_plan is not None and all(tuple(row[4:6]) == key for row in rows)
    delta = (offer, [], mine, live_wanted)
    if cached and possible(options, wanters):  # the pair words only when a delta can happen: a round of their own
        delta = (offer, exchange(comm, pairs, memory, OP), mine, live_wanted)
    if cached:
        return names, kept_plan[1], True, live, wanters, delta
    if text is None:
        text = json.dumps(meta, separators=(",", ":"))
    metas = [json.loads(t) for t in exchange_texts(comm, text, memory, OP)]
    memory.reshard_plan = None
    try:
        schedule = build_schedule(metas, bucket, comm.ranks, comm.rank)
    except ValueError as err:  # the same on every member: the metadata is
        raise ValueError(f"{OP}: nothing was transferred; {err}") from None
    memory.reshard_plan = (key, schedule, mine, meta)
    return names, schedule, False, live, wanters, delta
