"""A connected mode's process group: a gloo or NCCL backend object built from the mode's own store, outside torch's
world.

Nothing of torch's world is touched: no ``_world`` entry, no split of the world's NCCL communicator, no ``new_group``
collective over the world (which a process of another world could not join). The backend object is what the
communicators call; its three methods with other names than a ``ProcessGroup``'s are aliased
(:data:`rlightning_comm._compat.BACKEND_METHODS`), so the communicators' eager path runs on it unchanged.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlightning_comm import _compat
from rlightning_comm.failures import close_gloo_group


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


def build_group(
    backend: str, store: dist.Store, rank: int, size: int, timeout: float, host: str | None, name: str
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

    gloo: :func:`rlightning_comm.failures.close_gloo_group`. NCCL: ``abort()``.
    """
    if isinstance(group, _GLOO):
        close_gloo_group(group)
    else:
        try:
            group.abort()
        except RuntimeError:
            pass
