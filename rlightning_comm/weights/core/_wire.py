"""How both weight-sync calls move their messages on a communicator: point to point (gloo on host tensors) or by the
backend's collectives."""

from __future__ import annotations

from typing import Any


def point_to_point(comm: Any) -> bool:
    """Whether a transfer on ``comm`` moves its data (and its handshake) point to point: gloo on host tensors (gloo's
    send reads host memory only)."""
    return comm.backend == "gloo" and comm.device.type == "cpu"
