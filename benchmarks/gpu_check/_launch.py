"""The GPU check's processes: every rank and every command in its own session, bounded, killed by process group.

A rank or a command that hangs is killed with its whole process group (the bench's and pytest's own spawned ranks with
it) at its deadline, and waited for, so nothing of one step holds the GPU during the next. A rank's cells survive its
death: they are read back from its JSON-lines file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .._common import ROOT
from ._cells import FAILING, counts

RANK_MODULE = f"{__package__}._rank"
"""The rank program, run as ``python -m`` from the checkout: its relative imports need the package."""
_TAIL = 4000


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment, with the checkout (and so this package) importable first, plus ``extra``."""
    env = dict(os.environ)
    paths = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


LIVE: set[subprocess.Popen] = set()
"""Every process started here and not yet reaped: :func:`kill_all` ends them if the check itself is stopped."""


def kill_all() -> None:
    """Kill every process group still running (the check was interrupted): nothing is left holding the GPU."""
    for proc in list(LIVE):
        _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (it leads its own session: its own children too), then reap it.

    Also called once ``proc`` has exited, for children it left behind; the group's id cannot be reused while any of them
    lives.
    """
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=15)
        LIVE.discard(proc)
    except subprocess.TimeoutExpired:
        pass


def _tail(path: Path, limit: int = _TAIL) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", errors="replace")


def read_cells(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str | None]:
    """A rank's finished cells, its notes, and the cell it started but never finished (where it hung or died)."""
    cells, notes, started = [], [], None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return [], [], None
    for line in lines:
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        event = item.pop("event", None)
        if event == "start":
            started = item["cell"]
        elif event == "cell":
            cells.append(item)
            started = None
        elif event == "note":
            notes.append(item)
    return cells, notes, started


class Launch:
    """One run of the rank program on ``size`` processes (``python -m benchmarks.gpu_check._rank SPEC RANK``).

    Args:
        name: The run's name (file names, the report).
        spec: What the rank program runs (JSON-able); ``deadline`` is added.
        size: Number of ranks.
        out: Folder for the cells, logs and stores.
        timeout: Seconds from :meth:`start` until every rank still alive is killed.
        env: Extra environment per rank, ``env(rank) -> dict``.
        grace_s: After a rank exits with an error, how long the others get before they are killed.
        dies: Ranks that end themselves on purpose (any exit status is theirs to give).
    """

    def __init__(
        self,
        name: str,
        spec: dict[str, Any],
        size: int,
        out: Path,
        timeout: float,
        env: Any = None,
        grace_s: float = 10.0,
        dies: tuple[int, ...] = (),
    ) -> None:
        self.name = name
        self.spec = dict(spec)
        self.size = size
        self.dir = out / name
        self.timeout = timeout
        self.env = env or (lambda rank: {})
        self.grace_s = grace_s
        self.dies = set(dies)
        self.procs: list[subprocess.Popen] = []
        self.started = 0.0

    def start(self) -> Launch:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "store").mkdir(exist_ok=True)
        self.started = time.time()
        kill_at = self.started + self.timeout
        spec = {
            **self.spec,
            "nproc": self.size,
            "store": str(self.dir / "store"),
            "cells": str(self.dir / "rank{rank}.jsonl"),
            "kill_at": kill_at,
        }
        for rank in range(self.size):
            log = open(self.dir / f"rank{rank}.log", "wb")  # noqa: SIM115 - the child writes it; closed once the child is started
            env = child_env({"GPU_CHECK_RANK": str(rank), **self.env(rank)})
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", RANK_MODULE, json.dumps(spec), str(rank)],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            log.close()
            LIVE.add(self.procs[-1])
        return self

    def wait(self) -> dict[str, Any]:
        """Wait for every rank (killing what is left at the deadline, or ``grace_s`` after a rank failed); the run's
        report."""
        ended: dict[int, float] = {}
        deadline = self.started + self.timeout
        killed: set[int] = set()
        while len(ended) < self.size:
            now = time.time()
            for rank, proc in enumerate(self.procs):
                if rank not in ended and proc.poll() is not None:
                    ended[rank] = now
                    _kill(proc)  # whatever it left behind
                    if proc.returncode != 0 and rank not in self.dies:
                        deadline = min(deadline, now + self.grace_s)
            if now >= deadline:
                for rank, proc in enumerate(self.procs):
                    if rank not in ended:
                        _kill(proc)
                        killed.add(rank)
                        ended[rank] = time.time()
                break
            time.sleep(0.05)
        return self._report(ended, killed)

    def _report(self, ended: dict[int, float], killed: set[int]) -> dict[str, Any]:
        ranks, cells, notes = [], [], []
        for rank, proc in enumerate(self.procs):
            rank_cells, rank_notes, unfinished = read_cells(self.dir / f"rank{rank}.jsonl")
            cells += rank_cells
            notes += rank_notes
            code = proc.returncode
            ranks.append(
                {
                    "rank": rank,
                    "exit": code,
                    "signal": signal.Signals(-code).name
                    if code is not None and code < 0 and -code in signal.Signals._value2member_map_
                    else None,
                    "killed_at_deadline": rank in killed,
                    "ended_s": round(ended[rank] - self.started, 2),
                    "ended_at": ended[rank],
                    "unfinished_cell": unfinished,
                    "log_tail": _tail(self.dir / f"rank{rank}.log") if code != 0 or unfinished else "",
                }
            )
        if killed:
            status = "timeout"
        elif any(r["exit"] != 0 and r["rank"] not in self.dies for r in ranks):
            status = "crashed"
        else:
            status = "ok"
        return {
            "run": self.name,
            "status": status,
            "seconds": round(max(ended.values(), default=self.started) - self.started, 2),
            "timeout_s": round(self.timeout, 1),
            "counts": counts(cells),
            "failing": [
                f"rank {c['rank']}: {c['cell']}: {c['status']}: {c['detail'][:300]}"
                for c in cells
                if c["status"] in FAILING
            ][:40],
            "ranks": ranks,
            "notes": notes,
            "cells": cells,
        }


def run_command(
    name: str, argv: list[str], out: Path, timeout: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run a command in its own session with its output in ``out/name.log``; kill its process group at ``timeout``."""
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / f"{name}.log"
    started = time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=child_env(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        LIVE.add(proc)
        try:
            proc.wait(timeout=timeout)
            killed = False
        except subprocess.TimeoutExpired:
            killed = True
        _kill(proc)  # at the deadline, or what a finished command left behind (a hung spawned rank)
    return {
        "argv": argv,
        "exit": proc.returncode,
        "killed_at_deadline": killed,
        "seconds": round(time.time() - started, 2),
        "log": str(log_path),
        "log_tail": _tail(log_path),
    }
