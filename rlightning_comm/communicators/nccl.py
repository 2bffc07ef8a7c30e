"""NCCL backend: CUDA tensors only, one GPU per rank."""

from __future__ import annotations

import functools
import os
from typing import Any, ClassVar

import torch
from torch.distributed import ReduceOp
from typing_extensions import override

from rlightning_comm._env import parse_int
from rlightning_comm.communicators.base import Communicator
from rlightning_comm.communicators.registry import register_communicator
from rlightning_comm.errors import CommError

BLOCKING_WAIT_ENV = "TORCH_NCCL_BLOCKING_WAIT"
"""torch's switch, read when an NCCL process group is created: its ``wait()`` then blocks the host within the group's
timeout."""
_ON = ("1", "true", "yes", "on", "y")
_OFF = ("0", "false", "no", "off", "n")


def enable_blocking_wait() -> bool:
    """Make the NCCL process groups this process creates from now on wait on the host (``TORCH_NCCL_BLOCKING_WAIT=1``).

    With it, torch's ``WorkNCCL.wait()`` blocks the calling thread until the work completes, and past the group's
    timeout aborts the group's communicator and raises in that thread; torch then runs no watchdog thread for the group,
    so nothing tears the process down. The variable is read when a group is created, so it must be set before the first
    one.

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
            f"bounded_wait=True needs {BLOCKING_WAIT_ENV}=1 in the NCCL process groups, but the environment sets "
            f"{BLOCKING_WAIT_ENV}={raw!r}; "
            f"unset it (the library then sets it) or pass bounded_wait=False"
        )
    raise ValueError(f"environment variable {BLOCKING_WAIT_ENV} must be a boolean such as 1 or 0; got {raw!r}")


# torch 2.13's ProcessGroupNCCL dtype map (NCCLUtils.hpp, ncclDataType): what NCCL moves at all. Complex tensors go as
# their real pairs. int16, the unsigned types above 8 bits and float8_e8m0fnu have no NCCL type: every op refuses them.
_MOVES = frozenset(
    {
        torch.float32, torch.float64, torch.float16, torch.bfloat16,
        torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
        torch.complex32, torch.complex64, torch.complex128,
    }
)  # fmt: skip
# What the fast path takes without the full checks: real dtypes NCCL both moves and reduces.
_FAST = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)
# ProcessGroupNCCL refuses these reductions ("Unsupported Float8 type for NCCL reduction"): the fnuz types always, and
# e4m3fn / e5m2 too before NCCL 2.24, which added its FP8 types (NCCL_SUPPORTS_FP8).
_FP8_NEVER_REDUCED = frozenset({torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
_FP8_NATIVE = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


@functools.cache
def _unreducible() -> frozenset[torch.dtype]:
    try:
        reduces_fp8 = tuple(torch.cuda.nccl.version()) >= (2, 24, 0)
    except (AttributeError, RuntimeError, TypeError):  # no NCCL in this build
        reduces_fp8 = False
    return _FP8_NEVER_REDUCED if reduces_fp8 else _FP8_NEVER_REDUCED | _FP8_NATIVE


@register_communicator("nccl")
class NcclCommunicator(Communicator):
    """Communicator on an NCCL process group; every tensor must be on a CUDA device.

    The communicator's CUDA device is fixed when it is bound (:meth:`bind_device`: ``cuda:LOCAL_RANK`` when the launcher
    set ``LOCAL_RANK``, else the binding thread's current device), and everything the communicator allocates or
    synchronises itself uses it, whichever thread calls: the staging buffers of ``all_reduce_dict`` and the object
    collectives, the barrier, stats' events.
    """

    backend: ClassVar[str] = "nccl"
    supported_reduce_ops: ClassVar[frozenset[object]] = frozenset(
        {ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX}
    )
    supported_dtypes: ClassVar[frozenset[torch.dtype] | None] = _MOVES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Without CUDA no NCCL group exists; a communicator made anyway (tests, a CPU-only rank) refuses every tensor.
        self._device = type(self).bind_device() if torch.cuda.is_available() else None

    @classmethod
    @override
    def setup_process(cls) -> None:
        """Select this process's GPU (:meth:`bind_device`) before the world is initialised.

        Raises:
            RuntimeError: CUDA is not available.
            ValueError: ``LOCAL_RANK`` names no visible GPU.
        """
        torch.cuda.set_device(cls.bind_device())

    @classmethod
    @override
    def bind_device(cls) -> torch.device:
        """This process's GPU: ``cuda:LOCAL_RANK`` when ``LOCAL_RANK`` is set, else the calling thread's current device.

        A process that sees one GPU only (``CUDA_VISIBLE_DEVICES`` set per process, Ray's ``num_gpus=1``) uses it
        whatever ``LOCAL_RANK`` says.

        Raises:
            RuntimeError: CUDA is not available.
            ValueError: ``LOCAL_RANK`` is not an integer, or with several visible GPUs not one of their indices.
        """
        if not torch.cuda.is_available():
            raise RuntimeError(
                "backend 'nccl' needs CUDA, and torch.cuda.is_available() is False; use backend='gloo' on CPU"
            )
        raw = os.environ.get("LOCAL_RANK")
        if raw is None:
            return torch.device("cuda", torch.cuda.current_device())
        local_rank = parse_int("LOCAL_RANK", raw)
        count = torch.cuda.device_count()
        if count == 1:
            return torch.device("cuda", 0)
        if not 0 <= local_rank < count:
            raise ValueError(
                f"LOCAL_RANK={local_rank} names no GPU of this process: expected 0 <= LOCAL_RANK < {count} "
                "(torch.cuda.device_count()). "
                "Hint: launch at most one rank per GPU per node, or make each process see only its own GPU "
                "(CUDA_VISIBLE_DEVICES)"
            )
        return torch.device("cuda", local_rank)

    @property
    @override
    def device(self) -> torch.device:
        device = self._device
        if device is None:
            raise CommError(
                f"NcclCommunicator (mode {self._mode!r}) has no CUDA device: torch.cuda.is_available() was False when "
                "it was bound"
            )
        return device

    @staticmethod
    @override
    def on_device(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.is_cuda and b.is_cuda and a.get_device() == b.get_device() and a.dtype in _FAST and b.dtype in _FAST

    @override
    def _unreducible_dtypes(self) -> frozenset[torch.dtype]:
        return _unreducible()

    @override
    def check_device(self, tensor: torch.Tensor, name: str) -> None:
        if not tensor.is_cuda:
            raise ValueError(
                f"{name} is on {tensor.device}; NcclCommunicator (mode {self._mode!r}) expects a CUDA tensor. Hint: "
                "move it with .cuda()"
            )

    @override
    def _barrier_device_ids(self) -> list[int] | None:
        return [self.device.index]
