"""Debug mode: before each collective the ranks of the group compare what they are about to do.

:func:`enable` shadows the collectives of one communicator with instance attributes that first run the op's local checks
(``Communicator._check_<op>``), then exchange a fingerprint of the call (op, shapes, dtypes, reduce op, src/dst,
dictionary keys, split sizes, and this rank's refusal if its checks failed) through the world's store, and compare them.
Before any collective starts, on every rank of the group:

* a refusal (a bad argument on one rank, including the root-only lists of ``gather``/``scatter``) raises the refusing
  rank's error type, naming that rank and its problem;
* a disagreement raises :class:`CommMismatchError`;
* a rank that does not arrive within the group's timeout makes the others raise :class:`CommTimeoutError` naming it:
  every waiting rank names the same absent ranks, and raises as soon as the first of them times out.

A :class:`CommMismatchError` raised for a disagreement carries ``shapes``: for each global rank of the group, the shape
of every tensor argument of its call (``{global rank: {argument: shape}}``), for the layers above to explain what their
own arguments made of it (the sequence-parallel ops name a forgotten ``seq_lens``).

In all three cases no collective was started and the group stays usable:
the sequence numbers stay in step even after a timeout (a rank that arrives at a check the others gave up on takes the
next one), so the next good call works on every rank. :func:`disable` removes the attributes, so a communicator that
never had debug mode on runs exactly the class's code: no wrapper, no store traffic.

Each check costs a few store round trips (one compare-and-set, polls until every rank's fingerprint is there, one
multi-get, a few deletes per rank): a debugging aid, not something to leave on in a long run.
"""

from __future__ import annotations

import functools
import inspect
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rlightning_comm import rendezvous
from rlightning_comm.communicators.base import COLLECTIVES
from rlightning_comm.debug import _p2p as _debug_p2p
from rlightning_comm.debug._fingerprints import DESCRIBE as _DESCRIBE
from rlightning_comm.errors import CommError, CommMismatchError, CommTimeoutError, ModeNotBoundError, ObjectRefusedError

if TYPE_CHECKING:
    from rlightning_comm.communicators.base import Communicator

_generation = 0


def new_generation(store: dist.Store, world_size: int) -> None:
    """Start the key namespace of a newly initialised world, so that stale keys of an earlier world on the same store
    are never read.

    Every rank of the world calls it once (the context does, on every world initialisation). The number is agreed
    through the world's store, not counted per process: ranks whose processes initialised different numbers of worlds
    before (a restarted rank, a process that was in another world) still share one namespace. On a fresh store it is 0;
    each later world on the same store adds one.
    """
    global _generation
    _generation = (store.add("rlightning_comm/debug/worlds", 1) - 1) // world_size


OPS = COLLECTIVES

# The error types a refusal is raised as on every rank (the first of the refusing error's classes found here).
_REFUSALS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        ModeNotBoundError,
        ObjectRefusedError,
        CommError,
        TypeError,
        ValueError,
        IndexError,
        KeyError,
        NotImplementedError,
    )
}
_ABSENT = "absent"  # what a rank that gave a check up puts in the slots still empty (a fingerprint is a JSON list)
_ABSENT_BYTES = _ABSENT.encode()
_FIRST_PAUSE, _LONGEST_PAUSE = 0.0005, 0.02  # seconds between polls of a check's slots: doubling, up to the longest


def _refusal_type(err: BaseException) -> str:
    return next(
        (cls.__name__ for cls in type(err).__mro__ if cls.__name__ in _REFUSALS and _REFUSALS[cls.__name__] is cls),
        "CommError",
    )


class _Checker:
    """The store-side state of one communicator's checks.

    Check ``seq`` of a group has one slot per group rank, ``seq/<group rank>``. A rank arrives by filling its own slot
    with its fingerprint in one atomic compare-and-set (set if empty), then polls until every slot is filled. A rank
    still waiting when its timeout is up fills every slot that is still empty with :data:`_ABSENT`, by the same
    compare-and-set, and each slot is decided once: a rank arrives, or it is absent. Every rank then reads the same
    slots, so all name the same absent ranks, and the ranks still waiting learn it at once (their slots are all filled).
    A rank that arrives to find its slot marked absent takes the next sequence number instead, which keeps every rank's
    numbers in step after a failure.
    """

    def __init__(self, comm: Communicator, timeout: float) -> None:
        own = rendezvous.own_store(comm.group)  # a connected mode's: its group's name is unique to its generation there
        world = f"rlightning_comm/debug/{_generation}/{comm.group.group_name}"
        self.store = (
            dist.PrefixStore(f"rlightning_comm/debug/{comm.group.group_name}", own)
            if own is not None
            else dist.PrefixStore(world, rendezvous.world_store())
        )
        self.timeout = timeout
        self.mode = comm.mode
        self.ranks = comm.ranks
        self.me = comm.rank
        self.seq = 0
        self.done = 0  # keys of checks before this one are no longer read by anyone once a check completes
        self.depth = 0  # > 0 inside a checked call: its inner collectives are not checked again

    def check(
        self, op: str, fields: dict[str, Any], extra: Any, refusal: BaseException | None, shapes: dict[str, list[int]]
    ) -> None:
        """Exchange this rank's fingerprint; raise on every rank when a rank refused the call, the ranks disagree or one
        is absent."""
        why = None if refusal is None else [_refusal_type(refusal), str(refusal)]
        mine = json.dumps([op, fields, extra, why, shapes])
        while True:
            seq = self.seq
            self.seq += 1
            if self.store.compare_set(f"{seq}/{self.me}", "", mine) != _ABSENT_BYTES:
                break  # arrived; otherwise the others gave this check up before we came: take the next one
        keys = [f"{seq}/{r}" for r in range(len(self.ranks))]
        if not self._all_arrived(keys):
            for key in keys:  # decide every empty slot: absent (a rank arriving meanwhile wins its own slot)
                self.store.compare_set(key, "", _ABSENT)
        slots = self.store.multi_get(keys)
        absent = [self.ranks[r] for r, slot in enumerate(slots) if slot == _ABSENT_BYTES]
        if absent:
            raise CommTimeoutError(
                f"debug check before collective #{seq} ({op}) on mode {self.mode!r}: global ranks {absent} did not "
                "reach it "
                f"within {self.timeout:g} s (the group's timeout); a rank skipped a call, is blocked elsewhere or "
                "died. "
                "No collective was started; the group is still usable, and a late rank's next call is checked with the "
                "others' next one"
            )
        calls = [json.loads(slot) for slot in slots]
        self._forget(seq)
        refused = [(self.ranks[r], c[3]) for r, c in enumerate(calls) if c[3] is not None]
        where = f"debug check before collective #{seq} on mode {self.mode!r}"
        if refused:
            text = "; ".join(f"global rank {rank} refused the call: {msg}" for rank, (_, msg) in refused)
            error = _REFUSALS[refused[0][1][0]](
                f"{where}: {text}. No collective was started; the group is still usable"
            )
            raise error from refusal
        problem = self._disagreement(calls)
        if problem:
            error = CommMismatchError(
                f"{where}: the ranks disagree: {problem}. No collective was started; the group is still usable"
            )
            error.shapes = {self.ranks[r]: c[4] for r, c in enumerate(calls)}  # type: ignore[attr-defined]
            raise error

    def _all_arrived(self, keys: list[str]) -> bool:
        """Poll until every slot is filled (``True``) or the timeout is up (``False``).

        A poll rather than the store's ``wait``: ``FileStore.wait`` counts whole seconds and overshoots a timeout by up
        to one.
        """
        deadline = time.monotonic() + self.timeout
        pause = _FIRST_PAUSE
        while not self.store.check(keys):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(2 * pause, _LONGEST_PAUSE)
        return True

    def _forget(self, seq: int) -> None:
        # Every rank has posted `seq`, so each has finished with every earlier check: nobody reads their slots again (a
        # slot marked absent is its rank's to delete, as it takes the next number).
        for old in range(self.done, seq):
            self.store.delete_key(f"{old}/{self.me}")
        self.done = seq

    def _by_value(self, values: list[Any]) -> str:
        groups: dict[str, list[int]] = {}
        for rank, v in zip(self.ranks, values):
            groups.setdefault(json.dumps(v), []).append(rank)
        return "; ".join(f"{json.loads(v)} on global ranks {rs}" for v, rs in groups.items())

    def _disagreement(self, calls: list[list[Any]]) -> str:
        ops = [c[0] for c in calls]
        if len(set(ops)) > 1:
            return "different calls: " + self._by_value([f"{op}({c[1]})" for op, c in zip(ops, calls)])
        names = list(dict.fromkeys(name for c in calls for name in c[1]))
        problems = [
            f"{name}: {self._by_value([c[1].get(name) for c in calls])}"
            for name in names
            if len({json.dumps(c[1].get(name)) for c in calls}) > 1
        ]
        if problems:
            return ", ".join(problems)
        if ops[0] == "all_to_all_single":
            return self._split_disagreement([c[2] for c in calls])
        return ""

    def _split_disagreement(self, splits: list[dict[str, Any] | None]) -> str:
        if any(s is None for s in splits):
            return ""
        bad = []
        for i, si in enumerate(splits):
            for j, sj in enumerate(splits):
                sent = si["in"][j] if si["in"] else None
                expected = sj["out"][i] if sj["out"] else None
                if sent != expected:
                    bad.append(
                        f"global rank {self.ranks[i]} sends {sent} rows to global rank {self.ranks[j]}, which expects "
                        f"{expected}"
                    )
        return ", ".join(bad)


def _checked(comm: Communicator, name: str, checker: _Checker) -> Callable[..., Any]:
    method = getattr(type(comm), name)
    local_checks = getattr(type(comm), f"_check_{name}")
    signature = inspect.signature(method)
    describe = _DESCRIBE[name]
    ws = comm.world_size

    @functools.wraps(method)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if checker.depth:
            return method(comm, *args, **kwargs)
        with comm._exclusive(name):  # a second thread is refused here, before anything is exchanged
            fields: dict[str, Any] = {}
            extra = refusal = None
            shapes: dict[str, list[int]] = {}
            try:
                local_checks(comm, *args, **kwargs)  # the op's own local checks; a refusal goes to every rank
                bound = signature.bind(comm, *args, **kwargs)
                bound.apply_defaults()
                fields, extra = describe(bound.arguments, ws, comm.mode)
                shapes = {
                    arg: list(value.shape) for arg, value in bound.arguments.items() if isinstance(value, torch.Tensor)
                }
            except Exception as err:  # noqa: BLE001 - whatever this rank cannot do, its peers must learn before they wait
                refusal = err
            checker.check(name, fields, extra, refusal, shapes)
            checker.depth += 1
            try:
                return method(comm, *args, **kwargs)
            finally:
                checker.depth -= 1

    return checked


def enable(comm: Communicator, timeout: float) -> None:
    """Check every collective of ``comm`` across its group from now on (no-op on a non-member or if already on)."""
    if comm.group is None or "_debug_checker" in vars(comm):
        return
    checker = vars(comm).get("_debug_paused") or _Checker(comm, timeout)
    comm._debug_checker = checker
    prefix = f"rlightning_comm/debug/{_generation}/{comm.group.group_name}"
    pairs = vars(comm).get("_debug_pairs") or _debug_p2p.PairChecker(comm, timeout, prefix, _REFUSALS, _refusal_type)
    comm._debug_pairs = pairs  # kept while paused, as the checker is: the counts stay in step with the peers'
    for name in OPS:
        setattr(
            comm,
            name,
            _debug_p2p.checked(comm, name, pairs) if name in _debug_p2p.OPS else _checked(comm, name, checker),
        )


def disable(comm: Communicator) -> None:
    """Stop checking ``comm``'s collectives: its methods are the class's again."""
    checker = vars(comm).pop("_debug_checker", None)
    if checker is None:
        return
    comm._debug_paused = checker  # re-enabling continues the sequence numbers, as on the other ranks
    for name in OPS:
        vars(comm).pop(name, None)


def is_enabled(comm: Communicator) -> bool:
    """Whether :func:`enable` is in effect on ``comm``."""
    return "_debug_checker" in vars(comm)
