"""Local checks of a communicator's arguments, made before any collective starts.

A bad argument raises here, on the rank that passed it, instead of reaching
the backend (where it could hang the peers or fail obscurely).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.distributed import ReduceOp

_SUM = ReduceOp.SUM
_AVG = ReduceOp.AVG
_BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
# torch views a complex tensor as real pairs, which is only exact for these ops.
_COMPLEX_OPS = frozenset({ReduceOp.SUM, ReduceOp.AVG})


class InputChecks:
    """Mixin of :class:`Communicator`: the checks every collective runs on its arguments."""

    _mode: str
    _world_size: int
    _rank_set: frozenset[int]
    _ranks: tuple[int, ...]
    supported_reduce_ops: ClassVar[frozenset[Any]]
    integer_avg_supported: ClassVar[bool]
    # _check_device(tensor, name) is the backend's part, declared abstract on Communicator.

    def _check_tensor(self, tensor: Any, name: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(tensor).__name__} (mode {self._mode!r})")
        if not tensor.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous; got a tensor of shape {tuple(tensor.shape)} with stride {tensor.stride()} "
                f"(mode {self._mode!r}). Hint: pass t.contiguous() and copy the result back into your view"
            )
        self._check_device(tensor, name)

    def _check_like(self, tensor: Any, ref: torch.Tensor, name: str) -> None:
        self._check_tensor(tensor, name)
        if tensor.dtype != ref.dtype or tensor.shape != ref.shape or tensor.device != ref.device:
            raise ValueError(
                f"{name} must match the tensor argument: expected shape {tuple(ref.shape)}, {ref.dtype} on {ref.device}; "
                f"got shape {tuple(tensor.shape)}, {tensor.dtype} on {tensor.device} (mode {self._mode!r})"
            )

    def _check_list(self, tensors: Any, ref: torch.Tensor, name: str) -> None:
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"{name} must be a list of {self._world_size} tensors; got {type(tensors).__name__} (mode {self._mode!r})")
        if len(tensors) != self._world_size:
            raise ValueError(f"{name} must hold one tensor per rank: expected {self._world_size}; got {len(tensors)} (mode {self._mode!r})")
        for i, t in enumerate(tensors):
            self._check_like(t, ref, f"{name}[{i}]")

    def _check_peer(self, rank: Any, name: str) -> None:
        if rank not in self._rank_set or isinstance(rank, bool):
            raise ValueError(f"{name}={rank!r} is not a global rank of mode {self._mode!r}; expected one of {list(self._ranks)}")

    def _check_reduce_op(self, op: Any, tensor: torch.Tensor) -> None:
        if op is _SUM:
            return
        if op not in self.supported_reduce_ops:
            supported = sorted(str(o).rsplit(".", 1)[-1] for o in self.supported_reduce_ops)
            raise ValueError(f"reduce op {op!r} is not supported by {type(self).__name__} (mode {self._mode!r}); supported: {supported}")
        if tensor.is_complex():
            if op not in _COMPLEX_OPS:
                raise ValueError(f"reduce op {op!r} is not defined on complex tensors ({tensor.dtype}, mode {self._mode!r}); expected SUM or AVG")
        elif op in _BITWISE:
            if tensor.is_floating_point():
                raise ValueError(f"bitwise reduce op {op!r} needs an integer or bool tensor; got {tensor.dtype} (mode {self._mode!r})")
        elif op is _AVG and not tensor.is_floating_point() and not self.integer_avg_supported:
            raise ValueError(f"reduce op AVG needs a floating-point tensor with {type(self).__name__}; got {tensor.dtype} (mode {self._mode!r})")
