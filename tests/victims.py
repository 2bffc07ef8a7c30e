"""Kill tests over a connected mode, round after round: a victim process per round, killed at its point, the survivors
re-forming the mode with the next one.

The survivors are the ranks of a spawned world; the victims are processes of their own (a world's rank cannot die
without the world being respawned), all started up front by rank 0, since starting one (importing torch) takes seconds
on a loaded machine. The rounds keep step through the mode's store: a victim says it is ready, rank 0 opens its round
once it is, and the victim leaves (tears its context down, if still alive) only once every survivor is done with the
round. Every wait is bounded; a victim still running at the end is killed by its pid.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def _store(address: str, timeout: float) -> dist.TCPStore:
    host, port = address.split("/")[0].rsplit(":", 1)  # listen() returns host:port/secret
    return dist.TCPStore(host, int(port), None, False, timedelta(seconds=timeout))


class Rounds:
    """On every rank of the world: the mode's address (rank 0 listens) and the rounds' order; on rank 0, the victims.

    Args:
        ctx: This rank's context (a world initialised).
        rank: This rank in the world.
        module: The test module whose ``_victim(address, round_)`` each victim process runs.
        count: How many rounds (one victim each).
        prefix: The store keys' prefix, one per test.
    """

    def __init__(self, ctx: Any, rank: int, module: str, count: int, prefix: str) -> None:
        box = [ctx.listen("127.0.0.1:0") if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        self.address: str = box[0]
        self._rank, self._prefix = rank, prefix
        self._store = _store(self.address, 200)
        self._victims: list[subprocess.Popen] = []
        if rank == 0:
            run = f"import sys; sys.path[:0] = {sys.path!r}; import {module} as t; t._victim({self.address!r}, "
            self._victims = [subprocess.Popen([sys.executable, "-c", f"{run}{k})"]) for k in range(count)]

    def open(self, k: int) -> None:
        """Wait until round ``k``'s victim is ready (it may still be importing torch), then open the round."""
        if self._rank == 0:
            self._store.wait([f"{self._prefix}/ready/{k}"], timedelta(seconds=180))
            self._store.set(f"{self._prefix}/go/{k}", "1")
        self._store.wait([f"{self._prefix}/go/{k}"], timedelta(seconds=200))

    def close(self, k: int) -> int | None:
        """Once every survivor is done with round ``k``: let its victim go; on rank 0 its exit code (``-9``: killed)."""
        dist.barrier()
        if self._rank != 0:
            return None
        self._store.set(f"{self._prefix}/done/{k}", "1")
        self._victims[k].wait(timeout=60)
        return self._victims[k].returncode

    def __enter__(self) -> Rounds:
        return self

    def __exit__(self, *exc: object) -> None:
        for v in self._victims:
            if v.poll() is None:
                v.kill()  # by its pid: ours
                v.wait(timeout=10)


@contextlib.contextmanager
def victim_round(address: str, prefix: str, k: int) -> Iterator[None]:
    """In a victim: say it is ready, wait for round ``k`` to open; on leaving, wait until the survivors are done."""
    store = _store(address, 120)
    store.set(f"{prefix}/ready/{k}", "1")  # torch and the library are imported: it joins within the mode's timeout
    store.wait([f"{prefix}/go/{k}"], timedelta(seconds=240))
    try:
        yield
    finally:
        store.wait([f"{prefix}/done/{k}"], timedelta(seconds=240))
