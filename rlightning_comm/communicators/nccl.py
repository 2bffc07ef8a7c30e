"""NCCL backend: CUDA tensors only, one GPU per rank."""

from __future__ import annotations

import os
from typing import ClassVar

import torch
from torch.distributed import ReduceOp
from typing_extensions import override

from rlightning_comm.communicators.base import Communicator
from rlightning_comm.communicators.registry import register_communicator


BLOCKING_WAIT_ENV = "TORCH_NCCL_BLOCKING_WAIT"
"""torch's switch, read when an NCCL process group is created: its ``wait()`` then blocks the host within the group's timeout."""
_ON = ("1", "true", "yes", "on", "y")
_OFF = ("0", "false", "no", "off", "n")


def enable_blocking_wait() -> bool:
    """Make the NCCL process groups this process creates from now on wait on the host (``TORCH_NCCL_BLOCKING_WAIT=1``).

    With it, torch's ``WorkNCCL.wait()`` blocks the calling thread until the
    work completes, and past the group's timeout aborts the group's
    communicator and raises in that thread; torch then runs no watchdog thread
    for the group, so nothing tears the process down. The variable is read
    when a group is created, so it must be set before the first one.

    Returns:
        Whether it was on already (set by the user or an earlier call).

    Raises:
        ValueError: ``TORCH_NCCL_BLOCKING_WAIT`` is set to a value that turns it off, or to no boolean at all.
    """
    raw = os.environ.get(BLOCKING_WAIT_ENV)
    if raw is None:
        os.environ[BLOCKING_WAIT_ENV] = "1"
        return False
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        raise ValueError(
            f"bounded_wait=True needs {BLOCKING_WAIT_ENV}=1 in the NCCL process groups, but the environment sets {BLOCKING_WAIT_ENV}={raw!r}; "
            f"unset it (the library then sets it) or pass bounded_wait=False"
        )
    raise ValueError(f"environment variable {BLOCKING_WAIT_ENV} must be a boolean such as 1 or 0; got {raw!r}")


@register_communicator("nccl")
class NcclCommunicator(Communicator):
    """Communicator on an NCCL process group; every tensor must be on a CUDA device.

    The CUDA device of the process is set from ``LOCAL_RANK`` (as torchrun
    sets it) when the distributed environment is initialised.
    """

    backend: ClassVar[str] = "nccl"
    supported_reduce_ops: ClassVar[frozenset[object]] = frozenset({ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX})

    @classmethod
    def setup_process(cls) -> None:
        """Select this process's GPU from ``LOCAL_RANK`` before the world is initialised.

        Raises:
            RuntimeError: CUDA is not available.
        """
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA, and torch.cuda.is_available() is False; use backend='gloo' on CPU")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())

    @property
    @override
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    @staticmethod
    @override
    def _on_device(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.is_cuda and b.is_cuda and a.get_device() == b.get_device()

    @override
    def _check_device(self, tensor: torch.Tensor, name: str) -> None:
        if not tensor.is_cuda:
            raise ValueError(f"{name} is on {tensor.device}; NcclCommunicator (mode {self._mode!r}) expects a CUDA tensor. Hint: move it with .cuda()")

    @override
    def _barrier_device_ids(self) -> list[int] | None:
        return [torch.cuda.current_device()]
