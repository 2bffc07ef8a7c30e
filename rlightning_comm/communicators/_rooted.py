"""The rooted tensor collectives of :class:`Communicator`: broadcast, gather, scatter, reduce.

Each is written for the cold call, in its own frame, as the collectives of :mod:`._tensor_collectives` (see there):
non-member test, one C-level fast expression (a plain ``int`` root of the group among its reads), the full
``_check_<op>`` otherwise, the compiled or ``__torch_function__`` path, and the inline launch with the root's options
built at bind time.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol  # the traceable collectives
from torch.distributed import ReduceOp
from torch.overrides import has_torch_function_unary

from rlightning_comm._compat import COALESCING as _coalescing
from rlightning_comm.communicators._checks import launched_op
from rlightning_comm.communicators._launch import as_real, compiling, rooted_args
from rlightning_comm.failures import LAUNCH_ERRORS

_Tensor = torch.Tensor
_SUM = ReduceOp.SUM
_BOOL = torch.bool


class RootedCollectives:
    """Mixin of :class:`Communicator`: broadcast, gather, scatter, reduce (``src``/``dst`` are global ranks of the
    group)."""

    _group: Any
    _global_rank: int
    _group_rank_of: dict[int, int]
    _lock: Any
    _sync: Any
    _async: Any
    # Provided by the other mixins: on_device, the _check_<op> methods, _coalesced, _overlap, _failure, _handle,
    # _reduce_options, _traced_group.

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Any | None:
        """Copy ``tensor`` from global rank ``src`` into ``tensor`` on every rank.

        Returns:
            A work handle if ``async_op``, else ``None``; ``None`` on a non-member.
        """
        group = self._group
        if group is None:
            return None
        traced = compiling()  # constant under dynamo, which cannot trace is_neg
        try:
            plain = (
                type(src) is int
                and src in self._group_rank_of
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
            self._check_broadcast(tensor, src, async_op)
            src = operator.index(
                src
            )  # a rank the check accepted through __index__ (a 0-d tensor): the int the tables are keyed by
        if _coalescing and group in _coalescing:
            raise self._coalesced("broadcast")
        if traced:  # dynamo does not rewrite dist.broadcast: the functional one, copied back in place
            tensor.copy_(
                funcol.wait_tensor(funcol.broadcast(tensor, self._group_rank_of[src], self._traced_group("broadcast")))
            )
            return None
        if has_torch_function_unary(tensor):
            return dist.broadcast(tensor, src=src, group=self._traced_group("broadcast"), async_op=async_op)
        if not plain:
            tensor = as_real(tensor)
        opts = self._async.broadcast[src] if async_op else self._sync.broadcast[src]
        lock = self._lock
        if not lock.acquire(False):
            raise self._overlap("broadcast")
        try:
            work = group.broadcast([tensor], opts)
            if async_op:
                return self._handle(work, "broadcast")
            if work is not None:  # NCCL returns no work for a blocking call (it runs on the current stream)
                work.wait()
        except LAUNCH_ERRORS as err:
            raise self._failure("broadcast", err) from err
        finally:
            lock.release()
        return None

    def gather(
        self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, async_op: bool = False
    ) -> Any | None:
        """Gather ``tensor`` from every rank into ``gather_list`` on global rank ``dst``.

        Args:
            tensor: This rank's contribution.
            gather_list: On ``dst``, one tensor per rank shaped like ``tensor``; ignored on other ranks.
            dst: Global rank that receives.
            async_op: Return a work handle instead of waiting.

        Returns:
            A work handle if ``async_op``, else ``None``; ``None`` on a non-member.
        """
        group = self._group
        if group is None:
            return None
        self._check_gather(tensor, gather_list, dst, async_op)  # its own fast path covers the root's list
        if type(dst) is not int:
            dst = operator.index(dst)
        on_root = self._global_rank == dst
        if _coalescing and group in _coalescing:
            raise self._coalesced("gather")
        if compiling() or has_torch_function_unary(tensor):
            return dist.gather(
                tensor,
                list(gather_list) if on_root else None,
                dst=dst,
                group=self._traced_group("gather"),
                async_op=async_op,
            )
        tensor, outputs = rooted_args(tensor, gather_list, on_root)
        opts = self._async.gather[dst] if async_op else self._sync.gather[dst]
        lock = self._lock
        if not lock.acquire(False):
            raise self._overlap("gather")
        try:
            work = group.gather(outputs, [tensor], opts)
            if async_op:
                return self._handle(work, "gather")
            if work is not None:  # NCCL returns no work for a blocking call (it runs on the current stream)
                work.wait()
        except LAUNCH_ERRORS as err:
            raise self._failure("gather", err) from err
        finally:
            lock.release()
        return None

    def scatter(
        self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, async_op: bool = False
    ) -> Any | None:
        """Send ``scatter_list[i]`` from global rank ``src`` to the group's i-th rank, into ``tensor``.

        Args:
            tensor: Output on every rank.
            scatter_list: On ``src``, one tensor per rank shaped like ``tensor``; ignored on other ranks.
            src: Global rank that sends.
            async_op: Return a work handle instead of waiting.

        Returns:
            A work handle if ``async_op``, else ``None``; ``None`` on a non-member.
        """
        group = self._group
        if group is None:
            return None
        self._check_scatter(tensor, scatter_list, src, async_op)  # its own fast path covers the root's list
        if type(src) is not int:
            src = operator.index(src)
        on_root = self._global_rank == src
        if _coalescing and group in _coalescing:
            raise self._coalesced("scatter")
        if compiling() or has_torch_function_unary(tensor):
            return dist.scatter(
                tensor,
                list(scatter_list) if on_root else None,
                src=src,
                group=self._traced_group("scatter"),
                async_op=async_op,
            )
        tensor, inputs = rooted_args(tensor, scatter_list, on_root)
        opts = self._async.scatter[src] if async_op else self._sync.scatter[src]
        lock = self._lock
        if not lock.acquire(False):
            raise self._overlap("scatter")
        try:
            work = group.scatter([tensor], inputs, opts)
            if async_op:
                return self._handle(work, "scatter")
            if work is not None:  # NCCL returns no work for a blocking call (it runs on the current stream)
                work.wait()
        except LAUNCH_ERRORS as err:
            raise self._failure("scatter", err) from err
        finally:
            lock.release()
        return None

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: Any = _SUM, async_op: bool = False) -> Any | None:
        """Reduce ``tensor`` across the group into ``tensor`` on global rank ``dst``.

        Args:
            tensor: Input everywhere, same shape and dtype on every rank; the result on ``dst``. What other ranks'
                tensors hold afterwards is the backend's business (as in torch): do not read them.
            dst: Global rank that receives the result.
            op: A ``torch.distributed.ReduceOp`` the backend supports for the dtype.
            async_op: Return a work handle instead of waiting.

        Returns:
            A work handle if ``async_op``, else ``None``; ``None`` on a non-member.
        """
        group = self._group
        if group is None:
            return None
        traced = compiling()  # constant under dynamo, which cannot trace is_neg
        try:
            plain = (
                op is _SUM
                and type(dst) is int
                and dst in self._group_rank_of
                and isinstance(tensor, _Tensor)
                and self.on_device(tensor, tensor)
                and tensor.is_contiguous()
                and not tensor.is_complex()
                and not tensor.is_nested
                and (traced or not tensor.is_neg())
                and tensor.dtype is not _BOOL
            )
        except RuntimeError:
            plain = False
        if not plain:
            self._check_reduce(tensor, dst, op, async_op)
            dst, op = operator.index(dst), launched_op(op, tensor.dtype)
        if _coalescing and group in _coalescing:
            raise self._coalesced("reduce")
        if traced or has_torch_function_unary(tensor):
            return dist.reduce(tensor, dst, op=op, group=self._traced_group("reduce"), async_op=async_op)
        if plain:
            opts = self._async.reduce_sum[dst] if async_op else self._sync.reduce_sum[dst]
        else:
            tensor, opts = as_real(tensor), self._reduce_options(op, dst, async_op)
        lock = self._lock
        if not lock.acquire(False):
            raise self._overlap("reduce")
        try:
            work = group.reduce([tensor], opts)
            if async_op:
                return self._handle(work, "reduce")
            if work is not None:  # NCCL returns no work for a blocking call (it runs on the current stream)
                work.wait()
        except LAUNCH_ERRORS as err:
            raise self._failure("reduce", err) from err
        finally:
            lock.release()
        return None
