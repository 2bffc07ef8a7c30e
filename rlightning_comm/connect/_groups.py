"""A connected mode's process group: a gloo or NCCL backend object built from the mode's own store, outside torch's
world.

Nothing of torch's world is touched: no ``_world`` entry, no split of the world's NCCL communicator, no ``new_group``
collective over the world (which a process of another world could not join). The backend object is what the
communicators call; its three methods with other names than a ``ProcessGroup``'s are aliased
(:data:`rlightning_comm._compat.BACKEND_METHODS`), so the communicators' eager path runs on it unchanged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlightning_comm import _compat
from rlightning_comm._compat import exiting, native_call
from rlightning_comm.errors import CommError
from rlightning_comm.failures import close_gloo_group

_POLL = 0.05  # the longest pause of a build's wait between two looks at the store (and at why it should stop)


def _aliased(base: type) -> type:
    """A subclass of the backend class ``base`` that also answers to the ``ProcessGroup`` names of its methods."""
    methods = {name: getattr(base, backend_name) for name, backend_name in _compat.BACKEND_METHODS.items()}
    return type(
        f"Connected{base.__name__}",
        (base,),
        {"__module__": __name__, "__doc__": f"{base.__name__} of a connected mode.", **methods},
    )


_GLOO = _aliased(dist.ProcessGroupGloo)
_NCCL = _aliased(dist.ProcessGroupNCCL) if dist.is_nccl_available() else None


def build_on_thread(
    backend: str,
    store: dist.Store,
    rank: int,
    size: int,
    timeout: float,
    host: str | None,
    name: str,
    server: dist.TCPStore | None,
    interrupt: Callable[[], None],
) -> Any:
    """:func:`build_group` on a thread of its own, so that a loss seen by the watch meanwhile ends the wait
    (``interrupt`` raises it, a :class:`PeerLostError`, between the waits and after a failed build).

    The build stops then too, as it does when the interpreter exits (its waits on the store end), and runs inside
    :func:`native_call`: no build is left running into the interpreter's finalisation, which would abort the process.
    Its thread holds ``server`` (rank 0's store server, or ``None``) while it runs.
    """
    done: dict[str, Any] = {}

    def stopped() -> str | None:
        try:
            interrupt()
        except CommError:
            return "the generation was lost"
        return "the interpreter exits" if exiting() else None

    def build(server: dist.TCPStore | None) -> None:  # the thread's frame holds the server while it runs
        with native_call() as allowed:
            try:
                if not allowed:
                    raise CommError(f"building group {name!r}: the interpreter exits")
                done["group"] = build_group(backend, store, rank, size, timeout, host, name, stopped)
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                done["error"] = err

    thread = threading.Thread(target=build, args=(server,), name=f"rlightning-comm-build {name}", daemon=True)
    thread.start()
    while True:
        thread.join(_POLL)
        if not thread.is_alive():
            break
        interrupt()
    if "error" in done:
        interrupt()  # stopped by a loss: the loss is the error
        raise done["error"]
    return done["group"]


def build_group(
    backend: str,
    store: dist.Store,
    rank: int,
    size: int,
    timeout: float,
    host: str | None,
    name: str,
    stopped: Callable[[], str | None] = lambda: None,
) -> Any:
    """The backend object of one generation, ``size`` members meeting in ``store``; blocks until every member builds its
    own.

    Args:
        backend: ``"gloo"`` or ``"nccl"`` (the communicator class's ``backend``).
        store: The generation's own store (a prefix of the mode's).
        rank: This process's rank in the mode.
        size: Number of members.
        timeout: The group's timeout, in seconds.
        host: gloo listens on this address (a loopback meeting address: every member is on this host); ``None`` is
            torch's default interface (``GLOO_SOCKET_IFNAME``, else the host name's).
        name: The group's name in messages and debug mode's keys (unique per mode and generation).
        stopped: Why the build should stop now (the generation was lost, the interpreter exits), or ``None``: gloo's
            rendezvous waits on ``store`` through :class:`_Stoppable`, so a build left behind ends at once, not at the
            group's timeout. NCCL's construction does not wait (its communicator is made at the first call).

    Raises:
        RuntimeError: torch could not build it (a member never came, or died while building), or ``stopped`` said why.
    """
    wait = timedelta(seconds=timeout)
    if backend == "gloo":
        group = _GLOO(_Stoppable(store, timeout, stopped), rank, size, _compat.gloo_options(wait, host))
    else:
        if _NCCL is None or not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs a CUDA build of torch with NCCL and a GPU")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = wait
        group = _NCCL(store, rank, size, opts)
    group.group_name = name
    return group


class _Stoppable(dist.Store):
    """``store`` for gloo's rendezvous, whose waits look at the store (one ``check``, which logs nothing) and at
    ``stopped`` in turn, and raise once ``stopped`` says why: a build blocked on a member that is gone ends with it."""

    def __init__(self, store: dist.Store, timeout: float, stopped: Callable[[], str | None]) -> None:
        super().__init__()
        self._store, self._timeout, self._stopped = store, timeout, stopped

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = self._timeout if timeout is None else timeout.total_seconds()
        deadline, pause = time.monotonic() + limit, 0.001
        while not self._store.check(keys):
            why = self._stopped()
            if why is not None:
                raise RuntimeError(f"the group's build stopped waiting for {keys}: {why}")
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"the group's build timed out after {limit:g} s waiting for {keys}")
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, _POLL)


def break_group(group: Any) -> None:
    """Make every call in flight on ``group`` fail now (its members are told of a loss; the group is never used again).

    gloo: :func:`rlightning_comm.failures.close_gloo_group`. NCCL: ``abort()``.
    """
    if isinstance(group, _GLOO):
        close_gloo_group(group)
    else:
        try:
            group.abort()
        except RuntimeError:
            pass
