"""The workers of one engine agreeing on a call's outcome, and a failure reaching vLLM's driver from one of them.

Every worker of the engine runs each of the backend's calls at once (vLLM's ``collective_rpc``). They agree on its
outcome over vLLM's own tensor-parallel CPU group before any of them touches the weights it serves, so the engine's
workers load a version all together or not at all.

vLLM 0.32's multiprocess executor reads the workers' replies in rank order and stops at the first failure, leaving the
later workers' replies queued for the next call (a known vLLM issue): after a failure on several workers, every later
call of the driver reads a stale reply. So a failure is raised by the engine's last worker only; each other
worker ends vLLM's weight-update session as vLLM does after an error (:func:`end_session`) and returns.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist
from vllm.distributed import get_tp_group


def outcomes(error: BaseException | None) -> list[str | None]:
    """Every worker's error (its type and message), or ``None``, in tensor-parallel rank order."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    group = get_tp_group()
    if group.world_size == 1:
        return [mine]
    out: list[Any] = [None] * group.world_size
    dist.all_gather_object(out, mine, group=group.cpu_group)
    return out


def reporter() -> bool:
    """Whether this worker is the one that raises the engine's failures: its last worker (the only one, outside an
    engine's tensor-parallel group)."""
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return True
    group = get_tp_group()
    return group.rank_in_group == group.world_size - 1


def fail(engine: Any, error: BaseException | None, errors: list[str | None], tail: str) -> None:
    """Report the engine's failure (``errors``, every worker's) to the driver: raise on the last worker (its own
    ``error`` restated where it has one, of the same type), end the session and return on the others."""
    ranks: dict[str, list[int]] = {}
    for rank, said in enumerate(errors):
        if said is not None:
            ranks.setdefault(said, []).append(rank)
    failed = [f"worker{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {said}" for said, r in ranks.items()]
    text = f"{'; '.join(failed)}{tail}"
    if reporter() or not end_session(engine):
        if error is None:
            raise RuntimeError(text)
        try:
            restated = type(error)(text, *error.args[1:])
        except Exception:  # noqa: BLE001 - a type that does not take its message first
            restated = RuntimeError(text)
        raise restated from error


# vLLM 0.32 (a known upstream bug): MultiprocExecutor.collective_rpc stops reading replies at the first failure.
def end_session(engine: Any) -> bool:
    """On a worker that does not raise: what vLLM's worker does when its ``update_weights`` raises (no session active,
    the engine's target reset). Whether the worker was found (the caller's frames hold it)."""
    frame = sys._getframe(1)
    while frame is not None:
        worker = frame.f_locals.get("self")
        if worker is not engine and getattr(worker, "weight_transfer_engine", None) is engine:
            if hasattr(worker, "_weight_update_active"):
                worker._weight_update_active = False
            engine.reset_weight_update_target()
            return True
        frame = frame.f_back
    return False
