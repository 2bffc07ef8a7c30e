"""The seed's module-level collectives: resolve the mode's communicator, call its method.

Each function is one line of logic; the contract of each op (validation, non-member behaviour, return value) is
documented once, on the :class:`~rlightning_comm.Communicator` method of the same name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ReduceOp

from rlightning_comm.context import CommContext
from rlightning_comm.modes import CommMode

# The seed's autograd ops, re-exported (the `as` form marks the re-export).
from rlightning_comm.sequence_parallel import all_to_all as all_to_all
from rlightning_comm.sequence_parallel import (
    gather_from_sequence_parallel_region as gather_from_sequence_parallel_region,
)
from rlightning_comm.sequence_parallel import scatter_to_sequence_parallel_region as scatter_to_sequence_parallel_region

_context = CommContext()


def all_gather(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, comm_mode: CommMode | str, async_op: bool = False
) -> Any | None:
    """Gather ``input_tensor`` from every rank of ``comm_mode`` into ``output_tensor`` along dim 0.

    See :meth:`Communicator.all_gather`.
    """
    return _context.get_communicator(comm_mode).all_gather(output_tensor, input_tensor, async_op)


def all_reduce(
    tensor: torch.Tensor, comm_mode: CommMode | str, op: Any = ReduceOp.SUM, async_op: bool = False
) -> Any | None:
    """Reduce ``tensor`` in place across ``comm_mode``. See :meth:`Communicator.all_reduce`."""
    return _context.get_communicator(comm_mode).all_reduce(tensor, op, async_op)


def all_reduce_dict(
    dictionary: dict[Any, Any], comm_mode: CommMode | str, op: Any = ReduceOp.SUM, dtype: torch.dtype = torch.float32
) -> dict[Any, Any] | None:
    """Reduce every value of ``dictionary`` across ``comm_mode`` with one collective.

    See :meth:`Communicator.all_reduce_dict`.
    """
    return _context.get_communicator(comm_mode).all_reduce_dict(dictionary, op, dtype)


def broadcast(tensor: torch.Tensor, comm_mode: CommMode | str, src: int = 0, async_op: bool = False) -> Any | None:
    """Broadcast ``tensor`` from global rank ``src`` over ``comm_mode``. See :meth:`Communicator.broadcast`."""
    return _context.get_communicator(comm_mode).broadcast(tensor, src, async_op)


def broadcast_object_list(
    object_list: list[Any],
    comm_mode: CommMode | str,
    src: int = 0,
    *,
    safe: bool | None = None,
    max_bytes: int | None = None,
) -> None:
    """Broadcast picklable objects from global rank ``src`` over ``comm_mode``, in place.

    ``safe=True`` makes this receiver accept only plain data; ``max_bytes`` bounds what it accepts. See
    :meth:`Communicator.broadcast_object_list`.
    """
    return _context.get_communicator(comm_mode).broadcast_object_list(object_list, src, safe=safe, max_bytes=max_bytes)


def gather(
    tensor: torch.Tensor,
    comm_mode: CommMode | str,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    async_op: bool = False,
) -> Any | None:
    """Gather ``tensor`` from every rank of ``comm_mode`` on global rank ``dst``. See :meth:`Communicator.gather`."""
    return _context.get_communicator(comm_mode).gather(tensor, gather_list, dst, async_op)


def scatter(
    tensor: torch.Tensor,
    comm_mode: CommMode | str,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    async_op: bool = False,
) -> Any | None:
    """Scatter ``scatter_list`` from global rank ``src`` over ``comm_mode`` into ``tensor``. See
    :meth:`Communicator.scatter`."""
    return _context.get_communicator(comm_mode).scatter(tensor, scatter_list, src, async_op)


def reduce(
    tensor: torch.Tensor, comm_mode: CommMode | str, dst: int = 0, op: Any = ReduceOp.SUM, async_op: bool = False
) -> Any | None:
    """Reduce ``tensor`` across ``comm_mode`` into global rank ``dst``'s tensor. See :meth:`Communicator.reduce`."""
    return _context.get_communicator(comm_mode).reduce(tensor, dst, op, async_op)


def reduce_scatter(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    comm_mode: CommMode | str,
    op: Any = ReduceOp.SUM,
    async_op: bool = False,
) -> Any | None:
    """Reduce ``input_tensor`` across ``comm_mode``; this rank's dim-0 slice lands in ``output_tensor``. See
    :meth:`Communicator.reduce_scatter`."""
    return _context.get_communicator(comm_mode).reduce_scatter(output_tensor, input_tensor, op, async_op)


def all_gather_object(
    object_list: list[Any],
    obj: Any,
    comm_mode: CommMode | str,
    *,
    safe: bool | None = None,
    max_bytes: int | None = None,
) -> None:
    """Gather every rank's picklable ``obj`` into ``object_list`` over ``comm_mode``. See
    :meth:`Communicator.all_gather_object`."""
    return _context.get_communicator(comm_mode).all_gather_object(object_list, obj, safe=safe, max_bytes=max_bytes)


def send(tensor: torch.Tensor, comm_mode: CommMode | str, dst: int, async_op: bool = False) -> Any | None:
    """Send ``tensor`` to global rank ``dst`` of ``comm_mode``. See :meth:`Communicator.send`."""
    return _context.get_communicator(comm_mode).send(tensor, dst, async_op)


def recv(tensor: torch.Tensor, comm_mode: CommMode | str, src: int, async_op: bool = False) -> Any | None:
    """Receive into ``tensor`` from global rank ``src`` of ``comm_mode``. See :meth:`Communicator.recv`."""
    return _context.get_communicator(comm_mode).recv(tensor, src, async_op)


def barrier(comm_mode: CommMode | str = CommMode.GLOBAL) -> None:
    """Block until every rank of ``comm_mode`` arrives. See :meth:`Communicator.barrier`."""
    return _context.get_communicator(comm_mode).barrier()
