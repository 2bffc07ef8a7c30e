"""Shared by the benchmark scripts: spawn local gloo ranks on a file store, collect rank 0's result."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))


class _Failed(str):
    """A rank's traceback, in place of its result."""


def _worker(fn: Callable[..., Any], rank: int, nproc: int, url: str, args: tuple[Any, ...], results: Any, backend: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank)  # the nccl communicator picks its GPU from it
    from rlightning_comm import CommContext

    ctx = CommContext()
    ctx.init_distributed_env(world_size=nproc, rank=rank, backend=backend, dist_url=url, timeout=300)
    try:
        results.put((rank, fn(rank, nproc, *args)))
    except BaseException:  # noqa: BLE001 - send the traceback to the parent instead of leaving it waiting
        import traceback

        results.put((rank, _Failed(traceback.format_exc())))
    finally:
        ctx.destroy()


def run_ranks(fn: Callable[..., Any], nproc: int = 2, *args: Any, timeout: float = 600, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, nproc, *args)`` on ``nproc`` spawned ranks (gloo unless told); return the results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tempfile.mkdtemp(prefix="rlc-benchmark-")
    procs = [ctx.Process(target=_worker, args=(fn, r, nproc, f"file://{store}/store", args, results, backend)) for r in range(nproc)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(nproc):
            rank, value = results.get(timeout=timeout)
            if isinstance(value, _Failed):
                raise RuntimeError(f"rank {rank} failed:\n{value}")  # noqa: TRY004 - a failed rank, not a bad type
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(nproc)]


def machine() -> str:
    """One line on where the figures come from."""
    import platform

    import torch

    return f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}, python {platform.python_version()}"
