"""Run a function on N ranks: under torchrun as launched, or on local spawned processes with no launcher."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from rlightning_comm.context import CommContext
from rlightning_comm.rendezvous import pin_gloo_to_loopback

_FAILURE_GRACE = 3.0


def under_launcher() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets ``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _rank_main(fn: Callable[..., Any], args: tuple[Any, ...], rank: int, world_size: int, backend: str, url: str, timeout: float, local: bool = False) -> None:
    if local:
        pin_gloo_to_loopback()  # every peer is on this host: nothing needs to listen beyond loopback
    ctx = CommContext()
    ctx.init_distributed_env(world_size=world_size, rank=rank, backend=backend, dist_url=url, timeout=timeout)
    try:
        fn(*args)
    finally:
        ctx.destroy()


def run(fn: Callable[..., Any], nproc: int = 4, *args: Any, backend: str = "gloo", timeout: float = 300) -> None:
    """Run ``fn(*args)`` on every rank with the context initialised.

    Under torchrun, this process is one rank: the context is initialised from
    the launcher's environment (``env://``) and ``nproc`` is ignored. With no
    launcher, ``nproc`` local processes are spawned and rendezvous through a
    file store in a private temporary folder, and gloo listens on the loopback
    interface (unless ``GLOO_SOCKET_IFNAME`` is set), so nothing listens
    beyond loopback.

    Args:
        fn: A picklable (module-level) function; it finds its ranks through
            ``CommContext()``.
        nproc: Number of local ranks to spawn without a launcher.
        *args: Passed to ``fn``.
        backend: Registered communicator name for the world.
        timeout: Collective timeout in seconds; also bounds the wait for the
            spawned ranks (twice this long at most).

    Raises:
        ValueError: ``nproc`` is not a positive integer.
        RuntimeError: a spawned rank failed or did not finish in time.
    """
    if under_launcher():
        _rank_main(fn, args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), backend, "env://", timeout)
        return
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer; got {nproc!r}")
    store = tempfile.mkdtemp(prefix="rlightning-comm-")
    url = f"file://{store}/store"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(fn, args, r, nproc, backend, url, timeout, True), name=f"rank{r}") for r in range(nproc)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 2 * timeout
        failing = False
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if not failing and any(p.exitcode not in (None, 0) for p in procs):
                # A failed rank's peers fail too once its connections close, or stay blocked in a
                # collective: give them a moment to report their own exit code, then stop them.
                failing = True
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE)
            time.sleep(0.05)
        failed = {p.name: p.exitcode for p in procs if p.exitcode not in (None, 0)}
        hung = [p.name for p in procs if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        shutil.rmtree(store, ignore_errors=True)
    if failed or hung:
        raise RuntimeError(f"local ranks failed: exit codes {failed}; still running (terminated) {hung}. See each rank's traceback above")
