"""Point-to-point: :meth:`Communicator.send` and :meth:`Communicator.recv`, written for the cold call as the collectives
are.

``dst`` / ``src`` are global ranks of the group, never this rank. Each pair of calls moves the bytes of one tensor
(complex as its real pairs); the receiver's tensor must have the sender's dtype and number of elements, which debug mode
checks for each pair (see :mod:`rlightning_comm.debug._p2p`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import has_torch_function_unary

from rlightning_comm._compat import COALESCING as _coalescing
from rlightning_comm.communicators._launch import as_real, compiling
from rlightning_comm.failures import LAUNCH_ERRORS

_Tensor = torch.Tensor
_TAG = 0  # torch.distributed's default tag; the weight transfer uses tags of its own


class PointToPoint:
    """Mixin of :class:`Communicator`: send and recv."""

    _group: Any
    _global_rank: int
    _group_rank_of: dict[int, int]
    _lock: Any
    # Provided by the other mixins: on_device, _check_send, _check_recv, _coalesced, _overlap, _failure, _handle,
    # _traced_group.

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False) -> Any | None:
        """Send ``tensor`` to global rank ``dst``, which receives it with :meth:`recv`.

        Args:
            tensor: What to send; not modified.
            dst: Global rank of the group that receives (not this rank).
            async_op: Return a work handle instead of waiting (torch's ``isend``).

        Returns:
            A work handle if ``async_op``, else ``None``; ``None`` on a non-member.
        """
        group = self._group
        if group is None:
            return None
        traced = compiling()  # constant under dynamo, which cannot trace is_neg
        try:
            plain = (
                type(dst) is int
                and dst in self._group_rank_of
                and dst != self._global_rank
                and isinstance(tensor, _Tensor)
                and self.on_device(tensor, tensor)
                and tensor.is_contiguous()
                and not tensor.is_complex()
                and not tensor.is_nested
                and (traced or not tensor.is_neg())
            )
        except RuntimeError:
            plain = False
        if not plain:
            self._check_send(tensor, dst, async_op)
            dst = operator.index(dst)
        if _coalescing and group in _coalescing:
            raise self._coalesced("send")
        if traced or has_torch_function_unary(tensor):
            group = self._traced_group("send")
            return dist.isend(tensor, dst, group=group) if async_op else dist.send(tensor, dst, group=group)
        if not plain:
            tensor = as_real(tensor)
        peer = self._group_rank_of[dst]
        lock = self._lock
        if not lock.acquire(False):
            raise self._overlap("send")
        try:
            work = group.send([tensor], peer, _TAG)
            if async_op:
                return self._handle(work, "send")
            if work is not None:
                work.wait()
        except LAUNCH_ERRORS as err:
            raise self._failure("send", err) from err
        finally:
            lock.release()
        return None

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Any | None:
        """Receive into ``tensor`` what global rank ``src`` sends with :meth:`send`.

        Args:
            tensor: Filled in place; the sender's dtype and number of elements.
            src: Global rank of the group that sends (not this rank).
            async_op: Return a work handle instead of waiting (torch's ``irecv``).

        Returns:
            A work handle if ``async_op``, else ``None`` (torch's ``recv`` returns the sender's rank, which is ``src``
            here); ``None`` on a non-member.
        """
        group = self._group
        if group is None:
            return None
        traced = compiling()  # constant under dynamo, which cannot trace is_neg
        try:
            plain = (
                type(src) is int
                and src in self._group_rank_of
                and src != self._global_rank
                and isinstance(tensor, _Tensor)
                and self.on_device(tensor, tensor)
                and tensor.is_contiguous()
                and not tensor.is_complex()
                and not tensor.is_nested
                and (traced or not tensor.is_neg())
            )
        except RuntimeError:
            plain = False
        if not plain:
            self._check_recv(tensor, src, async_op)
            src = operator.index(src)
        if _coalescing and group in _coalescing:
            raise self._coalesced("recv")
        if traced or has_torch_function_unary(tensor):
            if async_op:
                return dist.irecv(tensor, src, group=self._traced_group("recv"))
            dist.recv(tensor, src, group=self._traced_group("recv"))
            return None
        if not plain:
            tensor = as_real(tensor)
        peer = self._group_rank_of[src]
        lock = self._lock
        if not lock.acquire(False):
            raise self._overlap("recv")
        try:
            work = group.recv([tensor], peer, _TAG)
            if async_op:
                return self._handle(work, "recv")
            if work is not None:
                work.wait()
        except LAUNCH_ERRORS as err:
            raise self._failure("recv", err) from err
        finally:
            lock.release()
        return None
