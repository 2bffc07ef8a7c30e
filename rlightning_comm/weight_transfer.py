"""Broadcast a model's weights from one rank to the others at the wire's speed, loading them in place.

A call first agrees on what moves, then moves it (see :mod:`._weight_pipeline`).
The agreement is one exchange of a few integers per rank: each rank's
verdict on its own arguments, the source it names, a hash of its tensors'
names, dtypes and shapes, and the plan it kept from its last call (over gloo
two hops of point-to-point messages through group rank 0, otherwise an
all-gather), and whether stats or debug mode instruments its broadcasts. When every
rank holds the plan of the source's current manifest (the steady state of a
training loop), that is all; otherwise the source broadcasts its manifest
(one small object broadcast) and every rank builds the plan. A bad argument or
a mismatch anywhere raises the same error on every member, before any weight
moves.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from rlightning_comm._weight_pipeline import Entry, Pipeline, Plan, build_plan, point_to_point, same_view
from rlightning_comm.communicators._objects import all_gather_objects
from rlightning_comm.context import CommContext
from rlightning_comm.modes import CommMode, ParallelMode

DEFAULT_BUCKET_BYTES = 64 * 2**20

StateDictLike = Mapping[str, torch.Tensor] | nn.Module | Sequence[tuple[str, torch.Tensor]]
_Problem = tuple[type[Exception], str] | None


class _Kept:
    """What a communicator keeps between calls: per source, the last agreed manifest key and its plan; the two staging buffers; this rank's last manifest and its hashes."""

    def __init__(self) -> None:
        self.plans: dict[int, tuple[tuple[int, int], Plan]] = {}
        self.slots: list[torch.Tensor | None] = [None, None]
        self.unfinished: Pipeline | None = None  # an async transfer not yet waited: it holds the slots
        # (manifest, bucket_bytes, hash of its sorted names/dtypes/shapes, hash of (manifest, bucket_bytes) or None)
        self.hashed: tuple[list[Entry], int, tuple[int, int], tuple[int, int] | None] | None = None

    def hashes(self, manifest: list[Entry], bucket_bytes: int, is_source: bool) -> tuple[tuple[int, int], tuple[int, int]]:
        """The hash of ``manifest``'s sorted names, dtypes and shapes, and (on the source) of the plan's inputs; recomputed only when they changed since the last call."""
        kept = self.hashed
        if kept is None or kept[0] != manifest:
            kept = (manifest, bucket_bytes, _hash(sorted(e[:3] for e in manifest)), None)
        if is_source and (kept[3] is None or kept[1] != bucket_bytes):
            kept = (manifest, bucket_bytes, kept[2], _hash((manifest, bucket_bytes)))
        self.hashed = kept
        return kept[2], kept[3] if is_source and kept[3] is not None else (0, 0)


# Dies with its communicator (a destroyed context frees the buffers).
_kept: weakref.WeakKeyDictionary[Any, _Kept] = weakref.WeakKeyDictionary()
_WORDS = 9  # per rank: status, src, sorted-manifest hash (2), source's manifest key (2), kept key (2), instrumented
_HANDSHAKE_TAG = 0x5755  # the point-to-point tag of the exchange over gloo (the data's is the next-lower one)
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _named_tensors(state_dict: Any) -> tuple[list[tuple[str, torch.Tensor]], None] | tuple[None, tuple[type[Exception], str]]:
    """The named tensors of any accepted input, or the exception type and message of what is wrong with it."""
    if isinstance(state_dict, nn.Module):
        items = list(state_dict.state_dict().items())
    elif isinstance(state_dict, Mapping):
        items = list(state_dict.items())
    elif isinstance(state_dict, Sequence) and not isinstance(state_dict, (str, bytes)):
        items = list(state_dict)
        for i, item in enumerate(items):
            if not (isinstance(item, tuple) and len(item) == 2):
                return None, (TypeError, f"a list of named tensors must hold (name, tensor) pairs; item {i} is {type(item).__name__}")
    else:
        return None, (TypeError, f"state_dict must be a Mapping of names to tensors, an nn.Module or a list of (name, tensor); got {type(state_dict).__name__}")
    seen: set[str] = set()
    for name, tensor in items:
        if not isinstance(name, str):
            return None, (TypeError, f"tensor names must be str; got {type(name).__name__} {name!r}")
        if name in seen:
            return None, (ValueError, f"tensor name {name!r} appears more than once")
        seen.add(name)
        if not isinstance(tensor, torch.Tensor):
            return None, (TypeError, f"{name!r} must be a torch.Tensor; got {type(tensor).__name__}")
        if tensor.layout != torch.strided or tensor.is_quantized:
            return None, (ValueError, f"{name!r} must be a dense tensor; got layout {tensor.layout}{' (quantized)' if tensor.is_quantized else ''}")
    return items, None


def _manifest(items: list[tuple[str, torch.Tensor]], is_source: bool) -> list[Entry]:
    """Names, dtypes and shapes; on the source also which entries are the very same tensor as an earlier one (sent once).

    The very same tensor: same address, dtype, shape, strides and device. Only
    tensors at an address seen before are compared in full.
    """
    first_at: dict[int, int] = {}
    out = []
    for i, (name, t) in enumerate(items):
        alias = -1
        if is_source and t.numel():
            ptr = t.data_ptr()
            first = first_at.setdefault(ptr, i)
            if first != i:  # rare: scan every earlier tensor at this address
                alias = next((j for j in range(first, i) if items[j][1].numel() and same_view(items[j][1], t)), -1)
        dtype = t.dtype
        out.append((name, _DTYPE_NAMES.get(dtype) or _DTYPE_NAMES.setdefault(dtype, str(dtype)), tuple(t.shape), alias))
    return out


def _mismatch(source: list[Entry], mine: list[Entry]) -> str | None:
    """What differs between this rank's tensors and the source's, or ``None``."""
    theirs = {name: (dtype, shape) for name, dtype, shape, _ in source}
    ours = {name: (dtype, shape) for name, dtype, shape, _ in mine}
    lines = []
    missing = [n for n in theirs if n not in ours]
    unexpected = [n for n in ours if n not in theirs]
    differ = [f"{n!r}: source {theirs[n][0]} {list(theirs[n][1])}, here {ours[n][0]} {list(ours[n][1])}" for n in theirs if n in ours and theirs[n] != ours[n]]
    for label, names in (("missing here", missing), ("not on the source", unexpected), ("differ", differ)):
        if names:
            lines.append(f"{len(names)} {label}: {', '.join(map(str, names[:5]))}{', ...' if len(names) > 5 else ''}")
    return "; ".join(lines) or None


def _raise_problems(problems: list[tuple[int, tuple[type[Exception], str] | None]]) -> None:
    found = [(rank, p) for rank, p in problems if p is not None]
    if found:
        detail = "; ".join(f"rank {rank}: {msg}" for rank, (_, msg) in found)
        raise found[0][1][0](f"broadcast_state_dict: nothing was transferred; {detail}")


def _hash(obj: Any) -> tuple[int, int]:
    digest = hashlib.blake2b(repr(obj).encode(), digest_size=16).digest()
    return int.from_bytes(digest[:8], "little", signed=True), int.from_bytes(digest[8:], "little", signed=True)


def _check_arguments(ctx: CommContext, comm: Any, src: Any, bucket_bytes: Any) -> tuple[int | None, _Problem]:
    """The source's global rank (``None`` when it cannot be told), and what is wrong with the arguments."""
    wrong = []
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        wrong.append(f"bucket_bytes must be a positive int; got {bucket_bytes!r}")
    if src is None:
        src = ctx.get_transfer_source(comm.mode)
        if src is None:
            wrong.append(f"src is required: mode {comm.mode!r} was not bound by init_weight_transfer_group, so it has no declared source")
    elif isinstance(src, bool) or not isinstance(src, int) or src not in comm.ranks:
        wrong.append(f"src={src!r} is not a global rank of mode {comm.mode!r}; expected one of {list(comm.ranks)}")
        src = None
    return src, (ValueError, "; ".join(wrong)) if wrong else None


def _agree(ctx: CommContext, comm: Any, state_dict: Any, src: Any, bucket_bytes: Any) -> Pipeline:
    """The handshake: every member ends with the same plan, or raises the same error."""
    src, problem = _check_arguments(ctx, comm, src, bucket_bytes)
    items, bad_input = _named_tensors(state_dict)
    problem = problem or bad_input
    is_source = src == comm.ranks[comm.rank]  # the numbering of src: the world's, or a connected mode's own
    manifest = _manifest(items, is_source) if items is not None else []
    memory = _kept.setdefault(comm, _Kept())
    if memory.unfinished is not None:  # every rank has it, in the same program order: complete it first
        memory.unfinished.finish()
        memory.unfinished = None
    kept = memory.plans.get(src) if src is not None else None
    # With a problem anywhere every member raises before the keys are read.
    tensors_key, plan_key = memory.hashes(manifest, bucket_bytes, is_source) if problem is None else ((0, 0), (0, 0))
    words = [int(problem is not None), -1 if src is None else src, *tensors_key, *plan_key, *(kept[0] if kept else (0, 0)), int(_instrumented(comm))]
    rows = _exchange(comm, words)
    if any(row[0] for row in rows):
        _raise_problems(list(zip(comm.ranks, all_gather_objects(problem, comm.group, comm.device))))
    if len({row[1] for row in rows}) > 1:
        named = ", ".join(f"rank {rank}: {row[1]}" for rank, row in zip(comm.ranks, rows))
        raise ValueError(f"broadcast_state_dict: nothing was transferred; the ranks name different sources ({named}); expected one src on every rank")
    src = rows[0][1]  # every rank reported a valid input and this src
    source = rows[comm.ranks.index(src)]
    same_tensors = all(row[2:4] == source[2:4] for row in rows)
    if same_tensors and kept is not None and all(row[6:8] == source[4:6] for row in rows):
        plan = kept[1]
    else:
        offer = [(manifest, bucket_bytes) if is_source else None]
        comm.broadcast_object_list(offer, src=src)
        if not same_tensors:
            mismatch = None if is_source else _mismatch(offer[0][0], manifest)
            problem = (ValueError, f"these tensors do not match the source's ({mismatch})") if mismatch else None
            _raise_problems(list(zip(comm.ranks, all_gather_objects(problem, comm.group, comm.device))))
        plan = build_plan(*offer[0])
        memory.plans[src] = ((source[4], source[5]), plan)
    by_name = dict(items or ())
    tensors = [by_name[name] for name in plan.names]
    tensors = [t.detach() if t.requires_grad else t for t in tensors]  # the pipeline writes them in place
    sends = point_to_point(comm) and not any(row[8] for row in rows)  # the same choice on every member
    memory.unfinished = Pipeline(comm, plan, tensors, src, is_source, memory.slots, sends)
    return memory.unfinished


def _instrumented(comm: Any) -> bool:
    """Whether stats or debug mode wraps this communicator's ``broadcast`` (an instance attribute over the class's method)."""
    return "broadcast" in vars(comm)


def _exchange(comm: Any, words: list[int]) -> list[list[int]]:
    """Every member's ``words``, in group-rank order, on every member: the handshake's one round.

    Over gloo with host tensors, two hops of point-to-point messages through
    group rank 0 (every other member sends it its words, it sends each of
    them the table), which run in the calling threads. A gloo all-gather hands
    its work to a worker thread and runs a ring: on 3 ranks of this 2-core
    machine it took about twice as long (BENCHMARKS.md). Other backends
    all-gather.
    """
    mine = torch.tensor(words, dtype=torch.int64, device=comm.device)
    rows = torch.empty(comm.world_size, _WORDS, dtype=torch.int64, device=comm.device)
    if not point_to_point(comm):
        comm.all_gather(rows.view(-1), mine)
        return rows.tolist()
    group, peers = comm.group, range(1, comm.world_size)
    try:
        if comm.rank == 0:
            rows[0] = mine
            for work in [group.recv([rows[peer]], peer, _HANDSHAKE_TAG) for peer in peers]:
                work.wait()
            works = [group.send([rows], peer, _HANDSHAKE_TAG) for peer in peers]
        else:
            works = [group.send([mine], 0, _HANDSHAKE_TAG), group.recv([rows], 0, _HANDSHAKE_TAG)]
        for work in works:
            work.wait()
    except RuntimeError as err:
        raise comm._failure("broadcast_state_dict", err) from err
    return rows.tolist()


class StateDictTransfer:
    """The handle ``broadcast_state_dict(..., async_op=True)`` returns; :meth:`wait` completes the transfer."""

    __slots__ = ("_comm", "_pipeline")

    def __init__(self, comm: Any, pipeline: Pipeline) -> None:
        self._comm = comm
        self._pipeline = pipeline

    def is_completed(self) -> bool:
        """Whether the transfer has completed: :meth:`wait` returned, or the next call on this mode completed it first."""
        return self._pipeline.done

    def wait(self) -> None:
        """Launch the transfers still to go, wait for all of them, and (on a destination) write the last tensors; a second call returns at once.

        Raises:
            CommTimeoutError, CommError: as for the communicator's ``broadcast``.
        """
        if not self._pipeline.done:
            with self._comm._exclusive("broadcast_state_dict"):
                self._pipeline.finish()


def broadcast_state_dict(
    state_dict: StateDictLike,
    comm_mode: CommMode | ParallelMode | str = ParallelMode.WEIGHT_TRANSFER,
    src: int | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    async_op: bool = False,
) -> StateDictTransfer | None:
    """Copy every tensor of ``state_dict`` from global rank ``src`` into the same-named tensors of every other rank of ``comm_mode``.

    Every member of the group calls this, the source with the weights to
    send, each destination with tensors of the same names, dtypes and shapes
    to overwrite in place (a module's parameters and buffers, through its
    ``state_dict()``). Destinations end bit-identical to the source, whatever
    the dtypes, strides or storage sharing. The source's tensors are only
    read; non-members return ``None`` at once.

    Before any weight moves, every rank's arguments and tensors are checked
    against the source's manifest (names, dtypes, shapes): a bad argument or a
    mismatch on any member raises the same error on every member, and nothing
    is transferred. Then pieces of at least ``min(bucket_bytes, 256 KiB)``
    travel in place, each on its own with no copy (where contiguous on the
    communicator's device), and smaller ones coalesced into buckets of at most
    ``bucket_bytes``, packing and unpacking overlapped with the transfers. Over
    gloo the source sends each of them to each destination (point to point);
    other backends broadcast them.
    Each rank stages at most two buckets. Tensors the source holds more than
    once (tied weights) travel once.

    Args:
        state_dict: A mapping of names to tensors, an ``nn.Module`` or a list
            of ``(name, tensor)`` pairs. Tensors may live on any device; those
            off the communicator's device are staged through its buckets.
        comm_mode: The mode to broadcast over.
        src: Global rank that sends; ``None`` means the source declared to
            :meth:`CommContext.init_weight_transfer_group` for this mode.
            Every rank must name the same one.
        bucket_bytes: Largest bucket, in bytes; the source's value is used.
        async_op: Return once every transfer that needs no wait is launched
            (all in-place pieces up to the third bucket, the first two buckets),
            with a :class:`StateDictTransfer` whose ``wait()`` does the rest.
            Until ``wait()`` returns, the source may not modify its tensors
            and a destination may neither read nor write them; other
            collectives may run meanwhile (on this mode too, in the same
            order on every rank). The next call on this mode completes an
            unwaited transfer first.

    Returns:
        A :class:`StateDictTransfer` when ``async_op``, else ``None``; ``None`` on a non-member.

    Raises:
        TypeError, ValueError: a bad argument (``src``, ``bucket_bytes``,
            ``state_dict``) or a mismatch on any member, raised on every member.
        ModeNotBoundError: ``comm_mode`` is not bound on this rank.
        CommTimeoutError, CommError: a transfer (a send, receive or broadcast) failed, or a peer never joined.
    """
    comm = CommContext().get_communicator(comm_mode)
    if not comm.is_member:
        return None
    with comm._exclusive("broadcast_state_dict"):
        pipeline = _agree(CommContext(), comm, state_dict, src, bucket_bytes)
        if not async_op:
            pipeline.finish()
            return None
        pipeline.start()
    return StateDictTransfer(comm, pipeline)
