"""Each collective's checks of its own arguments, built from :class:`~._checks.InputChecks`' primitives: what debug
mode runs first on every rank, and what every call runs before it starts."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed import ReduceOp

from rlightning_comm.communicators import _objects, _packing
from rlightning_comm.communicators._checks import InputChecks, same_device

_SUM = ReduceOp.SUM


class OpChecks(InputChecks):
    """Mixin of :class:`Communicator`: ``_check_<op>`` for every op, with the op's own signature."""

    def _check_all_reduce(self, tensor: Any, op: Any = _SUM, async_op: bool = False) -> None:
        self._check_tensor(tensor, "tensor")
        self._check_reduction(op, tensor.dtype)

    def _check_all_gather(self, output_tensor: Any, input_tensor: Any, async_op: bool = False) -> None:
        self._check_tensor(output_tensor, "output_tensor")
        self._check_tensor(input_tensor, "input_tensor")
        ws, n, out_n = self._world_size, input_tensor.dim(), output_tensor.dim()
        if n == out_n == 1:  # the common flat case, without building shapes: it runs on every call
            fits = output_tensor.numel() == ws * input_tensor.numel()
        else:
            shape, out_shape = input_tensor.shape, output_tensor.shape
            if out_n == n:  # concatenated along dim 0
                fits = n > 0 and out_shape[0] == ws * shape[0] and out_shape[1:] == shape[1:]
            else:  # stacked: (world_size, *shape)
                fits = out_n == n + 1 and out_shape[0] == ws and out_shape[1:] == shape
        if not fits or output_tensor.dtype is not input_tensor.dtype or not same_device(output_tensor, input_tensor):
            shape, out_shape = input_tensor.shape, output_tensor.shape
            allowed = [(ws * shape[0], *shape[1:])] if shape else []
            allowed.append((ws, *shape))
            raise ValueError(
                f"output_tensor must have shape {' or '.join(map(str, allowed))}, {input_tensor.dtype} on "
                f"{input_tensor.device} "
                f"for an input of shape {tuple(shape)} and world size {ws}; got shape {tuple(out_shape)}, "
                f"{output_tensor.dtype} on {output_tensor.device} (mode {self._mode!r})"
            )

    def _check_broadcast(self, tensor: Any, src: Any = 0, async_op: bool = False) -> None:
        self._check_tensor(tensor, "tensor")
        self._check_peer(src, "src")

    def _check_gather(self, tensor: Any, gather_list: Any = None, dst: Any = 0, async_op: bool = False) -> None:
        self._check_rooted("gather", tensor, gather_list, "dst", dst)

    def _check_scatter(self, tensor: Any, scatter_list: Any = None, src: Any = 0, async_op: bool = False) -> None:
        self._check_rooted("scatter", tensor, scatter_list, "src", src)

    def _check_reduce_scatter(self, output: Any, input_: Any, op: Any = _SUM, async_op: bool = False) -> None:
        self._check_tensor(output, "output")
        self._check_tensor(input_, "input_")
        self._check_reduction(op, input_.dtype)
        if (
            input_.numel() != output.numel() * self._world_size
            or input_.dtype != output.dtype
            or not same_device(input_, output)
        ):
            raise ValueError(
                f"input_ must hold world_size * output.numel() = {self._world_size * output.numel()} elements of "
                f"{output.dtype} on {output.device}; "
                f"got {input_.numel()} of {input_.dtype} on {input_.device} (mode {self._mode!r})"
            )

    def _check_all_to_all_single(
        self,
        output: Any,
        input_: Any,
        output_split_sizes: Any = None,
        input_split_sizes: Any = None,
        async_op: bool = False,
    ) -> None:
        self._check_tensor(output, "output")
        self._check_tensor(input_, "input_")
        if (
            output.dtype != input_.dtype
            or not same_device(output, input_)
            or output.shape[1:].numel() != input_.shape[1:].numel()
        ):
            raise ValueError(
                "output must have input_'s dtype and device and as many elements per dim-0 row: expected "
                f"{input_.dtype} on {input_.device}, "
                f"{input_.shape[1:].numel()} per row (input_ shape {tuple(input_.shape)}); got {output.dtype} on "
                f"{output.device}, "
                f"{output.shape[1:].numel()} per row (output shape {tuple(output.shape)}) (mode {self._mode!r})"
            )
        self._check_splits(output_split_sizes, output, "output_split_sizes", "output")
        self._check_splits(input_split_sizes, input_, "input_split_sizes", "input_")

    def _check_reduce(self, tensor: Any, dst: Any = 0, op: Any = _SUM, async_op: bool = False) -> None:
        self._check_tensor(tensor, "tensor")
        self._check_peer(dst, "dst")
        self._check_reduction(op, tensor.dtype)

    def _check_point_to_point(self, op: str, tensor: Any, peer: Any, name: str) -> None:
        self._check_tensor(tensor, "tensor")
        self._check_peer(peer, name)
        if operator.index(peer) == self._global_rank:
            raise ValueError(
                f"{name}={peer!r} is this rank: {op} needs another rank of mode {self._mode!r}; expected one of "
                f"{[r for r in self._ranks if r != self._global_rank]}"
            )

    def _check_send(self, tensor: Any, dst: Any, async_op: bool = False) -> None:
        self._check_point_to_point("send", tensor, dst, "dst")

    def _check_recv(self, tensor: Any, src: Any, async_op: bool = False) -> None:
        self._check_point_to_point("recv", tensor, src, "src")

    def _check_barrier(self) -> None:
        return None

    def _check_all_gather_object(
        self, object_list: Any, obj: Any, *, safe: bool | None = None, max_bytes: int | None = None
    ) -> None:
        if not isinstance(object_list, list):
            raise TypeError(
                f"object_list must be a list of {self._world_size} entries (it is filled in place); got "
                f"{type(object_list).__name__} (mode {self._mode!r})"
            )
        if len(object_list) != self._world_size:
            raise ValueError(
                f"object_list must hold one entry per rank: expected {self._world_size}; got {len(object_list)} (mode "
                f"{self._mode!r})"
            )
        _objects.resolve_options(safe, max_bytes, self._mode)

    def _check_broadcast_object_list(
        self, object_list: Any, src: Any = 0, *, safe: bool | None = None, max_bytes: int | None = None
    ) -> None:
        if not isinstance(object_list, list):
            raise TypeError(
                f"object_list must be a list (it is filled in place); got {type(object_list).__name__} (mode "
                f"{self._mode!r})"
            )
        self._check_peer(src, "src")
        _objects.resolve_options(safe, max_bytes, self._mode)

    def _check_all_reduce_dict(self, dictionary: Any, op: Any = _SUM, dtype: Any = torch.float32) -> None:
        if not isinstance(dictionary, Mapping):
            raise TypeError(f"dictionary must be a Mapping; got {type(dictionary).__name__} (mode {self._mode!r})")
        _packing.check(
            dictionary, dtype, self._mode
        )  # the dtype, a total key order, and every value, as pack() checks them
        dtypes = self.supported_dtypes
        if dtypes is not None and dtype not in dtypes:
            self._refuse_dtype(dtype, "dtype")
        self._check_reduction(op, dtype)
