"""How one rank moves the units of a weight-transfer plan, and what it says when a transfer fails midway.

How a unit moves depends on the backend. Over gloo the source sends it to each destination point to point
(``ProcessGroup.send`` / ``recv``, one tag for the whole transfer, matched in order per pair): a gloo broadcast hands
every call to a worker thread and costs about 0.3 ms of CPU per call on each rank, which dominated the transfer of a
model of many tensors, while a send starts in the calling thread. A 3-rank broadcast of a model of 121 tensors took 0.5x
the speed of one broadcast of the same bytes as broadcasts, about 0.8x as sends
(``benchmarks/bench_weight_transfer.py``). Any other backend broadcasts each unit (NCCL's broadcast is pipelined on the
device), and so does gloo when stats or debug mode instruments the communicator's ``broadcast`` on any member (the
handshake tells every rank): then every unit is counted and fingerprinted like any broadcast.

Over gloo each destination also tells the source, with one small message, once it has posted every receive it can
without waiting, and a blocking transfer's source sends nothing before every destination has. gloo writes a message from
the sender's calling thread when the receive is already posted, and otherwise from its event-loop thread once told of
it, a hand-off per message: with the receives posted first the same sends took 4 to 8% less CPU and about 5% less time
here (BENCHMARKS.md). Each rank then waits for its last unit first: a pair's messages complete in order, so the waiting
thread wakes once rather than once per unit.

Over gloo the source never waits for a send before the destination has said it received it: each destination sends a
receipt (one small message) when a bucket's receive completes and once the whole transfer has arrived, and the source
waits for the receipts before the sends (which have then completed). gloo does not fail a send whose receiver died after
posting the receive: each such send waits out the group's timeout, one after the other, while a receive from a dead peer
fails at once. So a destination's death fails the source's transfer within milliseconds, for two small messages per
destination per transfer and one per bucket (an in-place piece the source itself had to stage, a strided or device
tensor there, has no receipt: its sends are waited as they are). The source then closes the group's connections
(:func:`~rlightning_comm.failures.close_gloo_group`), so the other destinations' receives fail within milliseconds as
well.

In a relay (:func:`chain`) the source sends each unit once, to the first destination, and each destination forwards it
to the next once it has arrived (a bucket from its staging buffer while it unpacks it, an in-place piece from the tensor
itself). Every hop is a source-destination pair as
above: the "posted" message, a receipt per bucket before the sender reuses
its buffer, one for the whole transfer; a relay waits for a bucket's forward before it frees the buffer, and takes its
units in order (a relay forwards unit k only once its successor has taken unit k - 2). A relay sends its receipt of the
whole transfer only once its successor's has come (and its forwards have completed), so the receipts travel back up the
chain and the source's one receipt says that every member of it has everything: the source never returns while a member
further down is lost (one small message per hop, back to back, at the end). Any member of a chain that fails closes the
group's connections, so everything downstream and upstream of it fails at once too.

A transfer that fails midway raises the failure (``CommError`` or ``CommTimeoutError``) with what this rank knows about
the weights it left: on a destination whether its tensors were partly written (and how many buckets a ``load`` callable
had been given), on the source which destinations may hold partial weights.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from rlightning_comm.errors import CommError
from rlightning_comm.failures import LAUNCH_ERRORS, await_work, close_gloo_group
from rlightning_comm.weights.broadcast._plan import Plan

_TAG = 0x5754  # the point-to-point tag of every unit ("WT"); other traffic on the group is told apart by its own tags
CUT_BYTES = 512 << 10
"""In a relay, the largest message a unit travels as: a relay forwards each such run of its bytes as soon as it has
arrived, so a hop adds the time of one run, not of a whole unit (an 8 MiB embedding, a 64 MiB bucket)."""


def chain(world_size: int, src: int, leaves: set[int]) -> dict[int, tuple[int | None, list[int]]]:
    """Every group rank's route in a relay: ``(predecessor or None, successors)``.

    The source sends each unit once, to the first destination (and to each of ``leaves``, destinations that cannot
    forward); each destination of the chain forwards it to the next, in group-rank order after the source's.
    """
    order = [r for r in [*range(src + 1, world_size), *range(src)] if r not in leaves]
    routes: dict[int, tuple[int | None, list[int]]] = {src: (None, order[:1] + sorted(leaves))}
    for i, rank in enumerate(order):
        routes[rank] = (order[i - 1] if i else src, order[i + 1 : i + 2])
    routes.update((leaf, (src, [])) for leaf in leaves)
    return routes


class Transfer:
    """Moves the units of a :class:`Plan` on one rank; what a destination does with them is the subclass's.

    :meth:`start` launches what needs no wait, :meth:`finish` the rest; a failure in either raises the backend's error
    with this rank's account of the weights it left (see the module docstring), and ends the transfer.

    Args:
        comm: The communicator: its ``broadcast``, or its process group's ``send``/``recv`` (``sends``), carries every
            unit.
        plan: The transfer's plan (the same on every rank).
        src: Rank of the source, in the mode's numbering.
        is_source: Whether this rank sends.
        slots: The two staging buffers, kept across calls (fresh pages cost more to fault in than the copy into them);
            grown when too small, dropped after a failure (a receive still posted may write them).
        sends: Move the units point to point (gloo on host memory, the same on every member) rather than by the
            communicator's ``broadcast``.
        route: With ``sends``, where this rank receives from and sends to (group ranks: the predecessor or ``None`` on
            the source, and the successors); ``None``: a star, the source sending to every destination.
    """

    def __init__(
        self,
        comm: Any,
        plan: Plan,
        src: int,
        is_source: bool,
        slots: list[torch.Tensor | None],
        sends: bool,
        route: tuple[int | None, list[int]] | None = None,
    ) -> None:
        self._comm = comm
        self._plan = plan
        self._src = src
        self._is_source = is_source
        self._device = comm.device
        self._slots = slots
        self._sends = sends
        self._done = False
        self._launched = 0  # units launched on this rank
        self._failed_peer: int | None = None  # on the source: the destination whose transfer raised, where known
        # (works, slot or -1, unit index, the staging bytes or None) in launch order.
        self._pending: deque[tuple[list[Any], int, int, torch.Tensor | None]] = deque()
        src_rank = comm._group_rank_of[src]
        self._src_rank = src_rank
        self._dsts = [r for r in range(comm.world_size) if r != src_rank]
        self._relay = route is not None and sends
        if self._relay:
            self._from, self._peers = route
        else:
            self._from, self._peers = (None, self._dsts) if is_source else (src_rank, [])
        self._forwards: list[Any] = []  # on a relay: the sends of the in-place pieces it forwarded, waited at the end
        # Over gloo: the receives of every successor's "posted" message (on the source, every destination's); the sends
        # of this rank's "posted" message and of its receipts to its predecessor (once made).
        self._inbox: list[Any] = self._tokens() if self._sends and self._peers else []
        self._outbox: list[Any] = []
        # On a destination: what it must do with the bytes before its receipt of the whole transfer goes out (a delta's
        # writes), so that a source's return means every destination holds the bytes, as on the plain path.
        self.before_receipt: Any = None
        self._told = False

    def _tokens(self) -> list[Any]:
        """On the source over gloo: the receives of one small message from every destination (its "posted" message or a
        receipt)."""
        group, tokens = self._comm.group, torch.empty(len(self._peers), dtype=torch.uint8)
        return self._point_to_point(
            lambda: [group.recv([tokens[i : i + 1]], peer, _TAG) for i, peer in enumerate(self._peers)]
        )

    def _token(self) -> list[Any]:
        """On a destination over gloo: the send of one small message to its predecessor (the source in a star)."""
        group, src = self._comm.group, self._from
        return self._point_to_point(lambda: [group.send([torch.zeros(1, dtype=torch.uint8)], src, _TAG)])

    @property
    def done(self) -> bool:
        """Whether :meth:`finish` has returned or raised."""
        return self._done

    def start(self) -> None:
        """Launch every unit that needs no wait."""
        self._guarded(self._start)

    def finish(self) -> None:
        """Launch the rest and wait for everything; then nothing (a second call returns at once, even after an
        error)."""
        if self._done:
            return
        try:
            self._guarded(self._finish)
        finally:
            self._done = True

    def _start(self) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def _left(self) -> str:
        """On a destination: what a failure leaves in its tensors (one sentence)."""
        raise NotImplementedError

    def _guarded(self, run: Any) -> None:
        try:
            run()
        except CommError as err:
            self._done = True
            self._slots[0] = self._slots[1] = None
            if self._relay or (self._sends and self._is_source and self._failed_peer is not None):
                # A destination is lost: the others would wait out the timeout on receives the source will never send.
                # In a chain every member closes: its successors wait on it, its predecessor on its receipts.
                close_gloo_group(self._comm.group)
            # The same type with the account added, its other arguments kept (PeerLostError's mode, generation, member).
            raise type(err)(f"{err}\nbroadcast_state_dict failed midway: {self._account()}", *err.args[1:]) from err

    def _account(self) -> str:
        units = len(self._plan.units)
        if not self._is_source:
            return self._left()
        ranks, peer = self._comm.ranks, self._failed_peer
        where = "" if peer is None else f"the transfer to rank {ranks[peer]} failed; "
        if peer is not None and self._relay and peer == self._peers[0]:
            # Its receipt of the whole transfer is the rest of the chain's: the one lost may be further down.
            where = (
                f"the transfer to rank {ranks[peer]} failed (the first of the relay: it or a member after it was "
                "lost); "
            )
        if not self._launched:
            return f"{where}the source had sent nothing (0 of {units} units): no destination was written"
        dsts = [ranks[r] for r in self._dsts]
        return (
            f"{where}the source had launched {self._launched} of {units} units: destinations at ranks {dsts} may hold "
            "partial weights"
        )

    def _point_to_point(self, post: Any) -> list[Any]:
        """The library's handles of the sends or receives ``post()`` makes on the group."""
        comm = self._comm
        try:
            works = post()
        except LAUNCH_ERRORS as err:
            raise comm._failure("broadcast_state_dict", err) from err
        return [comm._handle(work, "broadcast_state_dict") for work in works]

    def _tell_source(self) -> None:
        """On a destination over gloo, once: tell its predecessor every receive that needs no wait is posted."""
        if self._sends and self._from is not None and not self._told:
            self._told = True
            self._outbox += self._token()

    def _received(self, unit: int) -> None:
        """On a destination over gloo, once unit ``unit`` has arrived: a bucket's receipt, so its predecessor may reuse
        its buffer."""
        if self._sends and self._from is not None and not self._plan.units[unit].direct:
            self._outbox += self._token()

    def _chunks(self, data: torch.Tensor) -> list[torch.Tensor]:
        """The messages ``data`` travels as: in a relay, runs of at most :data:`CUT_BYTES` of its bytes (a relay
        forwards each as soon as it has arrived); else ``data`` whole. Every member of a transfer cuts alike."""
        nbytes = data.numel() * data.element_size()
        if not self._relay or nbytes <= CUT_BYTES:
            return [data]
        flat = data.reshape(-1).view(torch.uint8)
        return [flat[at : at + CUT_BYTES] for at in range(0, nbytes, CUT_BYTES)]

    def _send_all(self, chunks: list[torch.Tensor]) -> list[Any]:
        """Send every chunk to every successor (chunk by chunk); the library's handles, one per chunk and peer."""
        comm, group, works = self._comm, self._comm.group, []
        for chunk in chunks:
            for peer in self._peers:
                try:
                    works.append(comm._handle(group.send([chunk], peer, _TAG), "broadcast_state_dict"))
                except LAUNCH_ERRORS as err:  # a pair already closed: that successor is gone
                    self._failed_peer = peer
                    raise comm._failure("broadcast_state_dict", err) from err
        return works

    def _forward(self, received: list[Any], data: torch.Tensor, unit: int) -> list[Any]:
        """On a relay: wait for unit ``unit``'s chunks to arrive in ``data`` (``received``: their receives), sending
        each on to the successors as soon as it is here (cut-through: the chain adds a chunk per hop, not a unit); the
        handles to wait for (a bucket's receipts first, as on the source)."""
        works = []
        for chunk, work in zip(self._chunks(data), received):
            self._wait([work])
            works += self._send_all([chunk])
        return works if self._plan.units[unit].direct else self._tokens() + works

    def _move(self, data: torch.Tensor) -> list[Any]:
        """Start moving ``data`` from the source to every destination; the handles to wait for (on the source over gloo,
        one per destination and chunk, in order)."""
        comm = self._comm
        if not self._sends:
            return [comm.broadcast(data, src=self._src, async_op=True)]
        group, chunks = comm.group, self._chunks(data)
        if self._from is not None:
            return self._point_to_point(lambda: [group.recv([c], self._from, _TAG) for c in chunks])
        return self._send_all(chunks)

    def _launch(self, data: torch.Tensor, slot: int, unit: int, staged: torch.Tensor | None) -> None:
        works = self._move(data)
        if self._sends and self._from is None and not self._plan.units[unit].direct:
            works = self._tokens() + works  # the destinations' receipts of this bucket, waited before its sends
        self._pending.append((works, slot, unit, staged))
        self._launched += 1

    def _wait(self, works: list[Any], sent: bool | None = None) -> None:
        """Wait for ``works``: a unit's receive, or (``sent``; by default on the source) its receipts and sends."""
        sent = self._from is None if sent is None else sent
        for k, work in enumerate(works):
            try:
                await_work(self._comm, work, "broadcast_state_dict")
            except CommError:
                if self._sends and sent and self._peers:
                    self._failed_peer = self._peers[
                        k % len(self._peers)
                    ]  # a bucket's receipts, then its sends: one per destination each
                raise

    def _wait_source_posted(self) -> None:
        """On the source over gloo: wait until every destination's receives are posted (gloo then writes each send from
        this thread)."""
        if self._inbox:
            posted, self._inbox = self._inbox, []  # each gloo point-to-point work is waited once, even if one raises
            for k, work in enumerate(posted):
                try:
                    work.wait()
                except CommError:
                    self._failed_peer = self._peers[k]
                    raise

    def _drain(self, complete: Any) -> None:
        """Wait for every pending unit, calling ``complete(entry)`` on each in order; then the "posted" messages and
        receipts.

        On the source over gloo every destination's receipt of the whole transfer comes first (every send has completed
        then); elsewhere the last unit does.
        """
        if self._sends and self._from is None:
            self._wait(self._tokens())
        elif self._pending and not self._relay:
            # (Not in a chain: a relay forwards unit k only once its successor took unit k - 2 off its hands, in order.)
            # A bucket's receipt goes out as soon as the bucket has arrived: the source may need it to reuse its buffer
            # before it sends the rest (it stages a tensor that is not contiguous there, in place here).
            units = self._plan.units
            owed = [k for k, entry in enumerate(self._pending) if self._sends and not units[entry[2]].direct]
            for _ in range(owed[-1] + 1 if owed else 0):
                complete(self._pending.popleft())
        if self._pending and not self._relay and not (self._sends and self._from is None):
            # Then wait for the last unit first: a pair's messages complete in order, so the others are done by then and
            # this thread wakes once, not once per unit (gloo's point-to-point work must be waited exactly once).
            works, *rest = self._pending[-1]
            self._pending[-1] = ([], *rest)
            self._wait(works)
        while self._pending:
            complete(self._pending.popleft())
        if self.before_receipt is not None:
            self.before_receipt()  # a destination's own work on what arrived: done before it says it holds it
        downstream = self._relay and self._peers and self._from is not None
        if downstream:
            self._wait_downstream()  # before this member's receipt, which thus says everyone after it has everything
        if self._sends and self._from is not None:
            self._outbox += self._token()  # the receipt of the whole transfer (in a chain: of the rest of the chain's)
        posted, self._outbox = self._outbox, []
        for work in posted:
            work.wait()

    def _wait_downstream(self) -> None:
        """On a relay: wait for its successors' receipts of the whole transfer, then for the in-place pieces it
        forwarded to them."""
        forwards, self._forwards = self._forwards, []
        self._wait(self._tokens() + [work for works in forwards for work in works], sent=True)
