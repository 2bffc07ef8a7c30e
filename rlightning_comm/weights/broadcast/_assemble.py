"""One member's part of a sync, once the members agreed on the plan: its route, its data phase and what settles it.

The route (:func:`relay_routes`) is a star, or a chain when the units move point to point and two or more destinations
can forward. The data phase is a :class:`~._pipeline.Pipeline` over this member's tensors (the staging ones on an atomic
destination) or a :class:`~._loader.LoadPipeline` handing buckets to a ``load`` callable; digests (``verify``) are fed
as the bytes pass; :class:`~._commit.Sync` runs it and settles verification and commit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlightning_comm.weights.broadcast._loader import LoadPipeline
from rlightning_comm.weights.broadcast._pipeline import Pipeline
from rlightning_comm.weights.broadcast._plan import Delivery, Plan
from rlightning_comm.weights.broadcast._transport import Transfer, chain
from rlightning_comm.weights.commit._digest import Digests
from rlightning_comm.weights.commit._sync import Sync
from rlightning_comm.weights.commit._versions import SyncOptions
from rlightning_comm.weights.core._memory import kept
from rlightning_comm.weights.core._staging import dtype_of


def staging(
    comm: Any, plan: Plan, live: list[torch.Tensor] | None, device: torch.device | None, default: torch.device
) -> list:
    """Tensors to receive an atomic sync into, one per manifest entry (an alias is its target's very tensor).

    Each like its live tensor (contiguous) on ``device``, or on the live tensor's own device; with no live tensors (a
    ``load`` callable) from the manifest, on ``device`` or the communicator's ``default``. Kept for the next atomic sync
    on ``comm`` with the same tensors (fresh pages cost more to fault in than the copy into them), freed with it.
    """
    key = (plan.manifest, device, default, None if live is None else tuple(t.device for t in live))
    memory = kept(comm)
    if memory.staged is not None and memory.staged[0] == key:
        return memory.staged[1]
    memory.staged = None  # the old staging goes before the new one is made
    out: list[torch.Tensor] = []
    aliases = dict(plan.aliases)
    for index, (_, dtype, shape, _) in enumerate(plan.manifest):
        if index in aliases:
            out.append(out[aliases[index]])
        elif live is not None:
            t = live[index]
            out.append(torch.empty(t.shape, dtype=t.dtype, device=device or t.device))
        else:
            out.append(torch.empty(shape, dtype=dtype_of(dtype), device=device or default))
    memory.staged = (key, out)
    return out


def relay_routes(comm: Any, fanout: str | None, sends: bool, src: int, leaves: set[int]) -> dict[int, Any] | None:
    """The relay's routes (group ranks), the same on every member; ``None`` for a star.

    A chain when the units move point to point and the members asked for one (or left it to the default), with at least
    two destinations that forward (``leaves``, the group ranks of ``load`` callables outside an atomic sync, receive
    straight from the source).
    """
    if not sends or fanout == "star" or comm.world_size - 1 - len(leaves) < 2:
        return None
    return chain(comm.world_size, comm._group_rank_of[src], leaves)


def assemble(
    comm: Any,
    plan: Plan,
    load_deliveries: tuple[Delivery, ...] | None,
    src: int,
    items: list[tuple[str, torch.Tensor]] | None,
    load: Any,
    sends: bool,
    routes: dict[int, Any] | None,
    options: SyncOptions,
    memory: Any,
    cached: bool,
    rounds: tuple[Callable[..., Any], Callable[..., Any]],
) -> Sync:
    """This member's :class:`Sync` of ``plan``, ready to start.

    Args:
        comm, plan, src: The communicator, the agreed plan and the source.
        load_deliveries: The plan's deliveries, for a ``load`` callable outside an atomic sync.
        items, load: This member's named tensors, or its ``load`` callable.
        sends: Whether the units move point to point.
        routes: :func:`relay_routes`.
        options: The call's versions, verification and commit.
        memory: What the communicator keeps between calls (staging buffers, pinned mirrors).
        cached: Whether the plan was reused.
        rounds: The mode's small rounds, for :class:`Sync`.
    """
    me, is_source = comm.rank, src == comm._global_rank
    into, onto = routes[me] if routes else (None if is_source else comm._group_rank_of[src], [])
    if routes is None and is_source:
        onto = [r for r in range(comm.world_size) if r != me]
    sent = {comm.ranks[r]: plan.total_bytes for r in onto}
    received = {} if into is None else {comm.ranks[into]: plan.total_bytes}
    digests = Digests(plan.names, [e[2] for e in plan.manifest], plan.aliases) if options.verify else None
    live: tuple[Any, list[Any]] | None = None
    if load is not None and not options.atomic:
        if digests is not None:
            load = _hashing(load, digests, plan)
        route = routes[me] if routes else None  # a leaf of a chain: the source's messages come cut as in the chain
        data: Transfer = LoadPipeline(comm, plan, load, src, memory.slots, sends, load_deliveries, route)
    else:
        tensors: list[torch.Tensor] | None = None
        if load is None:
            by_name = dict(items)
            tensors = [by_name[name] for name in plan.names]
            tensors = [t.detach() if t.requires_grad else t for t in tensors]  # the pipeline writes them in place
        if options.atomic and not is_source:  # received into staging; the live tensors wait for the commit
            staged = staging(comm, plan, tensors, options.staging_device, comm.device)
            live = (load, list(zip(plan.names, staged))) if load is not None else (tensors, staged)
            tensors = staged
        route = routes[me] if routes else None
        data = Pipeline(comm, plan, tensors, src, is_source, memory.slots, sends, memory.mirrors, route)
        data.digests = digests
        data.staging = live is not None
    return Sync(comm, data, options, src, sent, received, digests, live, cached, rounds, "broadcast_state_dict")


def _hashing(load: Any, digests: Digests, plan: Plan) -> Any:
    """``load`` that first feeds ``digests`` with each whole tensor it is given (a view of the bucket it arrived in)."""
    index = {name: i for i, name in enumerate(plan.names)}
    aliased = {i for i, _ in plan.aliases}

    def hashed(named: list[tuple[str, torch.Tensor]]) -> Any:
        for name, tensor in named:
            if index[name] not in aliased:
                digests.update_piece(index[name], tensor, (), tensor.dtype)
        try:
            return load(named)  # while the digests' thread reads the same bytes
        finally:
            digests.settle()  # the views are the bucket's, valid only during this call

    return hashed
