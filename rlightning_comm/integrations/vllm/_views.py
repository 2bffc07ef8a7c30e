"""What vLLM's weight loaders are handed: a checkpoint tensor of which this worker received one block.

vLLM's loaders take whole checkpoint tensors and narrow each to the block of their tensor-parallel rank before they
copy it. A worker of the backend receives only that block, so it hands the loader a :class:`CheckpointBlock`: a tensor
that answers for the whole checkpoint tensor (its shape, dimensions and number of elements) and gives its elements only
through ``narrow``, to a region inside the block received. Anything else (a copy, arithmetic, a narrow that reaches
outside the block) raises, naming the tensor: a loader that would read elements this worker did not receive fails
instead of loading garbage, so vLLM's own loader checks the layout the backend derived.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlightning_comm.weights import TensorSlice

_PASSED = (  # properties read as they are: the loaders' and vLLM's reload bookkeeping look at them
    torch.Tensor.dtype,
    torch.Tensor.device,
    torch.Tensor.layout,
    torch.Tensor.is_meta,
    torch.Tensor.is_cuda,
    torch.Tensor.is_cpu,
    torch.Tensor.requires_grad,
)


def checkpoint_view(block: TensorSlice, name: str) -> torch.Tensor:
    """What a loader is handed for checkpoint tensor ``name`` of which this worker holds ``block``: the block's tensor
    when it is the whole tensor, else a :class:`CheckpointBlock`."""
    if tuple(block.tensor.shape) == tuple(block.global_shape):
        return block.tensor
    return CheckpointBlock(block, name)


class CheckpointBlock(torch.Tensor):
    """A checkpoint tensor of ``block.global_shape`` of which only ``block`` is here (see the module's docstring)."""

    _rlc: tuple[torch.Tensor, tuple[int, ...], torch.Size, str]

    @staticmethod
    def __new__(cls, block: TensorSlice, name: str) -> CheckpointBlock:
        view = block.tensor.as_subclass(cls)
        view._rlc = (block.tensor, tuple(block.offsets), torch.Size(block.global_shape), name)
        return view

    def __repr__(self) -> str:  # type: ignore[override]
        data, offsets, shape, name = self._rlc
        return f"CheckpointBlock({name!r}, global shape {tuple(shape)}, {_region(offsets, data.shape)} held)"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        me = args[0] if args and isinstance(args[0], cls) else None
        if me is None:  # an operand of another tensor's method (a copy's source): its elements are not all here
            other = next(a for a in (*args, *kwargs.values()) if isinstance(a, cls))
            raise other._refuse(func)
        data, _, shape, _ = me._rlc
        prop = getattr(func, "__self__", None)
        if prop is torch.Tensor.shape:
            return shape
        if prop is torch.Tensor.ndim:
            return len(shape)
        if prop in _PASSED:
            return getattr(data, prop.__name__)
        if func is torch.Tensor.size:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            return shape if dim is None else shape[dim]
        if func in (torch.Tensor.dim, torch.Tensor.ndimension):
            return len(shape)
        if func is torch.Tensor.numel:
            return math.prod(shape)
        if func is torch.Tensor.__len__:
            return shape[0]
        if func in (torch.Tensor.narrow, torch.narrow):
            names = ("dim", "start", "length")
            dim, start, length = (*args[1:], *(kwargs[k] for k in names[len(args) - 1 :]))
            return me._narrow(int(dim), int(start), int(length))
        raise me._refuse(func)

    def _narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        data, offsets, shape, name = self._rlc
        dim = dim % len(shape)
        first, held = offsets[dim], data.shape[dim]
        if start < first or start + length > first + held:
            raise ValueError(
                f"vLLM's loader of {name!r} reads elements {start}:{start + length} of dimension {dim}; this worker "
                f"received {first}:{first + held} of it (global shape {tuple(shape)}): the layout the rlightning "
                "backend derived for it does not match vLLM's loader"
            )
        with torch._C.DisableTorchFunctionSubclass():
            part = data.narrow(dim, start - first, length)
        offsets = tuple(0 if d == dim else o for d, o in enumerate(offsets))
        shape = tuple(length if d == dim else n for d, n in enumerate(shape))
        return checkpoint_view(TensorSlice(part, offsets, shape), name)

    def _refuse(self, func: Any) -> TypeError:
        data, offsets, shape, name = self._rlc
        what = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        return TypeError(
            f"vLLM's loader of {name!r} used it through {what}, but this worker received only "
            f"{_region(offsets, data.shape)} of it (global shape {tuple(shape)}); a loader may only narrow it to that "
            "block: the rlightning backend does not support this loader"
        )


def _region(offsets: tuple[int, ...], shape: Any) -> str:
    return "elements [" + ", ".join(f"{o}:{o + n}" for o, n in zip(offsets, shape)) + "]"
