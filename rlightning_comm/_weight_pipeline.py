"""The data phase of :func:`broadcast_state_dict`: a plan of transfers built from the manifest, and the pipeline that runs it.

The plan is a pure function of the source's manifest and bucket size, so every
rank builds the same one and issues the same transfers in the same order.
Each tensor is cut, along its leading dimensions, into pieces of at most one
bucket. A piece of at least ``min(bucket, DIRECT_BYTES)`` is a unit of its
own, received in place (no copy) wherever it is contiguous on the
communicator's device; smaller pieces are coalesced into buckets. Two bucket
buffers per rank rotate: packing (or unpacking) one bucket overlaps the
transfer of the other, and in-place transfers run meanwhile.

How a unit moves depends on the backend. Over gloo the source sends it to
each destination point to point (``ProcessGroup.send`` / ``recv``, one tag
for the whole transfer, matched in order per pair): a gloo broadcast hands
every call to a worker thread and costs about 0.3 ms of CPU per call on each
rank, which dominated the transfer of a model of many tensors, while a send
starts in the calling thread. A 3-rank broadcast of a model of 121 tensors
took 0.5x the speed of one broadcast of the same bytes as broadcasts, about
0.8x as sends (``benchmarks/bench_weight_transfer.py``). Any other backend
broadcasts each unit (NCCL's broadcast is pipelined on the device), and so
does gloo when stats or debug mode instruments the communicator's
``broadcast`` on any member (the handshake tells every rank): then every unit
is counted and fingerprinted like any broadcast.

Over gloo each destination also tells the source, with one small message,
once it has posted every receive it can without waiting, and a blocking
transfer's source sends nothing before every destination has. gloo writes a
message from the sender's calling thread when the receive is already
posted, and otherwise from its event-loop thread once told of it, a hand-off
per message: with the receives posted first the same sends took 4 to 8%
less CPU and about 5% less time here (BENCHMARKS.md). Each rank then waits
for its last unit first: a pair's messages complete in order, so the
waiting thread wakes once rather than once per unit.

Over gloo the source never waits for a send before the destination has
said it received it: each destination sends a receipt (one small message)
when a bucket's receive completes and once the whole transfer has arrived,
and the source waits for the receipts before the sends (which have then
completed). gloo does not fail a send whose receiver died after posting the
receive: each such send waits out the group's timeout, one after the other,
while a receive from a dead peer fails at once. So a destination's death
fails the source's transfer within milliseconds, for two small messages per
destination per transfer (and one per bucket buffer reused).
"""

from __future__ import annotations

import ctypes
import math
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

DIRECT_BYTES = 256 * 2**10
"""Pieces of at least this many bytes (or of a whole bucket, if smaller) travel in place; the rest are coalesced."""

_ALIGN = 16  # every piece starts on a multiple of the largest element size, so a bucket slice views as any dtype
_TAG = 0x5754  # the point-to-point tag of every unit ("WT"); other traffic on the group is told apart by its own tags

# One manifest entry: name, dtype name, shape, and the index of an earlier entry that is the very same tensor on the source (-1: none).
Entry = tuple[str, str, tuple[int, ...], int]


class Piece(NamedTuple):
    """``tensors[index][where]`` (``where == ()``: the whole tensor), at byte ``at`` of its unit."""

    index: int
    where: tuple[Any, ...]
    at: int
    nbytes: int


class Unit(NamedTuple):
    """One transfer (a broadcast, or a send to each destination over gloo): a single piece that may travel in place (``direct``), or a bucket of coalesced pieces."""

    pieces: tuple[Piece, ...]
    nbytes: int
    direct: bool


class Plan(NamedTuple):
    """Every unit of one transfer, in order, and what to copy afterwards on a destination."""

    names: tuple[str, ...]
    units: tuple[Unit, ...]
    aliases: tuple[tuple[int, int], ...]  # (index, index of the source tensor it is)
    slot_bytes: int  # the largest bucket: the size of a staging buffer (grown for a staged in-place piece)
    total_bytes: int


def point_to_point(comm: Any) -> bool:
    """Whether a transfer on ``comm`` moves its data (and its handshake) point to point: gloo on host tensors (gloo's send reads host memory only)."""
    return comm.backend == "gloo" and comm.device.type == "cpu"


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _pieces(shape: tuple[int, ...], limit: int, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], int]]:
    """``(index, numel)`` of views that cover a tensor of ``shape`` in order, each of at most ``limit`` elements (or one element)."""
    numel = math.prod(shape)
    if numel <= limit:
        yield prefix, numel
        return
    row = math.prod(shape[1:])
    if row <= limit:
        step = limit // row
        for lo in range(0, shape[0], step):
            hi = min(lo + step, shape[0])
            yield (*prefix, slice(lo, hi)), (hi - lo) * row
    else:
        for i in range(shape[0]):
            yield from _pieces(shape[1:], limit, (*prefix, i))


def build_plan(manifest: list[Entry], bucket_bytes: int) -> Plan:
    """The broadcasts that move every tensor of ``manifest`` (the source's order), with buckets of at most ``bucket_bytes``."""
    direct_bytes = min(bucket_bytes, DIRECT_BYTES)
    units: list[Unit] = []
    open_: list[Piece] = []
    fill = 0
    aliases = []
    for index, (_, dtype, shape, alias) in enumerate(manifest):
        if alias >= 0:
            aliases.append((index, alias))
            continue
        size = _dtype(dtype).itemsize
        for where, numel in _pieces(shape, max(1, bucket_bytes // size)):
            nbytes = numel * size
            if nbytes == 0:
                continue
            if nbytes >= direct_bytes:
                units.append(Unit((Piece(index, where, 0, nbytes),), nbytes, True))
                continue
            at = -(-fill // _ALIGN) * _ALIGN
            if at + nbytes > bucket_bytes:
                units.append(Unit(tuple(open_), fill, False))
                open_, at = [], 0
            open_.append(Piece(index, where, at, nbytes))
            fill = at + nbytes
    if open_:
        units.append(Unit(tuple(open_), fill, False))
    slot = max((u.nbytes for u in units if not u.direct), default=0)
    total = sum(p.nbytes for u in units for p in u.pieces)
    return Plan(tuple(e[0] for e in manifest), tuple(units), tuple(aliases), slot, total)


def _view(tensor: torch.Tensor, where: tuple[Any, ...]) -> torch.Tensor:
    return tensor[where] if where else tensor


def _typed(buffer: torch.Tensor, piece: Piece, like: torch.Tensor) -> torch.Tensor:
    """The bytes of ``piece`` in ``buffer``, viewed with ``like``'s dtype and shape."""
    return buffer[piece.at : piece.at + piece.nbytes].view(like.dtype).view(like.shape)


class Pipeline:
    """Runs a :class:`Plan` on one rank: :meth:`start` launches what it can without waiting, :meth:`finish` the rest.

    Args:
        comm: The communicator: its ``broadcast``, or its process group's
            ``send``/``recv`` (``sends``), carries every unit.
        plan: The transfer's plan (the same on every rank).
        tensors: This rank's tensors, in the plan's order.
        src: Global rank of the source.
        is_source: Whether this rank sends.
        slots: The two staging buffers, kept across calls (fresh pages cost
            more to fault in than the copy into them); grown here when too small.
        sends: Move the units point to point (gloo on host memory, the same on
            every member) rather than by the communicator's ``broadcast``.
    """

    def __init__(self, comm: Any, plan: Plan, tensors: list[torch.Tensor], src: int, is_source: bool, slots: list[torch.Tensor | None], sends: bool) -> None:
        self._comm = comm
        self._plan = plan
        self._tensors: list[torch.Tensor] | None = tensors
        self._src = src
        self._is_source = is_source
        self._device = comm.device
        self._slots = slots
        self._next_slot = 0
        self._next_unit = 0
        # (works, slot or -1, unit, the staging bytes or None) in launch order.
        self._pending: deque[tuple[list[Any], int, Unit, torch.Tensor | None]] = deque()
        self._sends = sends
        src_rank = comm._group_rank_of[src]
        self._src_rank = src_rank
        self._peers = [r for r in range(comm.world_size) if r != src_rank]
        # Over gloo: on the source, the receives of every destination's "posted" message; on a destination, its sends of
        # that message and of its receipts (once made).
        self._posted: list[Any] | None = None
        if self._sends and is_source:
            self._posted = self._tokens()

    def _tokens(self) -> list[Any]:
        """On the source over gloo: the receives of one small message from every destination (its "posted" message or a receipt)."""
        group, tokens = self._comm.group, torch.empty(len(self._peers), dtype=torch.uint8)
        return self._point_to_point(lambda: [group.recv([tokens[i : i + 1]], peer, _TAG) for i, peer in enumerate(self._peers)])

    def _point_to_point(self, post: Any) -> list[Any]:
        """The library's handles of the sends or receives ``post()`` makes on the group."""
        comm = self._comm
        try:
            works = post()
        except RuntimeError as err:
            raise comm._failure("broadcast_state_dict", err) from err
        return [comm._handle(work, "broadcast_state_dict") for work in works]

    def _tell_source(self) -> None:
        """On a destination over gloo, once: tell the source every receive that needs no wait is posted."""
        if self._sends and not self._is_source and self._posted is None:
            self._posted = self._token()

    def _token(self) -> list[Any]:
        """On a destination over gloo: the send of one small message to the source."""
        group, src = self._comm.group, self._src_rank
        return self._point_to_point(lambda: [group.send([torch.zeros(1, dtype=torch.uint8)], src, _TAG)])

    def _move(self, data: torch.Tensor) -> list[Any]:
        """Start moving ``data`` from the source to every destination; the handles to wait for."""
        comm = self._comm
        if not self._sends:
            return [comm.broadcast(data, src=self._src, async_op=True)]
        group = comm.group
        if self._is_source:
            return self._point_to_point(lambda: [group.send([data], peer, _TAG) for peer in self._peers])
        return self._point_to_point(lambda: [group.recv([data], self._src_rank, _TAG)])

    def _in_place(self, unit: Unit) -> torch.Tensor | None:
        """The piece's own memory when it can be moved without a copy here (contiguous, on the communicator's device).

        A send moves bytes whatever the dtype, so over gloo the piece goes as it
        is; a broadcast gets its bytes (``uint8``), which any backend takes.
        """
        if not unit.direct:
            return None
        piece = unit.pieces[0]
        view = _view(self._tensors[piece.index], piece.where)
        if self._sends:
            return view if view.is_cpu and view.is_contiguous() else None
        if view.device != self._device or not view.is_contiguous():
            return None
        return view.reshape(-1).view(torch.uint8)

    def _stage(self, staged: torch.Tensor, unit: Unit, pack: bool) -> None:
        """Copy every piece of ``unit`` into ``staged`` (``pack``) or out of it.

        Between contiguous host bytes a plain single-threaded ``memmove`` on
        the pieces' addresses, with no tensor made per piece: torch's
        ``copy_`` would split a large copy over its intra-op threads, which on
        a host whose cores are all busy (the ranks of one machine, each with
        its own thread pool) costs several times a plain copy, and making two
        views per piece cost as much as copying a small one.
        """
        base = staged.data_ptr() if staged.is_cpu else None
        for piece in unit.pieces:
            view = _view(self._tensors[piece.index], piece.where)
            if base is not None and view.is_cpu and view.is_contiguous():
                bucket, own = base + piece.at, view.data_ptr()
                to, from_ = (bucket, own) if pack else (own, bucket)
                ctypes.memmove(to, from_, piece.nbytes)
            elif pack:
                _typed(staged, piece, view).copy_(view)
            else:
                view.copy_(_typed(staged, piece, view))

    def _slot(self, nbytes: int, block: bool) -> torch.Tensor | None:
        """A free staging buffer's first ``nbytes`` bytes; waits for the older unit that holds it unless not ``block``."""
        slot = self._next_slot
        while any(entry[1] == slot for entry in self._pending):
            if not block:
                return None
            self._complete(self._pending.popleft())
        buffer = self._slots[slot]
        if buffer is None or buffer.numel() < nbytes:
            self._slots[slot] = None  # free the old one first
            buffer = self._slots[slot] = torch.empty(max(nbytes, self._plan.slot_bytes), dtype=torch.uint8, device=self._device)
        self._next_slot = 1 - slot
        return buffer[:nbytes]

    def _complete(self, entry: tuple[list[Any], int, Unit, torch.Tensor | None]) -> None:
        works, _, unit, staged = entry
        for work in works:  # on the source over gloo a bucket's receipts come first: see _step
            work.wait()
        if staged is not None and not self._is_source:
            if self._sends:
                self._posted += self._token()  # the bucket's receipt: the source may reuse its buffer
            self._stage(staged, unit, pack=False)

    def _step(self, block: bool) -> bool:
        """Launch the next unit; ``False`` when it needs a busy buffer and ``block`` is off, or when none is left."""
        if self._next_unit == len(self._plan.units):
            return False
        unit = self._plan.units[self._next_unit]
        data = self._in_place(unit)
        staged = None
        if data is None:
            staged = self._slot(unit.nbytes, block)
            if staged is None:
                return False
            if self._is_source:
                self._stage(staged, unit, pack=True)
            data = staged
        works = self._move(data)
        if staged is not None and self._sends and self._is_source:
            works = self._tokens() + works  # the destinations' receipts, waited before the sends: see the module's docstring
        self._pending.append((works, -1 if staged is None else 1 - self._next_slot, unit, staged))
        self._next_unit += 1
        return True

    def start(self) -> None:
        """Launch every unit that needs no wait: all in-place pieces up to the third bucket, and the first two buckets."""
        while self._step(block=False):
            pass
        self._tell_source()

    @property
    def done(self) -> bool:
        """Whether :meth:`finish` has returned."""
        return self._tensors is None

    def finish(self) -> None:
        """Launch the rest, wait for everything, unpack on a destination and fill the aliases; then nothing (a second call returns at once)."""
        if self._tensors is None:
            return
        if self._is_source and self._posted:
            posted, self._posted = self._posted, []  # each gloo point-to-point work is waited once, even if one raises
            for work in posted:  # every destination's receives are posted: gloo writes each send from this thread
                work.wait()
        self.start()  # a destination tells the source before it waits for anything
        while self._step(block=True):
            pass
        if self._sends and self._is_source:
            for work in self._tokens():  # every destination's receipt of the whole transfer: then every send has completed
                work.wait()
        elif self._pending:
            # Wait for the last unit first: a pair's messages complete in order, so the others are done by then and
            # this thread wakes once, not once per unit (gloo's point-to-point work must be waited exactly once).
            works, *rest = self._pending[-1]
            self._pending[-1] = ([], *rest)
            for work in works:
                work.wait()
        while self._pending:
            self._complete(self._pending.popleft())
        if self._sends and not self._is_source:
            self._posted += self._token()  # the receipt of the whole transfer
        posted, self._posted = self._posted or [], []
        for work in posted:
            work.wait()
        if not self._is_source:
            for index, alias in self._plan.aliases:
                mine, theirs = self._tensors[index], self._tensors[alias]
                if not same_view(mine, theirs):
                    mine.copy_(theirs)
        self._tensors = None  # drop the references


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the very same view: address, dtype, shape, strides and device."""
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and a.device == b.device
