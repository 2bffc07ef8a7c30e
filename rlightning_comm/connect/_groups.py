"""A connected mode's process group: a gloo or NCCL backend object built from the mode's own store, outside torch's world.

Nothing of torch's world is touched: no ``_world`` entry, no split of the
world's NCCL communicator, no ``new_group`` collective over the world (which
a process of another world could not join). The backend object is what the
communicators call; its three methods with other names than a
``ProcessGroup``'s are aliased (:data:`rlightning_comm._compat.BACKEND_METHODS`),
so the communicators' eager path runs on it unchanged.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlightning_comm import _compat


def _aliased(base: type) -> type:
    """A subclass of the backend class ``base`` that also answers to the ``ProcessGroup`` names of its methods."""
    methods = {name: getattr(base, backend_name) for name, backend_name in _compat.BACKEND_METHODS.items()}
    return type(f"Connected{base.__name__}", (base,), {"__module__": __name__, "__doc__": f"{base.__name__} of a connected mode.", **methods})


_GLOO = _aliased(dist.ProcessGroupGloo)
_NCCL = _aliased(dist.ProcessGroupNCCL) if dist.is_nccl_available() else None


def build_group(backend: str, store: dist.Store, rank: int, size: int, timeout: float, host: str | None, name: str) -> Any:
    """The backend object of one generation, ``size`` members meeting in ``store``; blocks until every member builds its own.

    Args:
        backend: ``"gloo"`` or ``"nccl"`` (the communicator class's ``backend``).
        store: The generation's own store (a prefix of the mode's).
        rank: This process's rank in the mode.
        size: Number of members.
        timeout: The group's timeout, in seconds.
        host: gloo listens on this address (a loopback meeting address: every member is on this host); ``None`` is
            torch's default interface (``GLOO_SOCKET_IFNAME``, else the host name's).
        name: The group's name in messages and debug mode's keys (unique per mode and generation).

    Raises:
        RuntimeError: torch could not build it (a member never came, or died while building).
    """
    wait = timedelta(seconds=timeout)
    if backend == "gloo":
        group = _GLOO(store, rank, size, _compat.gloo_options(wait, host))
    else:
        if _NCCL is None or not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs a CUDA build of torch with NCCL and a GPU")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = wait
        group = _NCCL(store, rank, size, opts)
    group.group_name = name
    return group


def break_group(group: Any) -> None:
    """Make every call in flight on ``group`` fail now (its members are told of a loss; the group is never used again).

    gloo: a receive from any member, waited for one millisecond, which on its
    timeout closes every connection of the group's context (gloo's own reaction
    to a timeout), so each pending operation fails at once. NCCL: ``abort()``.
    """
    if isinstance(group, _GLOO):
        if group.size() < 2:
            return
        try:
            group.recv_anysource([torch.empty(1, dtype=torch.uint8)], _BREAK_TAG).wait(timedelta(milliseconds=1))
        except RuntimeError:
            pass  # the timeout that closed the connections, or a context already broken
    else:
        try:
            group.abort()
        except RuntimeError:
            pass


_BREAK_TAG = 0x4C4F5354  # "LOST": no member ever sends with it
