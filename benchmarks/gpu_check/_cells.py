"""The GPU check's cells: one rank's record of what each call gave, kept even when the rank hangs or dies.

A cell is one call of one configuration (an op, a dtype, sync or async, plain, stats or debug mode; or one probe). Its
status:

* ``ok``: it ran and every result equals the oracle (computed on the CPU from every rank's inputs, not by the library);
* ``wrong``: it ran and a result differs (the detail shows both);
* ``refused``: the library's own local check raised ``TypeError`` / ``ValueError`` (a documented refusal, e.g. a
  reduction NCCL lacks);
* ``backend_refused``: the backend's own check refused it (the library says so);
* ``error``: any other exception (type and message kept);
* ``differs``: a probe observed something other than what the docs state;
* ``observed``: a probe's measurement with nothing to compare against;
* ``n/a``: the configuration does not apply (a send at world size 1);
* ``skipped``: not run (no time left, or the group fell out of step).

Each rank appends a ``start`` line before a cell and the cell after it to a JSON-lines file, flushed at once: a cell
that started and never finished is where a rank hung or died, which the parent reports.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from rlightning_comm import ObjectRefusedError

FAILING = ("wrong", "error", "differs")
"""Statuses that make a step FAIL."""

_LIBRARY = os.sep + "rlightning_comm" + os.sep


class NotApplicable(Exception):
    """Raised by a cell that does not apply to this configuration; recorded as ``n/a`` with the message."""


class OutOfStep(Exception):
    """The ranks of a multi-rank run disagree on how a cell ended (or a peer did not report): the rest of the run is
    skipped."""


def _may_break(err: BaseException) -> bool:
    """Whether ``err`` may leave a collective half-done: a failed collective or a broken device (not a refusal, not a
    receiver's unpickling)."""
    return isinstance(err, RuntimeError) and not isinstance(err, ObjectRefusedError)


def classify(err: BaseException) -> tuple[str, str]:
    """The status and detail of a cell that raised ``err``: a library refusal, a backend refusal, or an error."""
    text = f"{type(err).__name__}: {err}"[:1500]
    if isinstance(err, NotApplicable):
        return "n/a", str(err)
    if "refused by the backend's own check" in str(err):
        return "backend_refused", text
    frames = traceback.extract_tb(err.__traceback__)
    raised_by_library = bool(frames) and _LIBRARY in frames[-1].filename
    if isinstance(err, (TypeError, ValueError)) and raised_by_library:
        return "refused", text
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return "error", text + where


class Recorder:
    """One rank's cells, in memory and (with ``path``) appended to a JSON-lines file as they start and end.

    Args:
        path: The file to append to, or ``None`` (kept in memory only).
        rank: This process's global rank, written into every line.
        deadline: Wall-clock time (``time.time()``) after which cells are skipped as "no time left".
        lockstep: For multi-rank runs, how ranks agree after each cell (see :class:`Lockstep`).
    """

    def __init__(
        self, path: str | None = None, rank: int = 0, deadline: float | None = None, lockstep: Lockstep | None = None
    ) -> None:
        self.path = path
        self.rank = rank
        self.deadline = deadline
        self.lockstep = lockstep
        self.cells: list[dict[str, Any]] = []
        self.stopped: str | None = None  # why the remaining cells are skipped

    def _write(self, line: dict[str, Any]) -> None:
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line, default=str) + "\n")  # closed at once: a rank that dies later loses nothing

    def note(self, **fields: Any) -> None:
        """A line that is not a cell (the environment, a probe's event), with the wall time."""
        self._write({"event": "note", "rank": self.rank, "t": time.time(), **fields})

    def record(self, name: str, status: str, detail: str = "", **fields: Any) -> dict[str, Any]:
        """Record a finished cell."""
        cell = {"cell": name, "rank": self.rank, "status": status, "detail": detail, **fields}
        self.cells.append(cell)
        self._write({"event": "cell", "t": time.time(), **cell})
        return cell

    def time_left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.time()

    def run(self, name: str, fn: Callable[[], Any], min_s: float = 1.0, **fields: Any) -> dict[str, Any]:
        """Run one cell: ``fn()`` returns ``(status, detail)``, or anything else for ok; an exception is classified.

        Skipped without calling ``fn`` when the run stopped or less than ``min_s`` seconds are left. With a lockstep,
        every rank then learns how the cell ended everywhere; a disagreement stops the run.
        """
        if self.stopped:
            return self.record(name, "skipped", self.stopped, **fields)
        if min_s > 0 and self.time_left() < min_s:
            return self.record(name, "skipped", "no time left", **fields)
        self._write({"event": "start", "rank": self.rank, "t": time.time(), "cell": name})
        started = time.perf_counter()
        try:
            out = fn()
            status, detail = out if isinstance(out, tuple) else ("ok", "")
            raised = ""
        except Exception as err:  # noqa: BLE001 - every outcome of a cell is recorded, the next cell still runs
            status, detail = classify(err)
            raised = "" if status == "n/a" else ("!" if _may_break(err) else "") + type(err).__name__
        cell = self.record(name, status, detail, seconds=round(time.perf_counter() - started, 4), **fields)
        if self.lockstep is not None:
            try:
                self.lockstep.agree(name, raised)
            except OutOfStep as err:
                self.stopped = str(err)
                self.note(out_of_step=str(err))
        return cell


class Lockstep:
    """After each cell, every rank posts how it ended (nothing raised, or the exception type) through a store, and reads
    the others'.

    A cell that raised the same way on every rank (a refusal every rank makes, or that debug mode told every rank)
    leaves the ranks in step, and so does one that raised something other than a ``RuntimeError`` on some ranks only (a
    receiver that cannot unpickle what arrived, a check of this script). A ``RuntimeError`` (a failed collective, a
    timeout, a CUDA error) on some ranks only, or a peer that does not report within ``timeout`` seconds, may leave a
    collective half-entered: the run stops.

    Args:
        store: A ``torch.distributed.Store`` every rank of the run shares.
        rank: This rank's index in the run.
        size: Number of ranks.
        timeout: How long to wait for the peers' reports, in seconds.
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: float) -> None:
        self.store = store
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self._count = 0

    def agree(self, name: str, raised: str) -> None:
        """Post ``raised`` for cell ``name`` and compare with every rank's.

        Raises:
            OutOfStep: a peer did not report in time, or the ranks ended the cell differently.
        """
        self._count += 1
        keys = [f"lockstep/{self._count}/{j}" for j in range(self.size)]
        self.store.set(keys[self.rank], raised or "-")
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except Exception as err:
            raise OutOfStep(
                f"a peer did not report cell {name!r} within {self.timeout:g} s ({type(err).__name__}); the rest of "
                "the run is skipped"
            ) from err
        outcomes = [self.store.get(k).decode() for k in keys]
        if len(set(outcomes)) > 1 and any(o.startswith("!") for o in outcomes):
            raise OutOfStep(
                f"cell {name!r} ended differently on the ranks ({outcomes}; '-': nothing raised, '!': a failed "
                "collective or device error): "
                "the groups may be out of step, the rest is skipped"
            )


def counts(cells: list[dict[str, Any]]) -> dict[str, int]:
    """How many cells have each status."""
    out: dict[str, int] = {}
    for cell in cells:
        out[cell["status"]] = out.get(cell["status"], 0) + 1
    return dict(sorted(out.items()))
