"""Run a function on N ranks: under torchrun as launched, or on local spawned processes with no launcher."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from rlightning_comm.communicators.registry import get_communicator_class
from rlightning_comm.context import CommContext
from rlightning_comm.rendezvous import pin_gloo_to_loopback

_FAILURE_GRACE = 3.0
# What the fork server imports before it forks the ranks (see _process_context).
_PRELOAD = ["torch", "rlightning_comm"]


def under_launcher() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets ``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _placement_env(rank: int, world_size: int) -> dict[str, str]:
    """What torchrun puts in the environment of rank ``rank`` of a one-node job of ``world_size`` processes.

    The placement variables only: the ranks :func:`run` spawns meet through a file store, so there is no ``MASTER_ADDR``
    / ``MASTER_PORT``.
    """
    return {
        **dict.fromkeys(("RANK", "LOCAL_RANK", "ROLE_RANK"), str(rank)),
        **dict.fromkeys(("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE"), str(world_size)),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
    }


def _process_context() -> Any:
    """How the local ranks start: forked from a fork server on Linux, spawned elsewhere.

    The fork server is a fresh process that imports torch and the library once, and nothing else (no CUDA, no threads of
    the caller's), so each rank starts as a spawned one would but without importing torch again: on a 2-core machine
    that is most of a 4-rank run's start-up. Like a spawned rank, a forked one imports the caller's main module (``fn``
    must be importable) and gets the caller's environment (:func:`_rank_main`).
    """
    if sys.platform.startswith("linux"):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return mp.get_context("spawn")


def _rank_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    backend: str,
    url: str,
    timeout: float,
    env: dict[str, str] | None = None,
    bounded_wait: bool = False,
) -> None:
    if (
        env is not None
    ):  # a local rank: the caller's environment (a forked rank has the fork server's), and torchrun's placement
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(_placement_env(rank, world_size))  # before the world: NCCL picks its GPU from LOCAL_RANK
        pin_gloo_to_loopback()  # every peer is on this host: nothing needs to listen beyond loopback
    ctx = CommContext()
    ctx.init_distributed_env(
        world_size=world_size, rank=rank, backend=backend, dist_url=url, timeout=timeout, bounded_wait=bounded_wait
    )
    ctx._mark_launched()
    try:
        fn(*args)
        # No rank tears the world down while a peer still uses it: gloo's connection set-up on a slower peer fails once
        # a faster one has closed its side (a function that makes no collective returns at once).
        if ctx.is_initialized():
            ctx.get_communicator().barrier()
    finally:
        ctx.destroy()


def _check_gpus(backend: str, nproc: int) -> None:
    if get_communicator_class(backend).backend != "nccl":
        return
    count = torch.cuda.device_count()
    if nproc > count:
        raise ValueError(
            f"run(..., backend={backend!r}) puts each local rank on its own GPU (cuda:LOCAL_RANK), so nproc must be at "
            "most "
            f"torch.cuda.device_count() = {count}; got nproc={nproc}. Hint: pass nproc={max(count, 1)}, or "
            "backend='gloo' on CPU"
        )


def run(
    fn: Callable[..., Any],
    nproc: int = 4,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 1800,
    bounded_wait: bool = False,
) -> None:
    """Run ``fn(*args)`` on every rank, with the context initialised.

    With no launcher, ``nproc`` local processes are started (forked from a fork server that has imported torch once, on
    Linux; spawned elsewhere): each imports the caller's main module as a spawned process does, so ``fn`` must be
    importable (defined at module level, with the call under ``if __name__ == "__main__":``), and starts with the
    caller's environment. They rendezvous through a file store in a private temporary folder and gloo listens on the
    loopback interface (unless ``GLOO_SOCKET_IFNAME`` is set), so nothing listens beyond loopback. Each rank gets
    torchrun's placement variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` = 0,
    ...): with ``backend="nccl"`` rank ``i`` runs on ``cuda:i``. Under torchrun (``RANK`` and ``WORLD_SIZE`` set), this
    process is one rank: the world is initialised from the launcher's environment (``env://``) and ``nproc`` is ignored.

    Inside ``fn`` the world is ready: ``CommContext()`` has ``CommMode.GLOBAL`` bound, and a call to
    ``init_distributed_env`` that asks for this world (its size, rank, backend, timeout and ``bounded_wait``; size and
    rank may be left out; ``env://``) is a no-op; one that asks for another raises ``CommError`` naming both. When
    ``fn`` returns, the rank waits at a barrier of the world for the others, then destroys the context; when it raises,
    it destroys it at once (the peers' next collective fails).

    Args:
        fn: A picklable (module-level) function; it finds its ranks through ``CommContext()``.
        nproc: Number of local ranks to spawn without a launcher.
        *args: Passed to ``fn`` (picklable).
        backend: Registered communicator name for the world.
        timeout: Collective timeout in seconds, as ``init_distributed_env``'s; also bounds the wait for the local ranks
            (twice this long at most).
        bounded_wait: As ``init_distributed_env``'s (NCCL calls wait on the host within their timeout and raise the
            library's errors).

    Raises:
        ValueError: ``nproc`` is not a positive integer, or more ranks than GPUs are asked for with ``backend="nccl"``.
        KeyError: ``backend`` is not registered.
        RuntimeError: a spawned rank failed or did not finish in time.
    """
    if under_launcher():
        _rank_main(
            fn,
            args,
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            backend,
            "env://",
            timeout,
            bounded_wait=bounded_wait,
        )
        return
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer; got {nproc!r}")
    _check_gpus(backend, nproc)
    store = tempfile.mkdtemp(prefix="rlightning-comm-")
    url = f"file://{store}/store"
    ctx = _process_context()
    env = dict(os.environ)
    procs = [
        ctx.Process(
            target=_rank_main, args=(fn, args, r, nproc, backend, url, timeout, env, bounded_wait), name=f"rank{r}"
        )
        for r in range(nproc)
    ]
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
        raise RuntimeError(
            f"local ranks failed: exit codes {failed}; still running (terminated) {hung}. See each rank's traceback "
            "above"
        )
