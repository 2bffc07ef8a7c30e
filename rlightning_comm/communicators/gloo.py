"""Gloo backend: CPU tensors (and CUDA tensors, which gloo stages through the host)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch.distributed import ReduceOp
from typing_extensions import override

from rlightning_comm.communicators.base import Communicator
from rlightning_comm.communicators.registry import register_communicator

_CPU = torch.device("cpu")


@register_communicator("gloo")
class GlooCommunicator(Communicator):
    """Communicator on a gloo process group; buffers it creates live on the CPU."""

    backend: ClassVar[str] = "gloo"
    supported_reduce_ops: ClassVar[frozenset[object]] = frozenset(
        {
            ReduceOp.SUM,
            ReduceOp.AVG,
            ReduceOp.PRODUCT,
            ReduceOp.MIN,
            ReduceOp.MAX,
            ReduceOp.BAND,
            ReduceOp.BOR,
            ReduceOp.BXOR,
        }
    )
    integer_avg_supported: ClassVar[bool] = False

    @property
    @override
    def device(self) -> torch.device:
        return _CPU

    @staticmethod
    @override
    def on_device(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.is_cpu and b.is_cpu  # one host device

    @override
    def check_device(self, tensor: torch.Tensor, name: str) -> None:
        if not (tensor.is_cpu or tensor.is_cuda):  # not .device.type: that builds a torch.device per call
            raise ValueError(
                f"{name} is on {tensor.device}; GlooCommunicator (mode {self._mode!r}) expects a cpu or cuda tensor"
            )
