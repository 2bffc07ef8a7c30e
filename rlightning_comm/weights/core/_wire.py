"""How both weight-sync calls reach their peers on a communicator: point to point (gloo on host tensors) or by the
backend's collectives, and the store every member of the mode reaches."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from rlightning_comm import rendezvous


def point_to_point(comm: Any) -> bool:
    """Whether a transfer on ``comm`` moves its data (and its handshake) point to point: gloo on host tensors (gloo's
    send reads host memory only)."""
    return comm.backend == "gloo" and comm.device.type == "cpu"


def mode_store(comm: Any) -> dist.Store | None:
    """The store every member of ``comm``'s group reaches (a connected mode's own, or the world's), or ``None``."""
    group = comm.group
    own = rendezvous.own_store(group)
    if own is None:
        if not dist.is_initialized():
            return None
        own = rendezvous.world_store()
    return dist.PrefixStore(f"rlightning_comm/weights/commit/{group.group_name}", own)
