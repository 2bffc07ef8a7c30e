"""The private autograd Functions behind the public ops.

Each backward applies the dual op through that op's own Function, so the backward is itself differentiable (double
backward works) and every rule is written once. ``grad_scale`` is 1 except under ``legacy_grad_scale=True``. Arguments
after the tensor are never differentiated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function

from rlightning_comm.sequence_parallel import _collectives as C
from rlightning_comm.sequence_parallel._resolve import Group

_NONE4 = (None, None, None, None)


def _scaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
    return grad if scale == 1.0 else grad * scale


class _AllToAll(Function):
    """forward: all-to-all of one or more tensors (chunks along ``send_dim`` out, concatenation along ``recv_dim`` in),
    all in one collective; backward: the inverse all-to-all of their gradients, again in one."""

    @staticmethod
    def forward(
        ctx: Any,
        group: Group,
        send_dim: int,
        send_sizes: list[list[int]],
        recv_dim: int,
        recv_sizes: list[list[int]],
        *xs: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.args = (group, send_dim, send_sizes, recv_dim, recv_sizes)
        return tuple(C.all_to_all(list(xs), send_dim, send_sizes, recv_dim, recv_sizes, group))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        group, send_dim, send_sizes, recv_dim, recv_sizes = ctx.args
        return (
            None,
            None,
            None,
            None,
            None,
            *apply_all_to_all(group, recv_dim, recv_sizes, send_dim, send_sizes, *grads),
        )


def apply_all_to_all(
    group: Group,
    send_dim: int,
    send_sizes: list[list[int]],
    recv_dim: int,
    recv_sizes: list[list[int]],
    *xs: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """:class:`_AllToAll` of ``xs``, or the plain collective when there is no graph to record (a backward without
    ``create_graph``, inputs that need no gradient).

    The plain call skips the Function's overhead, and it keeps dynamo off its path for a Function that records nothing,
    which inlines ``forward`` and, counting ``*xs`` as one parameter, drops ``ctx`` for exactly two tensors.
    """
    if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
        return _AllToAll.apply(group, send_dim, send_sizes, recv_dim, recv_sizes, *xs)
    return tuple(C.all_to_all(list(xs), send_dim, send_sizes, recv_dim, recv_sizes, group))


class _Split(Function):
    """forward: keep this rank's chunk of a replicated tensor; backward: all-gather (``_Gather``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int, sizes: list[int], grad_scale: float) -> torch.Tensor:
        ctx.args = (group, dim, sizes, grad_scale)
        return C.split(x, dim, sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        group, dim, sizes, grad_scale = ctx.args
        return (_Gather.apply(_scaled(grad, grad_scale), group, dim, sizes, 1.0), *_NONE4)


class _Gather(Function):
    """forward: all-gather into a replicated tensor; backward: keep this rank's chunk of the (replicated) gradient
    (``_Split``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int, sizes: list[int], grad_scale: float) -> torch.Tensor:
        ctx.args = (group, dim, sizes, grad_scale)
        return C.all_gather(x, dim, sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        group, dim, sizes, grad_scale = ctx.args
        return (_Split.apply(_scaled(grad, grad_scale), group, dim, sizes, 1.0), *_NONE4)


class _ScatterFromFirst(Function):
    """forward: scatter the first rank's tensor; backward: gather the gradient to the first rank, zeros elsewhere."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int, sizes: list[int], grad_scale: float) -> torch.Tensor:
        ctx.args = (group, dim, sizes, grad_scale, x.shape[dim])
        return C.scatter_from_first(x, dim, sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        group, dim, sizes, grad_scale, length = ctx.args
        return (_GatherToFirst.apply(_scaled(grad, grad_scale), group, dim, sizes, length), *_NONE4)


class _GatherToFirst(Function):
    """forward: gather to the first rank (zeros of length ``length`` along ``dim`` elsewhere); backward: scatter the
    first rank's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int, sizes: list[int], length: int) -> torch.Tensor:
        ctx.args = (group, dim, sizes)
        return C.gather_to_first(x, dim, sizes, group, length)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        group, dim, sizes = ctx.args
        return (_ScatterFromFirst.apply(grad, group, dim, sizes, 1.0), *_NONE4)


class _GatherFirstGrad(Function):
    """forward: all-gather; backward: scatter the first rank's gradient (only the first rank's loss counts)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int, sizes: list[int], grad_scale: float) -> torch.Tensor:
        ctx.args = (group, dim, sizes, grad_scale)
        return C.all_gather(x, dim, sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        group, dim, sizes, grad_scale = ctx.args
        return (_ScatterFromFirst.apply(_scaled(grad, grad_scale), group, dim, sizes, 1.0), *_NONE4)


class _AllGather(Function):
    """forward: all-gather; backward: reduce-scatter (sum) of the per-rank gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int, sizes: list[int]) -> torch.Tensor:
        ctx.args = (group, dim, sizes)
        return C.all_gather(x, dim, sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        group, dim, sizes = ctx.args
        return (_ReduceScatter.apply(grad, group, dim, sizes), None, None, None)


class _ReduceScatter(Function):
    """forward: reduce-scatter (sum); backward: all-gather of the per-rank gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int, sizes: list[int]) -> torch.Tensor:
        ctx.args = (group, dim, sizes)
        return C.reduce_scatter(x, dim, sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        group, dim, sizes = ctx.args
        return (_AllGather.apply(grad, group, dim, sizes), None, None, None)
