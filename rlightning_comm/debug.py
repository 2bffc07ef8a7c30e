"""Debug mode: before each collective the ranks of the group compare what they are about to do.

:func:`enable` shadows the collectives of one communicator with instance
attributes that first exchange a fingerprint of the call (op, shapes, dtypes,
reduce op, src/dst, dictionary keys, split sizes, and a per-group sequence
number) through the world's store, then compare them. A disagreement raises
:class:`CommMismatchError` on every rank of the group before any collective
starts, so the group stays usable; a rank that does not arrive within the
group's timeout makes the others raise :class:`CommTimeoutError` naming it.
:func:`disable` removes the attributes, so a communicator that never had debug
mode on runs exactly the class's code: no wrapper, no store traffic.

Each check costs a few store round trips (one set, one wait, one multi-get,
one delete per rank): a debugging aid, not something to leave on in a long run.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rlightning_comm import rendezvous
from rlightning_comm.communicators.base import COLLECTIVES
from rlightning_comm.errors import CommMismatchError, CommTimeoutError

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
    return str(getattr(op, "name", op))


def _value(v: Any) -> Any:
    return _tensor(v) if isinstance(v, torch.Tensor) else type(v).__name__


def _splits(sizes: Any, t: Any, ws: int) -> Any:
    if sizes is not None:
        return [int(n) if isinstance(n, int) else repr(n) for n in sizes]
    if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] % ws == 0:
        return [t.shape[0] // ws] * ws
    return None


def _all_to_all_single(a: dict[str, Any], ws: int) -> tuple[dict[str, Any], Any]:
    out, inp = a["output"], a["input_"]
    rows = {
        name: f"{str(t.dtype).removeprefix('torch.')} rows of shape {list(t.shape[1:])}" if isinstance(t, torch.Tensor) else type(t).__name__
        for name, t in (("output", out), ("input_", inp))
    }
    return rows, {"out": _splits(a["output_split_sizes"], out, ws), "in": _splits(a["input_split_sizes"], inp, ws)}


def _all_reduce_dict(a: dict[str, Any], ws: int) -> tuple[dict[str, Any], Any]:
    d = a["dictionary"]
    try:
        items = sorted((repr(k), _value(v)) for k, v in d.items())
    except AttributeError:
        return {"dictionary": type(d).__name__}, None
    return {"keys": [k for k, _ in items], "values": [v for _, v in items], "op": _op(a["op"]), "dtype": str(a["dtype"])}, None


# Per op: what every rank must agree on, and per-rank data for a cross-rank check.
_DESCRIBE: dict[str, Callable[[dict[str, Any], int], tuple[dict[str, Any], Any]]] = {
    "all_reduce": lambda a, ws: ({"tensor": _tensor(a["tensor"]), "op": _op(a["op"])}, None),
    "all_gather": lambda a, ws: ({"output_tensor": _tensor(a["output_tensor"]), "input_tensor": _tensor(a["input_tensor"])}, None),
    "broadcast": lambda a, ws: ({"tensor": _tensor(a["tensor"]), "src": repr(a["src"])}, None),
    "gather": lambda a, ws: ({"tensor": _tensor(a["tensor"]), "dst": repr(a["dst"])}, None),
    "scatter": lambda a, ws: ({"tensor": _tensor(a["tensor"]), "src": repr(a["src"])}, None),
    "reduce_scatter": lambda a, ws: ({"output": _tensor(a["output"]), "input_": _tensor(a["input_"]), "op": _op(a["op"])}, None),
    "all_to_all_single": _all_to_all_single,
    "broadcast_object_list": lambda a, ws: (
        {"len(object_list)": len(a["object_list"]) if isinstance(a["object_list"], list) else None, "src": repr(a["src"])},
        None,
    ),
    "all_reduce_dict": _all_reduce_dict,
    "barrier": lambda a, ws: ({}, None),
}
OPS = COLLECTIVES


class _Checker:
    """The store-side state of one communicator's checks."""

    def __init__(self, comm: Communicator, timeout: float) -> None:
        self.store = dist.PrefixStore(f"rlightning_comm/debug/{_generation}/{comm.group.group_name}", rendezvous.world_store())
        self.timeout = timeout
        self.mode = comm.mode
        self.ranks = comm.ranks
        self.me = comm.rank
        self.seq = 0
        self.depth = 0  # > 0 inside a checked call: its inner collectives are not checked again

    def check(self, op: str, fields: dict[str, Any], extra: Any) -> None:
        seq = self.seq
        self.seq += 1
        self.store.set(f"{seq}/{self.me}", json.dumps([op, fields, extra]))
        keys = [f"{seq}/{r}" for r in range(len(self.ranks))]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except RuntimeError as err:
            missing = [self.ranks[r] for r, key in enumerate(keys) if not self.store.check([key])]
            raise CommTimeoutError(
                f"debug check before collective #{seq} ({op}) on mode {self.mode!r}: global ranks {missing} did not reach it "
                f"within {self.timeout:g} s (the group's timeout); a rank skipped a call, is blocked elsewhere or died"
            ) from err
        calls = [json.loads(v) for v in self.store.multi_get(keys)]
        if seq:
            # Every rank posted `seq` after reading all of `seq - 1`: nobody needs our old key now.
            self.store.delete_key(f"{seq - 1}/{self.me}")
        problem = self._disagreement(calls)
        if problem:
            raise CommMismatchError(
                f"debug check before collective #{seq} on mode {self.mode!r}: the ranks disagree: {problem}. "
                "No collective was started; the group is still usable"
            )

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
    signature = inspect.signature(method)
    describe = _DESCRIBE[name]
    ws = comm.world_size

    @functools.wraps(method)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if checker.depth:
            return method(comm, *args, **kwargs)
        comm._active_group()  # refuse a second thread before anything is exchanged
        try:
            bound = signature.bind(comm, *args, **kwargs)
        except TypeError:
            return method(comm, *args, **kwargs)  # raises the same TypeError locally
        bound.apply_defaults()
        try:
            fields, extra = describe(bound.arguments, ws)
        except Exception:  # noqa: BLE001 - malformed arguments: the peers still learn that this rank cannot proceed
            fields, extra = {"arguments": "malformed"}, None
        checker.check(name, fields, extra)
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
    for name in OPS:
        setattr(comm, name, _checked(comm, name, checker))


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
