"""Count what reaches torch.distributed's collectives from a worker (to prove a call started none, or exactly one)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_DIST = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "gather",
    "scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all_single",
    "broadcast_object_list",
    "all_gather_object",
    "barrier",
)
# Module-level aliases the communicators bind at import time.
_BASE_ALIASES = {"_all_gather_flat": "all_gather_flat", "_reduce_scatter_flat": "reduce_scatter_flat"}


@contextmanager
def backend_calls() -> Iterator[dict[str, int]]:
    """Count every torch.distributed collective (and the communicators' aliases of them) while inside; yields the live counts.

    The worker processes are reused across tests, so everything is restored on exit.
    """
    import torch.distributed as dist

    from rlightning_comm.communicators import base

    counts: dict[str, int] = {}

    def counted(real: Any, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return real(*args, **kwargs)

        return call

    patched = [(dist, name, name) for name in _DIST if hasattr(dist, name)]
    patched += [(base, alias, name) for alias, name in _BASE_ALIASES.items() if hasattr(base, alias)]
    saved = [(module, attr, getattr(module, attr)) for module, attr, _ in patched]
    for module, attr, name in patched:
        setattr(module, attr, counted(getattr(module, attr), name))
    try:
        yield counts
    finally:
        for module, attr, real in saved:
            setattr(module, attr, real)
