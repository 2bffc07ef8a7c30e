"""Creating torch process groups whose group rank ``i`` is the ``i``-th rank as declared."""

from __future__ import annotations

import inspect
from datetime import timedelta

import torch
import torch.distributed as dist

from rlightning_comm import _compat
from rlightning_comm.errors import CommError
from rlightning_comm.failures import comm_failure
from rlightning_comm.topology import Partition

# torch's new_group sorted a group's ranks until sort_ranks=False let the declared order stand (pytorch#176578, torch
# 2.12).
_KEEPS_ORDER = "sort_ranks" in inspect.signature(dist.new_group).parameters


def check_order_supported(groups: Partition, mode: str) -> None:
    """Refuse an unsorted group where this torch cannot number it in declared order.

    Raises:
        CommError: a group of ``groups`` is not in ascending order and torch's ``new_group`` has no ``sort_ranks``
            argument.
    """
    if _KEEPS_ORDER:
        return
    for part in groups:
        if list(part) != sorted(part):
            raise CommError(
                f"mode {mode!r}: group {list(part)} is declared out of ascending order, and torch {torch.__version__} "
                "numbers a group's ranks "
                "in ascending order whatever the declaration; declared rank order needs torch >= 2.12 (new_group(..., "
                "sort_ranks=False)). "
                f"Declare the group as {sorted(part)} (then group rank i is the i-th smallest global rank) or upgrade "
                "torch"
            )


def new_group(part: tuple[int, ...], backend: str, timeout: float, mode: str) -> dist.ProcessGroup:
    """``dist.new_group`` of ``part`` in its declared order; every rank of the world calls it.

    On a world bound to a device (an NCCL world: ``device_id``), torch splits the world's communicator for every new
    group, members and non-members alike; the members of a gloo group take part here (see
    :func:`rlightning_comm._compat.join_world_split`).

    Raises:
        CommError: torch failed to create the group (the message names the mode).
    """
    # A sorted declaration takes torch's default path: nothing changes for it.
    order = {} if list(part) == sorted(part) else {"sort_ranks": False}
    try:
        group = dist.new_group(ranks=list(part), backend=backend, timeout=timedelta(seconds=timeout), **order)
        if backend != "nccl" and dist.get_rank() in part:
            # The split torch runs on this group's non-members when the world is bound to a device.
            _compat.join_world_split()
    except RuntimeError as err:
        raise comm_failure(err, mode, "init_group", timeout) from err
    return group
