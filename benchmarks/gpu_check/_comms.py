"""The GPU check's test-only communicators (registered when imported; never part of the library).

* ``gpu_check_cuda_gloo``: gloo's transport with NCCL's device rules on a CUDA device, so the NCCL-only Python branches
  run with several ranks on one GPU.
* ``gpu_check_wrong_gloo``: gloo with a deliberately wrong ``all_reduce``, which the check's own test makes the matrix
  report.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ReduceOp
from typing_extensions import override

from rlightning_comm import GlooCommunicator, NcclCommunicator
from rlightning_comm.communicators import nccl
from rlightning_comm.communicators.registry import register_communicator

CUDA_GLOO = "gpu_check_cuda_gloo"
WRONG_GLOO = "gpu_check_wrong_gloo"
_CUDA_GLOO_DEVICE = [torch.device("cpu")]  # set by the rank program: cuda:0 on a GPU machine


def set_cuda_gloo_device(device: torch.device) -> None:
    _CUDA_GLOO_DEVICE[0] = torch.device(device)


@register_communicator(CUDA_GLOO)
class CudaGlooCommunicator(GlooCommunicator):
    """Test only: a gloo group whose communicator stages on a CUDA device and refuses what NCCL refuses.

    gloo runs 4 ranks with CUDA tensors on one GPU, where NCCL refuses two. The library's branches that depend on the
    communicator's device (weight transfer's broadcast path and GPU buckets, the object collectives' and
    ``all_reduce_dict``'s staging, stats' CUDA events) then run with cross-rank effects; NCCL's dtype table runs in the
    local checks (and in debug mode's verdicts).
    """

    supported_dtypes = NcclCommunicator.supported_dtypes

    @property
    @override
    def device(self) -> torch.device:
        return _CUDA_GLOO_DEVICE[0]

    @override
    def check_device(self, tensor: torch.Tensor, name: str) -> None:
        if tensor.device.type != self.device.type:
            raise ValueError(
                f"{name} is on {tensor.device}; {type(self).__name__} (mode {self._mode!r}) expects a "
                f"{self.device.type} tensor"
            )

    @override
    def _unreducible_dtypes(self) -> frozenset[torch.dtype]:
        return nccl._unreducible()


@register_communicator(WRONG_GLOO)
class WrongAllReduceCommunicator(GlooCommunicator):
    """Test only: gloo with an ``all_reduce`` whose result has its first byte's low bit flipped."""

    @override
    def all_reduce(self, tensor: torch.Tensor, op: Any = ReduceOp.SUM, async_op: bool = False) -> Any | None:
        work = super().all_reduce(tensor, op, async_op)
        if work is not None:
            work.wait()
        first = tensor.reshape(-1)[:1].view(torch.uint8)
        first[0] = first[0] ^ 1
        return work
