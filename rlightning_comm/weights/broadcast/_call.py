"""Broadcast a model's weights from one rank to the others at the wire's speed, loading them in place or through a
``load`` callable.

A call first agrees on what moves (:mod:`._weight_handshake`: every rank's verdict on its own arguments and tensors, in
one small exchange), then moves it (:mod:`._weight_plan` cuts the tensors into units, :mod:`._weight_transport` moves
them, :mod:`._weight_pipeline` reads and writes tensors in place, :mod:`._weight_loader` hands a destination's buckets
to its ``load`` callable). A problem anywhere raises the same error on every member, before any weight moves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from rlightning_comm.context import CommContext
from rlightning_comm.errors import CommError
from rlightning_comm.modes import CommMode, ParallelMode
from rlightning_comm.weights.broadcast._handshake import agree
from rlightning_comm.weights.broadcast._inputs import named_tensors
from rlightning_comm.weights.commit._report import WeightSyncReport
from rlightning_comm.weights.commit._versions import SyncOptions
from rlightning_comm.weights.core._memory import forget, kept
from rlightning_comm.weights.core._publish import StateDictTransfer, captures, drain
from rlightning_comm.weights.core._wire import mode_store

DEFAULT_BUCKET_BYTES = 64 * 2**20
OP = "broadcast_state_dict"

StateDictLike = (
    Mapping[str, torch.Tensor]
    | nn.Module
    | Sequence[tuple[str, torch.Tensor]]
    | Callable[[Iterable[tuple[str, torch.Tensor]]], Any]
)


def broadcast_state_dict(
    state_dict: StateDictLike,
    comm_mode: CommMode | ParallelMode | str = ParallelMode.WEIGHT_TRANSFER,
    src: int | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    async_op: bool = False,
    *,
    version: int | Literal["any"] | None = None,
    verify: bool = False,
    atomic: bool = False,
    staging_device: torch.device | str | None = None,
    record_as: CommMode | ParallelMode | str | None = None,
    fanout: str | None = None,
    delta: bool = False,
) -> WeightSyncReport | StateDictTransfer | None:
    """Copy every tensor of ``state_dict`` from rank ``src`` into the same-named tensors of every other rank of
    ``comm_mode``.

    Every member of the group calls this, the source with the weights to send, each destination with tensors of the same
    names, dtypes and shapes to overwrite in place (a module's parameters and buffers, through its ``state_dict()``), or
    with a ``load`` callable. Destinations end bit-identical to the source's logical values, whatever the dtypes,
    strides, storage sharing or conjugate and negative views. The source's tensors are only read; non-members return
    ``None`` at once.

    Before any weight moves, every rank's arguments and tensors are checked, and checked against the source's manifest
    (names, dtypes, shapes): a bad argument, a mismatch, or a tensor a rank cannot use (nested, meta, on a device it
    cannot reach; on a destination an expanded or zero-stride view, or tensors sharing memory that the source does not
    hold as one tied tensor) on any member raises the same error on every member, nothing is transferred, and the group
    stays usable. Then pieces of at least ``min(bucket_bytes, 256 KiB)`` travel in place, each on its own with no copy
    (where contiguous on the communicator's device), and smaller ones coalesced into buckets of at most
    ``bucket_bytes``, packing and unpacking overlapped with the transfers. Over gloo the source sends each of them to
    each destination (point to point); other backends broadcast them. Each rank stages at most two buckets. Tensors the
    source holds more than once (tied weights) travel once. With two or more destinations that can forward
    (``fanout="chain"``, the default point to point), the source sends each piece once, to the first destination, and
    each destination forwards it to the next while it receives the following one; the receipts travel back up the
    chain, so the source returns only once every destination holds everything, as with the star.

    With ``version``, a destination records the version it committed (:meth:`CommContext.get_weight_version`), and a
    sync is refused on every member before any byte moves when a destination has committed this version or a later one,
    or when the source itself holds another version (an engine seeding a newcomer sends the version it holds). With
    ``verify``, every member computes each tensor's digest as its bytes pass and the destinations' are compared with the
    source's in one more small
    round: a mismatch raises :class:`CommMismatchError` on every member,
    naming the tensors. With ``atomic``, the destinations receive into staging, verify, and write their live tensors (or
    call ``load`` once, with every tensor) only once the source has recorded "commit" in the mode's store: a death, a
    timeout or a mismatch before that point leaves every destination's live tensors as they were ("version 7 not
    committed; live weights are version 6"), and after it every surviving destination commits.

    With ``delta`` (and a ``version``), the source sends only the elements that changed since the version every
    destination holds: it keeps a copy of what it last sent (one copy of its tensors, on the host), compares its tensors
    with it bit for bit (as integers: NaN payloads and signed zeros too), and sends the changed elements' positions and
    bytes; each destination writes them into its tensors in place and ends bit-identical to the source. The first
    sync, and any in which a destination holds another version (a newcomer, a restart, a failed sync), other tensors
    than the ones the last sync wrote, or the delta would not be smaller, is full, for every destination alike (the
    relay forwards one payload), decided on every member before any byte moves. ``report.kinds`` says which each
    destination got and ``report.delivered`` how many bytes. A ``load`` callable cannot take a delta (refused on every
    member).

    A ``load`` callable (a destination only) has the shape of vLLM's ``model.load_weights(weights)``:
    ``load(named_tensors)``, where ``named_tensors`` is a list of ``(name, tensor)`` pairs, each tensor contiguous with
    the source's dtype and shape, on the communicator's device. The destination learns the names from the source's
    manifest, receives into at most two buffers, and calls ``load`` once per buffer, from the thread that runs the
    transfer (this call, or ``wait()``, or the next call on the mode, which completes an unwaited transfer first). Every
    name comes exactly once over the calls (a tied tensor once per name, the same view, in one call with the tensor it
    is tied to; a tensor of no elements too). **Every layer comes whole in one call**: a tensor's layer is its name up
    to the first all-digit component (``model.layers.3`` for ``model.layers.3.mlp.up_proj.weight``), else its module
    (the name without its last component; a name without a dot is a layer of its own). The tensors travel layer by layer
    (in the order of each layer's first tensor in the source's state dict), a buffer holds whole layers of at most
    ``bucket_bytes`` together, and a layer larger than that comes alone in a buffer of its own size: a destination holds
    at most two buffers of ``max(bucket_bytes, its largest layer)``. The tensors are views of the buffer, valid until
    ``load`` returns: a ``load`` may keep them while the call lasts (vLLM's layer-by-layer reload, which keeps a layer's
    tensors until all of them have arrived, thus sees only valid ones), and must copy what it keeps longer (vLLM keeps
    the tensors of a layer it finishes only at the end of its reload, such as a vocabulary it pads:
    ``rlightning_comm.integrations.vllm`` copies those). With a ``load`` destination in the group, buckets never span
    two runs of whole layers (for every member: about one more transfer per bucket's worth of layers). If ``load``
    raises, the transfer still completes (the later buckets are received and dropped, so the peers are unaffected) and
    its exception is raised afterwards, unchanged (on Python 3.11+ with a note naming the bucket).

    A transfer that fails midway (a peer died or hung) raises :class:`CommError` / :class:`CommTimeoutError` whose
    message says what is
    left: on a destination whether its tensors were partly written (with a
    ``load`` callable, how many buckets it had been given), on the source which destinations may hold partial weights.

    Args:
        state_dict: A mapping of names to tensors, an ``nn.Module``, a list of ``(name, tensor)`` pairs, or (on a
            destination) a ``load`` callable. Tensors may live on the host or a CUDA device (or the communicator's
            device); those off the communicator's device are staged through its buckets.
        comm_mode: The mode to broadcast over.
        src: Rank that sends, in the mode's numbering (a global rank on a mode of the world); ``None`` means the source
            declared to :meth:`CommContext.init_weight_transfer_group` for this mode. Every rank must name the same one.
        bucket_bytes: Largest bucket, in bytes; the source's value is used.
        async_op: Publish and step on: the source returns as soon as its tensors are captured (copied, on their own
            devices, into buffers kept for the next publish: one more copy of its tensors), and may change them at
            once; the call runs on a thread of its own and the returned :class:`StateDictTransfer`'s ``wait()`` gives
            its report once every destination holds the version (committed, with ``atomic``), or raises what the call
            raised, on every member as the blocking call does. A destination's tensors are written in the background:
            it must not read or write them until ``wait()`` returns. Publishes on a mode queue in the order they were
            made, one draining and at most one waiting (a third waits for the oldest); any other weight-sync call on
            the mode waits for them first. Other collectives may run meanwhile on other modes; on this mode only
            weight-sync calls. On NCCL the publish's thread issues NCCL calls on this mode's group while the caller
            issues its own on others: keep the two groups' calls independent (the same order on every rank within each
            group), as NCCL requires of concurrent communicators.
        version: The version these weights are, or ``None`` (an unversioned sync, which clears the destinations'
            record). Every member passes the same, except that a destination may pass ``"any"``: it takes the version
            the sources name (and still refuses one at or below the version it committed), which the report and its
            record then hold (an engine that receives in the background before it knows the trainer's next version).
        verify: Check each tensor's digest on every destination against the source's.
        atomic: All or nothing: stage, verify, then commit through the mode's store (implies ``verify``). Staging holds
            one more copy of the destination's weights (of the source's manifest, with a ``load`` callable), kept
            between atomic syncs on the mode.
        staging_device: Where an atomic destination stages: ``None`` for each tensor's own device, ``"cpu"`` for the
            host (a GPU engine short of memory).
        record_as: The mode whose version record a destination updates (``None``: ``comm_mode``); a newcomer seeded over
            a mode of its own records the fleet's mode.
        fanout: ``"chain"`` (relay), ``"star"`` (the source sends to every destination), or ``None``: a chain when the
            units move point to point and two or more destinations can forward (a ``load`` callable outside an atomic
            sync cannot: the source sends to it directly). Every member passes the same.
        delta: Send only what changed since the last sync (needs ``version``; see above). ``False`` keeps nothing and
            frees what an earlier ``delta=True`` kept: a later ``delta=True`` starts with a full sync. Every member
            passes the same.

    Returns:
        The :class:`WeightSyncReport` (bytes sent and received per peer, version, digests); with ``async_op`` a
        :class:`StateDictTransfer` whose ``wait()`` returns it. ``None`` on a non-member.

    Raises:
        TypeError, ValueError: a bad argument (``src``, ``bucket_bytes``,
            ``state_dict``, ``version``, ...), a mismatch or an unusable tensor on any member, raised on every member
            before anything moves.
        CommMismatchError: a stale version (before anything moves), or digests that differ after the transfer.
        ModeNotBoundError: ``comm_mode`` is not bound on this rank.
        CommTimeoutError, CommError: a transfer (a send, receive or broadcast) failed, or a peer never joined.
    """
    comm = CommContext().get_communicator(comm_mode)
    options = SyncOptions(version, verify, atomic, staging_device, record_as, comm.mode, delta)
    return transfer(comm, state_dict, src, bucket_bytes, async_op, options, fanout)


def transfer(
    comm: Any,
    state_dict: Any,
    src: Any,
    bucket_bytes: Any,
    async_op: bool,
    options: SyncOptions | None = None,
    fanout: str | None = None,
) -> WeightSyncReport | StateDictTransfer | None:
    """:func:`broadcast_state_dict` on the communicator ``comm`` (bound to a mode, or built by the caller)."""
    if not comm.is_member:
        return None
    if options is None:
        options = SyncOptions(None, False, False, None, None, comm.mode)
    if options.atomic is True and options.problem is None and mode_store(comm) is None:
        options.problem = (ValueError, f"atomic=True needs a store every member of mode {comm.mode!r} reaches")
    memory = kept(comm)
    if async_op:
        return _publish(comm, memory, state_dict, src, bucket_bytes, options, fanout)
    drain(memory)
    with comm._exclusive(OP):
        declared = _declared_source(comm) if src is None else None
        try:
            pipeline = agree(comm, state_dict, src, bucket_bytes, declared, options, fanout)
        except CommError as err:  # a member lost or absent in the handshake: nothing moved
            failed = options.not_committed(OP, err)
            if failed is None:
                raise
            raise failed from err
        try:
            return pipeline.finish()
        finally:
            forget(comm, pipeline)


def _publish(
    comm: Any, memory: Any, state_dict: Any, src: Any, bucket_bytes: Any, options: SyncOptions, fanout: str | None
) -> StateDictTransfer:
    """``async_op=True``: the source's tensors captured, the call on a thread of its own."""
    source = src if src is not None else _declared_source(comm)
    release = None
    if source == comm._global_rank:
        items, problem = named_tensors(state_dict, True)
        if problem is None and isinstance(items, list):  # else the call itself reports it, on every member
            pool = captures(memory)
            try:
                copies, token = pool.take([t for _, t in items])
            except Exception as err:  # noqa: BLE001 - raised by the call on every member, before any byte moves
                options.problem = options.problem or (
                    RuntimeError,
                    f"async_op: its tensors could not be captured: {err}",
                )
            else:
                state_dict = [(name, copy) for (name, _), copy in zip(items, copies)]

                def release() -> None:
                    pool.give_back(token)

    captured = state_dict
    return StateDictTransfer(
        memory, lambda: transfer(comm, captured, src, bucket_bytes, False, options, fanout), OP, release
    )


def _declared_source(comm: Any) -> int | None:
    try:
        return CommContext().get_transfer_source(comm.mode)
    except KeyError:  # a communicator the caller built and did not bind: no declared source
        return None
