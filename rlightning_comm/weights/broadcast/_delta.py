""":func:`broadcast_state_dict` with ``delta=True``: what the source offers, who decides, and the data phase of a delta.

Before the handshake's one exchange the source encodes its changes since its snapshot (:mod:`._snapshots`), and each
destination states the version its tensors hold: the one it committed, if they still hold the bytes the last sync left,
proven by content (:func:`~..commit._digest.content_key`, one pass over them), whatever touched them since. Their words
(the source's base version and the bytes of its delta, each destination's version) ride on that exchange, so every
member decides the same: a delta when every destination holds the source's base, else a full sync. One decision for all,
since the relay forwards one payload. A delta moves as one byte tensor through the transfer's own pipeline (in place,
relayed, with its receipts), then each destination decodes it and writes the changed words into its tensors (an atomic
destination into its staging, first filled from its live tensors). With ``verify`` the digests are of the whole tensors:
the source's as they are, a destination's once the delta is in. Once the sync succeeded the source's snapshot takes on
the delta (or, after a full sync, the whole tensors) and each destination notes the version its tensors hold.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from rlightning_comm.context import CommContext
from rlightning_comm.errors import CommError
from rlightning_comm.failures import close_gloo_group
from rlightning_comm.weights.broadcast._assemble import staging
from rlightning_comm.weights.broadcast._pipeline import Pipeline
from rlightning_comm.weights.broadcast._plan import Plan, build_plan
from rlightning_comm.weights.commit._digest import Digests, content_key
from rlightning_comm.weights.commit._sync import Sync
from rlightning_comm.weights.commit._versions import SyncOptions
from rlightning_comm.weights.core._checks import same_view
from rlightning_comm.weights.core._staging import dtype_of
from rlightning_comm.weights.delta import _changes, _encoding, _writes
from rlightning_comm.weights.delta._snapshots import Offer, snapshot_for

OP = "broadcast_state_dict"
LOAD_REFUSED = (
    "delta=True cannot go through a load callable: a delta writes the changed elements into the destination's own "
    "tensors in place; pass the tensors (a module or a state dict), or delta=False"
)


def records_of(plan: Plan) -> list[_encoding.Record]:
    """The records of the plan's tensors (every member computes the same): aliases and empty tensors in none."""
    return _encoding.records(
        [(dtype_of(dtype), 0 if alias >= 0 else _numel(shape), None) for _, dtype, shape, alias in plan.manifest]
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _ordered(items: list[tuple[str, torch.Tensor]], plan: Plan) -> list[torch.Tensor]:
    by_name = dict(items)
    return [t.detach() if t.requires_grad else t for t in (by_name[name] for name in plan.names)]


def _views(tensors: list[torch.Tensor]) -> Any:
    return lambda record: [_changes.words(tensors[i]) for i in record.pieces]


def prepare(
    comm: Any,
    memory: Any,
    options: SyncOptions,
    is_source: bool,
    items: list[tuple[str, torch.Tensor]],
    kept_plan: Any,
    plan_key: tuple[int, int],
) -> Offer | None:
    """Before the exchange: the source's offer (its words set on ``options``), or a destination's version (likewise).

    The source offers a delta when its snapshot holds a version of this plan and the delta is smaller than the tensors
    (else its offer holds only the changes, which the snapshot takes on after the full sync).
    """
    if is_source:
        snap = memory.snapshot
        if kept_plan is None or kept_plan[0] != plan_key or snap is None or snap.base(plan_key) < 0:
            return None
        plan = kept_plan[1]
        offer = snap.offer(_views(_ordered(items, plan)), comm.device, plan.total_bytes)
        if offer.payload is not None:
            options.base, options.offer = offer.base, offer.payload.numel()
        return offer
    held = memory.held
    if held is not None and held[0] == CommContext().get_weight_version(options.record_as):
        if held[1] == content_key([t for _, t in items]):
            options.held = held[0]
    return None


def decide(options: SyncOptions, ranks: tuple[int, ...], src: int) -> bool:
    """Whether the sync is a delta: the same answer on every member (every word is every member's)."""
    base, offer = options.bases[src], options.offers[src]
    return options.delta and base >= 0 and offer >= 0 and all(options.helds[r] == base for r in ranks if r != src)


def _inbox(memory: Any, nbytes: int, device: torch.device) -> torch.Tensor:
    """A destination's receive buffer for a delta, kept between calls and grown when too small."""
    box = memory.inbox
    if box is None or box.numel() < nbytes or box.device != device:
        memory.inbox = None
        box = memory.inbox = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    return box[:nbytes]


class _Payload(Pipeline):
    """The pipeline of a delta's bytes: received into a buffer, never into the tensors."""

    def _left(self) -> str:
        units = len(self._plan.units)
        if self._arrived == units:
            return "this destination's delta had arrived; its tensors were not written (it could not be applied)"
        return (
            f"this destination's tensors were not written: its delta had not all arrived ({self._arrived} of {units} "
            "units)"
        )


class DeltaTransfer:
    """A delta's data phase on one member: the payload's pipeline, then (a destination) the decode into its tensors.

    Args:
        comm, src, is_source: The communicator, the source and whether this member is it.
        plan: The sync's plan (of the tensors).
        payload: The delta's bytes (the source's), or the buffer to receive them into.
        targets: This member's tensors in the plan's order (an atomic destination's staging).
        live: An atomic destination's live tensors (the staging is filled from them first), else ``None``.
        memory, sends, route: As for the transfer's :class:`~._pipeline.Pipeline`.
        digests: Fed with the whole tensors (``verify=True``), else ``None``.
    """

    def __init__(
        self,
        comm: Any,
        plan: Plan,
        src: int,
        is_source: bool,
        payload: torch.Tensor,
        targets: list[torch.Tensor],
        live: list[torch.Tensor] | None,
        memory: Any,
        sends: bool,
        route: Any,
        digests: Digests | None,
    ) -> None:
        units = build_plan([("delta", "torch.uint8", (payload.numel(),), -1)], plan.bucket_bytes)
        self._inner = _Payload(comm, units, [payload], src, is_source, memory.slots, sends, memory.mirrors, route)
        self._comm, self._plan, self._is_source = comm, plan, is_source
        self._payload, self._targets, self._live, self._digests = payload, targets, live, digests
        self._records = records_of(plan)
        self._fed = False
        if not is_source:  # written before this member's receipt, which thus says it holds the bytes
            self._inner.before_receipt = self._apply

    def start(self) -> None:
        """Feed the source's digests (on their thread) and launch what the payload's pipeline launches at once."""
        if self._is_source:
            self._feed()
        self._inner.start()

    def finish(self) -> None:
        """Move the rest of the payload; on a destination, decode it and write the changes (before its receipt)."""
        if self._is_source:
            self._feed()
        self._inner.finish()
        if not self._is_source:
            self._feed()

    def _apply(self) -> None:
        """On a destination, once the whole payload arrived: decode it and write the changes."""
        try:
            changes = []
            at = 0
            for record in self._records:
                change, at = _encoding.decode(self._payload, at, record.words, record.word)
                changes.append(change)
        except ValueError as err:  # another sync's bytes, or damaged ones: every peer must learn it at once
            if self._comm.backend == "gloo":
                with contextlib.suppress(Exception):
                    close_gloo_group(self._comm.group)
            raise CommError(
                f"{OP}: the delta could not be read ({err}); this destination's tensors were not written"
            ) from err
        self._write(changes)

    def _write(self, changes: list[_changes.Change]) -> None:
        targets, plan = self._targets, self._plan
        writes = torch.inference_mode if any(t.is_inference() for t in targets) else torch.no_grad
        with writes():
            if self._live is not None:  # the staging starts from the live weights the delta applies to
                for index, (t, live) in enumerate(zip(targets, self._live)):
                    if t.numel() and plan.manifest[index][3] < 0:
                        t.copy_(live)
            into = [_writes.writable(t) for t in targets]
            tied: dict[int, list[int]] = {}
            for index, root in plan.aliases:
                if not same_view(targets[index], targets[root]):
                    tied.setdefault(root, []).append(index)
            for record, change in zip(self._records, changes):
                views = [[_changes.words(into[i]) for i in (p, *tied.get(p, ()))] for p in record.pieces]
                _writes.apply(views, record.sizes, change)
            for t, copy in zip(targets, into):  # a lazy conjugate or negation: written through its values
                if copy is not t:
                    t.copy_(copy)

    def _feed(self) -> None:
        if self._digests is None or self._fed:
            return
        self._fed = True
        for index, (_, dtype, _, alias) in enumerate(self._plan.manifest):
            t = self._targets[index]
            if alias < 0 and t.numel():
                self._digests.update_piece(index, t, (), dtype_of(dtype))


def assemble_delta(
    comm: Any,
    plan: Plan,
    src: int,
    items: list[tuple[str, torch.Tensor]],
    offer: Offer | None,
    sends: bool,
    routes: dict[int, Any] | None,
    options: SyncOptions,
    memory: Any,
    cached: bool,
    rounds: Any,
) -> Sync:
    """This member's :class:`Sync` of a delta (the same plan's tensors, the delta's bytes on the wire)."""
    me, is_source = comm.rank, src == comm._global_rank
    nbytes = options.offers[src]
    into, onto = routes[me] if routes else (None if is_source else comm._group_rank_of[src], [])
    if routes is None and is_source:
        onto = [r for r in range(comm.world_size) if r != me]
    tensors = _ordered(items, plan)
    live = None
    if options.atomic and not is_source:
        live, tensors = tensors, staging(comm, plan, tensors, options.staging_device, comm.device)
    payload = offer.payload if is_source else _inbox(memory, nbytes, comm.device)
    digests = Digests(plan.names, [e[2] for e in plan.manifest], plan.aliases) if options.verify else None
    route = routes[me] if routes else None
    data = DeltaTransfer(comm, plan, src, is_source, payload, tensors, live, memory, sends, route, digests)
    sent = {comm.ranks[r]: nbytes for r in onto}
    received = {} if into is None else {comm.ranks[into]: nbytes}
    held = None if live is None else (live, tensors)
    sync = Sync(comm, data, options, src, sent, received, digests, held, cached, rounds, OP)
    _report(sync, comm, src, "delta", nbytes)
    if is_source:
        snap, changes, version = memory.snapshot, offer.changes, options.version
        sync.succeeded = lambda: _guarded(memory, lambda: snap.advance(changes, version))
    else:
        sync.succeeded = _noting(memory, options, items, sync)
    return sync


def full(
    sync: Sync,
    comm: Any,
    plan: Plan,
    src: int,
    items: Any,
    options: SyncOptions,
    memory: Any,
    key: Any,
    offer: Offer | None,
) -> None:
    """A full sync with ``delta=True``: once it succeeded, the source's snapshot takes on the changes it found (or, with
    none of this plan, a copy of the tensors), a destination notes its version (the next sync can be a delta)."""
    _report(sync, comm, src, "full", plan.total_bytes)
    if src == comm._global_rank:
        tensors, version, snap = _ordered(items, plan), options.version, memory.snapshot

        def take() -> None:
            if offer is not None and snap is memory.snapshot and snap.key == key:
                snap.advance(offer.changes, version)
            else:
                snapshot_for(memory, key, lambda: records_of(plan)).take(_views(tensors), version)

        sync.succeeded = lambda: _guarded(memory, take)
    else:
        sync.succeeded = _noting(memory, options, items, sync)


def _report(sync: Sync, comm: Any, src: int, kind: str, nbytes: int) -> None:
    report = sync._report
    report.kinds = {r: kind for r in comm.ranks if r != src}
    report.delivered = {r: nbytes for r in comm.ranks if r != src}


def _noting(memory: Any, options: SyncOptions, items: Any, sync: Sync) -> Any:
    """Once the sync succeeded: a destination notes the version its tensors hold and their content key (from the
    digests a verified sync computed as the bytes passed; else one pass over them)."""

    def note() -> None:
        found = sync._report.digests if sync._report is not None else {}
        digests = [found.get(name) for name, _ in items]
        known = digests if found and None not in digests else None
        memory.held = (options.version, content_key([t for _, t in items], known))

    return note


def _guarded(memory: Any, keep: Any) -> None:
    """``keep()``; if it fails, nothing kept for deltas is trusted any more (the next sync is full)."""
    try:
        keep()
    except BaseException:
        memory.drop_delta()
        raise
