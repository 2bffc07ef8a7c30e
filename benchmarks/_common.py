"""Shared by the benchmark scripts: spawn local gloo ranks on a file store, collect rank 0's result.

``--netlab RATE`` on any benchmark's command line (taken off ``sys.argv`` here, before the benchmark parses its own
options) runs each rank on a host of its own in the network lab (``benchmarks/netlab``, needs root), every host's link
shaped to ``RATE`` (``1gbit``, ``2500mbit``) in each direction; the lab and its calibrated rate are printed first.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))


def _take_netlab_option(argv: list[str]) -> str | None:
    """The rate of ``--netlab RATE`` (or ``--netlab=RATE``) in ``argv``, removed from it; ``None`` without one."""
    for i, arg in enumerate(argv):
        if arg == "--netlab" and i + 1 < len(argv):
            rate = argv[i + 1]
            del argv[i : i + 2]
            return rate
        if arg.startswith("--netlab="):
            del argv[i]
            return arg.partition("=")[2]
    return None


NETLAB_RATE = _take_netlab_option(sys.argv)
"""The lab's rate (``--netlab``), or ``None``: the ranks on loopback."""

_labs: dict[int, Any] = {}
_lab_stack = contextlib.ExitStack()
atexit.register(_lab_stack.close)


def _lab(hosts: int) -> Any:
    """The lab of ``hosts`` hosts at ``NETLAB_RATE``, built (and calibrated, printed) on first use, removed at exit."""
    if hosts not in _labs:
        from benchmarks.netlab import Lab, calibrate, parse_rate

        lab = _labs[hosts] = _lab_stack.enter_context(Lab(hosts, parse_rate(NETLAB_RATE)))
        print(f"# {lab.describe()}", flush=True)
        if hosts > 1:
            print(f"# {calibrate(lab, 0, 1)}; {calibrate(lab, 1, 0)}", flush=True)
    return _labs[hosts]


class _Failed(str):
    """A rank's traceback, in place of its result."""


def _worker(
    fn: Callable[..., Any],
    rank: int,
    nproc: int,
    url: str,
    args: tuple[Any, ...],
    results: Any,
    backend: str,
    own_worlds: bool,
) -> None:
    os.environ["LOCAL_RANK"] = str(rank)  # the nccl communicator picks its GPU from it
    from rlightning_comm import CommContext

    ctx = CommContext()
    if own_worlds:  # a world of one per rank, each with its own store
        ctx.init_distributed_env(world_size=1, rank=0, backend=backend, dist_url=f"{url}{rank}", timeout=300)
    else:
        ctx.init_distributed_env(world_size=nproc, rank=rank, backend=backend, dist_url=url, timeout=300)
    try:
        results.put((rank, fn(rank, nproc, *args)))
    except BaseException:  # noqa: BLE001 - send the traceback to the parent instead of leaving it waiting
        import traceback

        results.put((rank, _Failed(traceback.format_exc())))
    finally:
        ctx.destroy()


def run_ranks(
    fn: Callable[..., Any],
    nproc: int = 2,
    *args: Any,
    timeout: float = 600,
    backend: str = "gloo",
    own_worlds: bool = False,
) -> list[Any]:
    """Run ``fn(rank, nproc, *args)`` on ``nproc`` spawned ranks (gloo unless told); return the results in rank order.

    With ``own_worlds`` each rank is in a world of its own (of size 1) instead of all in one world of ``nproc``. With
    ``--netlab RATE``, rank ``r`` runs on host ``r`` of a lab of ``nproc`` hosts (gloo on the lab's interface).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tempfile.mkdtemp(prefix="rlc-benchmark-")
    lab = _lab(nproc) if NETLAB_RATE else None
    procs = []
    for r in range(nproc):
        worker_args = (fn, r, nproc, f"file://{store}/store", args, results, backend, own_worlds)
        if lab is None:
            procs.append(ctx.Process(target=_worker, args=worker_args))
        else:
            procs.append(lab.process(r, _worker, *worker_args, context=ctx))
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


def print_speed_table(times: dict[str, list[float]], identical: dict[str, bool]) -> None:
    """A markdown table of each way's median and min time and its speed against the ``"limit"`` way (median of per-round
    ratios)."""
    print("| way | median ms | min ms | speed vs limit (median of per-round ratios) | bit-identical |")
    print("|---|---|---|---|---|")
    for name, samples in times.items():
        ratio = statistics.median(lim / t for lim, t in zip(times["limit"], samples))
        same = "-" if name == "limit" else ("yes" if identical[name] else "NO")
        print(f"| {name} | {statistics.median(samples) * 1e3:.1f} | {min(samples) * 1e3:.1f} | {ratio:.2f}x | {same} |")


def machine() -> str:
    """One line on where the figures come from."""
    import platform

    import torch

    cores = f"{os.cpu_count()} CPU cores ({platform.machine()})"
    where = f"; ranks on lab hosts, links at {NETLAB_RATE} each" if NETLAB_RATE else ""
    return f"{cores}, torch {torch.__version__}, python {platform.python_version()}{where}"
