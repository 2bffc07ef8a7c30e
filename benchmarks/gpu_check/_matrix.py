"""The GPU check's op matrix: every library op x dtype x sync/async x plain/stats/debug mode, each against an oracle.

Written for any group (world size 1 on NCCL, 2 NCCL ranks, 4 gloo ranks with CUDA tensors, gloo on the CPU as a
self-test), any root and any device; the ops are in :mod:`._ops`, the inputs and oracles in :mod:`._case`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import torch

from rlightning_comm import CommContext

from ._case import DTYPES, SP_MODE, Case, Check, compare
from ._cells import Recorder
from ._ops import OPS

__all__ = ["CALLS", "DTYPES", "MODES", "OPS", "SP_MODE", "run_cell", "run_matrix"]

CALLS = ("sync", "async")
MODES = ("plain", "stats", "debug")


def _verdict(checks: list[Check]) -> tuple[str, str] | None:
    problems = []
    for label, got, want in checks:
        if isinstance(got, bool):
            if not got:
                problems.append(str(want))
        else:
            problem = compare(label, got, want)
            if problem:
                problems.append(problem)
    return ("wrong", "; ".join(problems)[:1500]) if problems else None


def _counted(mode: str, op: str) -> tuple[str, str] | None:
    """Whether stats counted ``op``: an async call's completion may be seen a moment after ``wait()`` (a watcher thread
    polls works without a future)."""
    for _ in range(40):
        entry = CommContext().stats().get(mode, {}).get(op) or {}
        if entry.get("count", 0) >= 1:
            return None
        time.sleep(0.05)
    return "wrong", f"stats did not count {op} on {mode} within 2 s: {entry}"


def run_cell(c: Case, fn: Callable[[Case], list[Check]], in_mode: str, counted: str | None) -> tuple[str, str] | None:
    """One call of ``fn`` in plain, stats or debug mode; the verdict on its results (and stats' count)."""
    ctx = CommContext()
    if in_mode == "stats":
        ctx.reset_stats()
        ctx.enable_stats()
    elif in_mode == "debug":
        ctx.set_debug(True)
    try:
        verdict = _verdict(fn(c))
        if verdict is None and in_mode == "stats" and counted:
            verdict = _counted(c.mode, counted)
        return verdict
    finally:
        if in_mode == "stats":
            ctx.disable_stats()
            ctx.reset_stats()
        elif in_mode == "debug":
            ctx.set_debug(False)


def run_matrix(
    rec: Recorder,
    mode: str,
    device: torch.device,
    root: int,
    *,
    ops: Sequence[str] | None = None,
    dtypes: Sequence[str] | None = None,
    calls: Sequence[str] = CALLS,
    modes: Sequence[str] = MODES,
    prefix: str = "",
) -> None:
    """Every cell of ``ops`` x ``dtypes`` x ``calls`` x ``modes`` on ``mode``'s group.

    For the sequence-parallel ops, SEQUENCE_PARALLEL is first bound to the mode's ranks with the mode's backend (a cell
    of its own), unless bound already. A cell's name is ``prefix + "op|dtype|call|mode"`` (dtype ``-`` for an op without
    one).
    """
    ctx = CommContext()
    ops = list(ops or OPS)
    if any(op.startswith("sp.") for op in ops) and SP_MODE not in ctx.bound_modes():
        ranks, backend = list(ctx.get_communicator(mode).ranks), ctx.get_group_config(mode).backend
        rec.run(
            f"{prefix}init_group({ranks}, {SP_MODE})",
            functools.partial(ctx.init_group, ranks, SP_MODE, backend=backend),
        )
    for op in ops:
        fn, typed, has_async, counted = OPS[op]
        for dtype_name in (dtypes or DTYPES) if typed else ("-",):
            for call in calls if has_async else ("sync",):
                for in_mode in modes:
                    case = functools.partial(
                        Case, mode, device, DTYPES.get(dtype_name, torch.float32), root, call
                    )  # built inside the cell: its errors are the cell's
                    fields = {"op": op, "dtype": dtype_name, "call": call, "mode": in_mode}
                    rec.run(
                        f"{prefix}{op}|{dtype_name}|{call}|{in_mode}",
                        functools.partial(_cell, case, fn, in_mode, counted),
                        **fields,
                    )


def _cell(
    case: Callable[[], Case], fn: Callable[[Case], list[Check]], in_mode: str, counted: str | None
) -> tuple[str, str] | None:
    return run_cell(case(), fn, in_mode, counted)
