"""Count the collectives that reach the process group from a worker (to prove a call started none, or exactly one).

The communicators call the ``ProcessGroup`` directly on the eager path and torch.distributed's functions call the same
methods, so counting at the ``ProcessGroup`` class sees every collective of either, whatever the Python path above it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# ProcessGroup method -> the name a count is kept under.
_METHODS = {
    "allreduce": "all_reduce",
    "broadcast": "broadcast",
    "allgather": "all_gather",
    "all_gather_single": "all_gather_flat",
    "_allgather_base": "all_gather_flat",
    "gather": "gather",
    "scatter": "scatter",
    "reduce_scatter_single": "reduce_scatter_flat",
    "_reduce_scatter_base": "reduce_scatter_flat",
    "all_to_all_single": "all_to_all_single",
    "alltoall_base": "all_to_all_single",
    "barrier": "barrier",
}


@contextmanager
def backend_calls() -> Iterator[dict[str, int]]:
    """Count every collective launched on any process group while inside; yields the live counts.

    The worker processes are reused across tests, so the class is restored on exit.
    """
    import torch.distributed as dist

    pg_class = dist.ProcessGroup
    counts: dict[str, int] = {}

    def counted(real: Any, name: str) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return real(self, *args, **kwargs)

        return call

    saved = {method: pg_class.__dict__[method] for method in _METHODS if method in pg_class.__dict__}
    for method, raw in saved.items():
        setattr(pg_class, method, counted(raw, _METHODS[method]))
    try:
        yield counts
    finally:
        for method, raw in saved.items():
            setattr(pg_class, method, raw)
