"""Debug mode: before each collective the ranks of the group compare what they are about to do.

:func:`enable` shadows the collectives of one communicator with instance
attributes that first run the op's local checks (``Communicator._check_<op>``),
then exchange a fingerprint of the call (op, shapes, dtypes, reduce op,
src/dst, dictionary keys, split sizes, and this rank's refusal if its checks
failed) through the world's store, and compare them. Before any collective
starts, on every rank of the group:

* a refusal (a bad argument on one rank, including the root-only lists of
  ``gather``/``scatter``) raises the refusing rank's error type, naming that
  rank and its problem;
* a disagreement raises :class:`CommMismatchError`;
* a rank that does not arrive within the group's timeout makes the others
  raise :class:`CommTimeoutError` naming it.

In all three cases no collective was started and the group stays usable:
the sequence numbers stay in step even after a timeout (a rank that arrives
at a check the others gave up on takes the next one), so the next good call
works on every rank. :func:`disable` removes the attributes, so a
communicator that never had debug mode on runs exactly the class's code: no
wrapper, no store traffic.

Each check costs a few store round trips (one add, one set, one wait, one
multi-get, a few deletes per rank): a debugging aid, not something to leave
on in a long run.
"""

from __future__ import annotations

import functools
import inspect
import json
import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rlightning_comm import _debug_p2p, rendezvous
from rlightning_comm.communicators import _packing
from rlightning_comm.communicators._checks import reduce_op_type
from rlightning_comm.communicators.base import COLLECTIVES
from rlightning_comm.errors import CommError, CommMismatchError, CommTimeoutError, ModeNotBoundError, ObjectRefusedError

if TYPE_CHECKING:
    from rlightning_comm.communicators.base import Communicator

_generation = 0


def new_generation() -> None:
    """Start a new key namespace; the context calls it on every world initialisation, so stale keys are never read."""
    global _generation
    _generation += 1


def _tensor(t: Any) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _op(op: Any) -> str:
    op = reduce_op_type(op)  # ReduceOp(ReduceOp.MAX) is MAX, as for the checks
    return str(getattr(op, "name", op))


def _splits(sizes: Any, t: Any, ws: int) -> Any:
    if sizes is not None:
        return [int(n) for n in sizes]
    if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] % ws == 0:
        return [t.shape[0] // ws] * ws
    return None


def _all_to_all_single(a: dict[str, Any], ws: int, mode: str) -> tuple[dict[str, Any], Any]:
    out, inp = a["output"], a["input_"]
    rows = {name: f"{str(t.dtype).removeprefix('torch.')} rows of shape {list(t.shape[1:])}" for name, t in (("output", out), ("input_", inp))}
    return rows, {"out": _splits(a["output_split_sizes"], out, ws), "in": _splits(a["input_split_sizes"], inp, ws)}


def _all_gather_object(a: dict[str, Any], ws: int, mode: str) -> tuple[dict[str, Any], Any]:
    try:  # an object that cannot be pickled fails in the call on its own rank: here every rank learns it first
        pickle.dumps(a["obj"])
    except Exception as err:  # pickle raises many kinds
        raise TypeError(f"all_gather_object on mode {mode!r}: obj cannot be pickled ({err})") from err
    return {"len(object_list)": len(a["object_list"])}, None


def _all_reduce_dict(a: dict[str, Any], ws: int, mode: str) -> tuple[dict[str, Any], Any]:
    # The packing's own order and checks; a number is a number whatever its type (the packing makes no difference either).
    keys, shapes = _packing.describe(a["dictionary"], a["dtype"], mode)
    values = ["number" if shape is None else f"tensor{list(shape)}" for shape in shapes]
    return {"keys": list(map(repr, keys)), "values": values, "op": _op(a["op"]), "dtype": str(a["dtype"])}, None


# Per op: what every rank must agree on, and per-rank data for a cross-rank check (arguments already passed the local checks).
_DESCRIBE: dict[str, Callable[[dict[str, Any], int, str], tuple[dict[str, Any], Any]]] = {
    "all_reduce": lambda a, ws, m: ({"tensor": _tensor(a["tensor"]), "op": _op(a["op"])}, None),
    "all_gather": lambda a, ws, m: ({"output_tensor": _tensor(a["output_tensor"]), "input_tensor": _tensor(a["input_tensor"])}, None),
    "broadcast": lambda a, ws, m: ({"tensor": _tensor(a["tensor"]), "src": repr(a["src"])}, None),
    "gather": lambda a, ws, m: ({"tensor": _tensor(a["tensor"]), "dst": repr(a["dst"])}, None),
    "scatter": lambda a, ws, m: ({"tensor": _tensor(a["tensor"]), "src": repr(a["src"])}, None),
    "reduce_scatter": lambda a, ws, m: ({"output": _tensor(a["output"]), "input_": _tensor(a["input_"]), "op": _op(a["op"])}, None),
    "all_to_all_single": _all_to_all_single,
    "broadcast_object_list": lambda a, ws, m: ({"len(object_list)": len(a["object_list"]), "src": repr(a["src"])}, None),
    "all_reduce_dict": _all_reduce_dict,
    "barrier": lambda a, ws, m: ({}, None),
    "reduce": lambda a, ws, m: ({"tensor": _tensor(a["tensor"]), "dst": repr(a["dst"]), "op": _op(a["op"])}, None),
    "all_gather_object": _all_gather_object,
    # A send and its recv are checked by those two ranks alone (rlightning_comm._debug_p2p).
    "send": lambda a, ws, m: (_debug_p2p.fingerprint(a["tensor"]), None),
    "recv": lambda a, ws, m: (_debug_p2p.fingerprint(a["tensor"]), None),
}
OPS = COLLECTIVES

# The error types a refusal is raised as on every rank (the first of the refusing error's classes found here).
_REFUSALS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (ModeNotBoundError, ObjectRefusedError, CommError, TypeError, ValueError, IndexError, KeyError, NotImplementedError)
}
_GAVE_UP = 1 << 40  # added to a check's arrival count by a rank that timed out: later arrivals know the check is abandoned


def _refusal_type(err: BaseException) -> str:
    return next((cls.__name__ for cls in type(err).__mro__ if cls.__name__ in _REFUSALS and _REFUSALS[cls.__name__] is cls), "CommError")


class _Checker:
    """The store-side state of one communicator's checks.

    Check ``seq`` of a group uses the keys ``seq/n`` (the arrival count),
    ``seq/<group rank>`` (each rank's fingerprint) and ``seq/verdict``. A rank
    counts itself in (``add``) before it posts: a rank that times out adds
    :data:`_GAVE_UP`, so a rank that arrives later sees the check abandoned
    and takes the next sequence number instead, which keeps every rank's
    numbers in step after a failure. The first rank to give up decides for
    all: if every rank had counted itself in by then, the check goes on.
    """

    def __init__(self, comm: Communicator, timeout: float) -> None:
        self.store = dist.PrefixStore(f"rlightning_comm/debug/{_generation}/{comm.group.group_name}", rendezvous.world_store())
        self.timeout = timeout
        self.mode = comm.mode
        self.ranks = comm.ranks
        self.me = comm.rank
        self.seq = 0
        self.done = 0  # keys of checks before this one are no longer read by anyone once a check completes
        self.depth = 0  # > 0 inside a checked call: its inner collectives are not checked again

    def check(self, op: str, fields: dict[str, Any], extra: Any, refusal: BaseException | None) -> None:
        """Exchange this rank's fingerprint; raise on every rank when a rank refused the call or the ranks disagree."""
        while True:
            seq = self.seq
            self.seq += 1
            if self.store.add(f"{seq}/n", 1) < _GAVE_UP:
                break  # counted in; otherwise the others gave this check up before we came: take the next one
        why = None if refusal is None else [_refusal_type(refusal), str(refusal)]
        self.store.set(f"{seq}/{self.me}", json.dumps([op, fields, extra, why]))
        keys = [f"{seq}/{r}" for r in range(len(self.ranks))]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except RuntimeError as err:
            self._give_up(seq, op, keys, err)
        calls = [json.loads(v) for v in self.store.multi_get(keys)]
        self._forget(seq)
        refused = [(self.ranks[r], c[3]) for r, c in enumerate(calls) if c[3] is not None]
        where = f"debug check before collective #{seq} on mode {self.mode!r}"
        if refused:
            text = "; ".join(f"global rank {rank} refused the call: {msg}" for rank, (_, msg) in refused)
            error = _REFUSALS[refused[0][1][0]](f"{where}: {text}. No collective was started; the group is still usable")
            raise error from refusal
        problem = self._disagreement(calls)
        if problem:
            raise CommMismatchError(f"{where}: the ranks disagree: {problem}. No collective was started; the group is still usable")

    def _give_up(self, seq: int, op: str, keys: list[str], err: RuntimeError) -> None:
        """After a timed-out wait: raise ``CommTimeoutError`` unless every rank had counted itself in."""
        count = self.store.add(f"{seq}/n", _GAVE_UP)
        if count < 2 * _GAVE_UP:  # the first to give up decides for everyone
            verdict = "go" if count - _GAVE_UP == len(self.ranks) else "abandoned"
            self.store.set(f"{seq}/verdict", verdict)
        else:
            self.store.wait([f"{seq}/verdict"], timedelta(seconds=max(self.timeout, 30.0)))
            verdict = self.store.get(f"{seq}/verdict").decode()
        if verdict == "go":
            self.store.wait(keys, timedelta(seconds=max(self.timeout, 30.0)))  # all counted in: their fingerprints are on the way
            return
        missing = [self.ranks[r] for r, key in enumerate(keys) if not self.store.check([key])]
        self.store.delete_key(keys[self.me])
        raise CommTimeoutError(
            f"debug check before collective #{seq} ({op}) on mode {self.mode!r}: global ranks {missing} did not reach it "
            f"within {self.timeout:g} s (the group's timeout); a rank skipped a call, is blocked elsewhere or died. "
            "No collective was started; the group is still usable, and a late rank's next call is checked with the others' next one"
        ) from err

    def _forget(self, seq: int) -> None:
        # Every rank has posted `seq`, so each has finished with every earlier check: nobody reads their keys again.
        for old in range(self.done, seq):
            self.store.delete_key(f"{old}/{self.me}")
            if self.me == 0:
                self.store.delete_key(f"{old}/n")
                self.store.delete_key(f"{old}/verdict")
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
        problems = [f"{name}: {self._by_value([c[1].get(name) for c in calls])}" for name in names if len({json.dumps(c[1].get(name)) for c in calls}) > 1]
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
                    bad.append(f"global rank {self.ranks[i]} sends {sent} rows to global rank {self.ranks[j]}, which expects {expected}")
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
            try:
                local_checks(comm, *args, **kwargs)  # the op's own local checks; a refusal goes to every rank
                bound = signature.bind(comm, *args, **kwargs)
                bound.apply_defaults()
                fields, extra = describe(bound.arguments, ws, comm.mode)
            except Exception as err:  # noqa: BLE001 - whatever this rank cannot do, its peers must learn before they wait
                refusal = err
            checker.check(name, fields, extra, refusal)
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
        setattr(comm, name, _debug_p2p.checked(comm, name, pairs) if name in _debug_p2p.OPS else _checked(comm, name, checker))


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
