"""The handshake of :func:`broadcast_state_dict`: every member ends with the same plan, or raises the same error.

One exchange of a few integers per rank: each rank's verdict on its own arguments and tensors (:mod:`._weight_inputs`),
the source it names, a hash of its tensors' names, dtypes and shapes, the plan it kept from its last call, whether stats
or debug mode instruments its broadcasts, whether it passed a ``load`` callable, the call's version, verification and
commit words (:mod:`._versions`, whose refusals are raised here on every member) and its fanout. When every rank holds
the plan of the source's current manifest (the steady state of a training loop), that is all; otherwise (and whenever a
destination holds tensors that share memory in a way its kept plan does not cover) the source broadcasts its manifest
(JSON, two small broadcasts), every rank builds the plan and checks its tensors against it, and a second round of one
word each shares those verdicts. A problem on any rank is then exchanged as text (two more rounds), so every member
raises the same error before any weight moves, and the group stays in step.

Everything here calls the mode's own process group directly (not the communicator's methods, which stats or debug mode
may wrap), so it works on a group outside torch's world and uses no store: the rounds are :mod:`._rounds`'s, and the
manifest's broadcasts go the same way.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from rlightning_comm.weights.broadcast._assemble import assemble, relay_routes
from rlightning_comm.weights.broadcast._delta import LOAD_REFUSED, assemble_delta, decide, full, prepare
from rlightning_comm.weights.broadcast._inputs import describe, mismatch, named_tensors, overlapping, uncovered
from rlightning_comm.weights.broadcast._plan import Entry, build_plan, deliveries
from rlightning_comm.weights.commit._sync import Sync
from rlightning_comm.weights.commit._versions import SyncOptions
from rlightning_comm.weights.core._checks import Problem
from rlightning_comm.weights.core._memory import Kept, kept
from rlightning_comm.weights.core._rounds import ERRORS, exchange, on_device, raise_shared, rounds
from rlightning_comm.weights.core._wire import point_to_point


def broadcast_manifest(
    comm: Any, offer: tuple[list[Entry], int] | None, src: int, memory: Kept
) -> tuple[list[Entry], int]:
    """The source's ``(manifest, bucket_bytes)`` on every member (two broadcasts: the size, then the JSON bytes)."""
    payload = json.dumps(offer).encode() if offer is not None else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    opts = dist.BroadcastOptions()
    opts.rootRank = comm._group_rank_of[src]

    def bcast(t: torch.Tensor) -> Any:
        def run(device: torch.device) -> torch.Tensor:
            on = t.to(device)
            comm._run("broadcast_state_dict", lambda: comm.group.broadcast([on], opts))
            return on

        return run

    n = int(on_device(comm, memory, bcast(size))[0])
    buffer = bytearray(payload) if offer is not None else bytearray(n)
    data = torch.frombuffer(buffer, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    received = on_device(comm, memory, bcast(data))
    if offer is not None:
        return offer
    if received.data_ptr() != data.data_ptr():
        data.copy_(received)
    try:
        entries, bucket_bytes = json.loads(bytes(buffer))
        return [
            (str(name), str(dtype), tuple(int(n) for n in shape), int(alias)) for name, dtype, shape, alias in entries
        ], int(bucket_bytes)
    except (ValueError, TypeError) as err:  # another version's manifest, or bytes the transport garbled
        raise ValueError(f"the source's manifest ({n} bytes) could not be read: {err}") from err


def _check_arguments(comm: Any, src: Any, bucket_bytes: Any, declared: int | None) -> tuple[int | None, Problem]:
    """The source's rank (``None`` when it cannot be told), and what is wrong with the arguments."""
    wrong = []
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        wrong.append(f"bucket_bytes must be a positive int; got {bucket_bytes!r}")
    if src is None:
        src = declared
        if src is None:
            wrong.append(
                f"src is required: mode {comm.mode!r} was not bound by init_weight_transfer_group, so it has no "
                "declared source"
            )
    elif isinstance(src, bool) or not isinstance(src, int) or src not in comm.ranks:
        wrong.append(f"src={src!r} is not a global rank of mode {comm.mode!r}; expected one of {list(comm.ranks)}")
        src = None
    return src, (ValueError, "; ".join(wrong)) if wrong else None


def _inspect(
    state_dict: Any, is_source: bool, comm: Any
) -> tuple[list[tuple[str, torch.Tensor]] | None, Any, list[Entry], list[Any], Problem]:
    """This rank's tensors (or ``load`` callable), its manifest, its tensors that share memory (a destination's), and
    its verdict; never raises."""
    items, problem = named_tensors(state_dict, is_source)
    if problem is not None or not isinstance(items, list):
        return None, items, [], [], problem
    try:
        problem, entries, spans = describe(items, is_source, comm.device.type)
        if problem is not None:
            return None, None, [], [], problem
        return items, None, entries, overlapping(spans), None
    except Exception as err:  # noqa: BLE001 - whatever a tensor raises here is this rank's verdict, shared like any other
        return (
            None,
            None,
            [],
            [],
            (type(err) if type(err) in ERRORS.values() else RuntimeError, f"its tensors could not be read: {err}"),
        )


FANOUTS = (None, "star", "chain")


def agree(
    comm: Any,
    state_dict: Any,
    src: Any,
    bucket_bytes: Any,
    declared: int | None,
    options: SyncOptions,
    fanout: Any = None,
) -> Sync:
    """The handshake: every member ends with the same plan and a sync ready to start, or raises the same error.

    ``declared`` is the mode's declared source (``src=None`` means it); ``options`` the call's versions, verification
    and commit (their words ride on the first round, and their refusals are raised on every member here).
    """
    memory = kept(comm)
    if memory.unfinished is not None:  # every rank has it, in the same program order: complete it first
        memory.unfinished.finish()
        memory.unfinished = None
    src, problem = _check_arguments(comm, src, bucket_bytes, declared)
    is_source = src == comm._global_rank
    items, load, mine, shared, bad = _inspect(state_dict, is_source, comm)
    problem = problem or bad or options.problem
    if problem is None and fanout not in FANOUTS:
        problem = (ValueError, f"fanout must be 'star', 'chain' or None; got {fanout!r}")
    kept_plan = memory.plans.get(src) if src is not None else None
    # With a problem anywhere every member raises before the keys are read.
    tensors_key, plan_key = (
        memory.hashes(mine, bucket_bytes, is_source) if problem is None and items is not None else ((0, 0), (0, 0))
    )
    kept_key = kept_plan[0] if kept_plan else (0, 0)
    if problem is None and options.delta and load is not None:
        problem = (ValueError, LOAD_REFUSED)
    offer = None
    if problem is None and options.delta:  # the source encodes its delta before the exchange: its size rides on it
        offer = prepare(comm, memory, options, is_source, items, kept_plan, plan_key)
    elif not options.delta:
        memory.drop_delta()  # delta=False keeps nothing: a later delta=True starts with a full sync
    if shared and (kept_plan is None or uncovered(shared, kept_plan[1]) is not None):
        kept_key = (0, 0)  # tensors that share memory are checked against the source's manifest: have it sent
    words = [
        int(problem is not None),
        -1 if src is None else src,
        *tensors_key,
        *plan_key,
        *kept_key,
        int(_instrumented(comm)),
        int(load is not None),
        int(kept_plan[1].layered) if kept_plan else -1,
        *options.words(),
        FANOUTS.index(fanout) if fanout in FANOUTS else 0,
    ]
    rows = exchange(comm, words, memory)
    if any(row[0] for row in rows):
        raise_shared(comm, problem, memory)
    if len({row[1] for row in rows}) > 1:
        named = ", ".join(f"rank {rank}: {row[1]}" for rank, row in zip(comm.ranks, rows))
        raise ValueError(
            f"broadcast_state_dict: nothing was transferred; the ranks name different sources ({named}); expected one "
            "src on every rank"
        )
    src = rows[0][1]  # every rank reported a valid input and this src
    options.check(comm.ranks, [row[11:-1] for row in rows], src, "broadcast_state_dict")
    if len({row[-1] for row in rows}) > 1:
        named = ", ".join(f"rank {rank}: {FANOUTS[row[-1]]!r}" for rank, row in zip(comm.ranks, rows))
        raise ValueError(f"broadcast_state_dict: nothing was transferred; the members pass different fanouts ({named})")
    cached = True
    source = rows[comm.ranks.index(src)]
    same_tensors = all(row[9] or row[2:4] == source[2:4] for row in rows)  # a load callable takes any manifest
    layered = any(row[9] for row in rows)  # a load callable gets whole layers
    reuse = kept_plan is not None and all(row[10] == layered for row in rows)
    if not (same_tensors and reuse and all(row[6:8] == source[4:6] for row in rows)):
        # The source's manifest, then a second round: each rank's verdict on it and on its tensors against it.
        cached = False
        try:
            kept_plan = (
                (source[4], source[5]),
                build_plan(
                    *broadcast_manifest(comm, (mine, bucket_bytes) if is_source else None, src, memory), layered
                ),
                None,
            )
            problem = None
        except ValueError as err:
            kept_plan, problem = None, (ValueError, str(err))
        if kept_plan is not None and items is not None and not is_source:
            differ = mismatch(kept_plan[1].manifest, mine)
            problem = (
                (ValueError, f"these tensors do not match the source's ({differ})")
                if differ
                else uncovered(shared, kept_plan[1])
            )
        if any(row[0] for row in exchange(comm, [int(problem is not None)], memory)):
            raise_shared(comm, problem, memory)
        memory.plans[src] = kept_plan
    plan = kept_plan[1]
    sends = point_to_point(comm) and not any(row[8] for row in rows)  # the same choice on every member
    if load is not None and not options.atomic and kept_plan[2] is None:
        kept_plan = memory.plans[src] = (*kept_plan[:2], deliveries(plan))
    leaves = {r for r, row in enumerate(rows) if row[9] and not options.atomic and r != comm._group_rank_of[src]}
    routes = relay_routes(comm, FANOUTS[rows[0][-1]], sends, src, leaves)
    if decide(options, comm.ranks, src):
        small = rounds(comm, memory, "broadcast_state_dict")
        sync = assemble_delta(comm, plan, src, items, offer, sends, routes, options, memory, cached, small)
        memory.unfinished = sync
        return sync
    memory.unfinished = assemble(
        comm,
        plan,
        kept_plan[2],
        src,
        items,
        load,
        sends,
        routes,
        options,
        memory,
        cached,
        rounds(comm, memory, "broadcast_state_dict"),
    )
    if options.delta:
        full(memory.unfinished, comm, plan, src, items, options, memory, kept_plan[0], offer)
    return memory.unfinished


def _instrumented(comm: Any) -> bool:
    """Whether stats or debug mode wraps this communicator's ``broadcast`` (an instance attribute over the class's
    method)."""
    return "broadcast" in vars(comm)
