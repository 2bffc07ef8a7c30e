"""What debug mode compares of each collective call: per op, what every rank of the group must agree on (shapes,
dtypes, reduce op, root, keys, split sizes) and per-rank data for a cross-rank check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlightning_comm.communicators import _objects, _packing
from rlightning_comm.communicators._checks import reduce_op_type
from rlightning_comm.debug import _p2p as _debug_p2p


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
    rows = {
        name: f"{str(t.dtype).removeprefix('torch.')} rows of shape {list(t.shape[1:])}"
        for name, t in (("output", out), ("input_", inp))
    }
    return rows, {"out": _splits(a["output_split_sizes"], out, ws), "in": _splits(a["input_split_sizes"], inp, ws)}


def _all_gather_object(a: dict[str, Any], ws: int, mode: str) -> tuple[dict[str, Any], Any]:
    try:  # an object that cannot be pickled fails in the call on its own rank: here every rank learns it first
        _objects.dumps(a["obj"])
    except Exception as err:  # pickle raises many kinds
        raise TypeError(f"all_gather_object on mode {mode!r}: obj cannot be pickled ({err})") from err
    return {"len(object_list)": len(a["object_list"])}, None


def _all_reduce_dict(a: dict[str, Any], ws: int, mode: str) -> tuple[dict[str, Any], Any]:
    # The packing's own order and checks; a number is a number whatever its type (the packing makes no difference
    # either).
    keys, shapes = _packing.describe(a["dictionary"], a["dtype"], mode)
    values = ["number" if shape is None else f"tensor{list(shape)}" for shape in shapes]
    return {"keys": list(map(repr, keys)), "values": values, "op": _op(a["op"]), "dtype": str(a["dtype"])}, None


# Per op: what every rank must agree on, and per-rank data for a cross-rank check (arguments already passed the local
# checks).
DESCRIBE: dict[str, Callable[[dict[str, Any], int, str], tuple[dict[str, Any], Any]]] = {
    "all_reduce": lambda a, ws, m: ({"tensor": _tensor(a["tensor"]), "op": _op(a["op"])}, None),
    "all_gather": lambda a, ws, m: (
        {"output_tensor": _tensor(a["output_tensor"]), "input_tensor": _tensor(a["input_tensor"])},
        None,
    ),
    "broadcast": lambda a, ws, m: ({"tensor": _tensor(a["tensor"]), "src": repr(a["src"])}, None),
    "gather": lambda a, ws, m: ({"tensor": _tensor(a["tensor"]), "dst": repr(a["dst"])}, None),
    "scatter": lambda a, ws, m: ({"tensor": _tensor(a["tensor"]), "src": repr(a["src"])}, None),
    "reduce_scatter": lambda a, ws, m: (
        {"output": _tensor(a["output"]), "input_": _tensor(a["input_"]), "op": _op(a["op"])},
        None,
    ),
    "all_to_all_single": _all_to_all_single,
    "broadcast_object_list": lambda a, ws, m: (
        {"len(object_list)": len(a["object_list"]), "src": repr(a["src"])},
        None,
    ),
    "all_reduce_dict": _all_reduce_dict,
    "barrier": lambda a, ws, m: ({}, None),
    "reduce": lambda a, ws, m: ({"tensor": _tensor(a["tensor"]), "dst": repr(a["dst"]), "op": _op(a["op"])}, None),
    "all_gather_object": _all_gather_object,
    # A send and its recv are checked by those two ranks alone (rlightning_comm.debug._p2p).
    "send": lambda a, ws, m: (_debug_p2p.fingerprint(a["tensor"]), None),
    "recv": lambda a, ws, m: (_debug_p2p.fingerprint(a["tensor"]), None),
}
