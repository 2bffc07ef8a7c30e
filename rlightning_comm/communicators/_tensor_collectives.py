"""The tensor collectives of :class:`Communicator` that every rank feeds alike, each written for the cold call.

The rooted ones (``broadcast``, ``gather``, ``scatter``, ``reduce``) are in :mod:`._rooted`, the point-to-point ones
(``send``, ``recv``) in :mod:`._p2p`; all follow the scheme below.

Between two collectives a training loop waits on the backend, so every call starts cold: each distinct Python frame and
each distinct tensor attribute it reads costs cache misses (a few microseconds each, against 60 to 100 of a whole small
gloo call). So each method does its work in its own frame, calling out only for the device test and the compile test on
the common path:

1. the non-member test (``None``);
2. one boolean expression that accepts the common case with C-level reads: dense contiguous tensors of a real dtype on
   the backend's device (:meth:`Communicator.on_device`), matching dtypes and flat shapes, a plain ``int`` rank of the
   group. What it does not accept (any other shape, a complex or sparse tensor, a bad argument) goes to the op's full
   ``_check_<op>`` (:mod:`._checks`), which accepts it or refuses it with the message. The expression accepts a subset
   of what the full check accepts, never more (``tests/test_fast_path.py`` holds 50 edge inputs to that). ``gather`` and
   ``scatter`` call their check, whose own fast path covers the root's list;
3. the compiled or ``__torch_function__`` path (:mod:`._launch`);
4. the launch, inline: the one-call claim (:mod:`._threads`), the process group's method with the options built at bind
   time, the wait, and the failure translation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.overrides import has_torch_function_unary

from rlightning_comm._compat import COALESCING as _coalescing
from rlightning_comm._compat import all_gather_single as _all_gather_flat
from rlightning_comm._compat import reduce_scatter_single as _reduce_scatter_flat
from rlightning_comm.communicators._checks import launched_op
from rlightning_comm.communicators._launch import as_real, compiling
from rlightning_comm.failures import LAUNCH_ERRORS

_Tensor = torch.Tensor
_SUM = ReduceOp.SUM
_BOOL = torch.bool


class TensorCollectives:
    """Mixin of :class:`Communicator`: all_reduce, all_gather, reduce_scatter, all_to_all_single, barrier."""

    _group: Any
    _mode: str
    _world_size: int
    _global_rank: int
    _group_rank_of: dict[int, int]
    _lock: Any
    _sync: Any
    _async: Any
    # Provided by the other mixins: on_device, the _check_<op> methods, _overlap, _failure, _handle, _barrier_options,
    # _traced_group.

    def all_reduce(self, tensor: torch.Tensor, op: Any = _SUM, async_op: bool = False) -> Any | None:
        """Reduce ``tensor`` across the group, in place; every rank gets the result.

        Args:
            tensor: Input and output, same shape and dtype on every rank.
            op: A ``torch.distributed.ReduceOp`` the backend supports for the dtype.
            async_op: Return a work handle instead of waiting.

        Returns:
            A work handle if ``async_op``, else ``None``; ``None`` on a non-member.

        Raises:
            CommTimeoutError: a peer did not join within the group's timeout (every op).
            CommError: the backend failed (a peer died, the group broke), or another thread's call is in flight on this
                communicator (every op).
            TypeError: ``tensor`` is not a tensor.
            ValueError: non-contiguous tensor, wrong device, or ``op`` unsupported by the backend or the dtype.
        """
        group = self._group
        if group is None:
            return None
        traced = compiling()  # constant under dynamo, which cannot trace is_neg
        try:  # a sparse compressed tensor raises in is_contiguous: the full check names it
            plain = (
                op is _SUM
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
            self._check_all_reduce(tensor, op, async_op)
            op = launched_op(op, tensor.dtype)
        if traced or (_coalescing and group in _coalescing) or has_torch_function_unary(tensor):
            return dist.all_reduce(tensor, op=op, group=self._traced_group("all_reduce"), async_op=async_op)
        if plain:
            opts = self._async.allreduce_sum if async_op else self._sync.allreduce_sum
        else:
            tensor, opts = as_real(tensor), (self._async if async_op else self._sync).allreduce[op]
        lock = self._lock
        if not lock.acquire(False):
            raise self._overlap("all_reduce")
        try:
            work = group.allreduce([tensor], opts)
            if async_op:
                return self._handle(work, "all_reduce")
            if work is not None:  # NCCL returns no work for a blocking call (it runs on the current stream)
                work.wait()
        except LAUNCH_ERRORS as err:
            raise self._failure("all_reduce", err) from err
        finally:
            lock.release()
        return None

    def all_gather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, async_op: bool = False) -> Any | None:
        """Gather ``input_tensor`` from every rank into ``output_tensor``, concatenated along dim 0.

        Args:
            output_tensor: Shape ``(world_size * n, *rest)`` for an input of shape ``(n, *rest)`` (or ``(world_size,
                *input.shape)``), same dtype and device as the input.
            input_tensor: This rank's contribution.
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
                isinstance(output_tensor, _Tensor)
                and isinstance(input_tensor, _Tensor)
                and output_tensor.dim() == 1 == input_tensor.dim()
                and (dtype := input_tensor.dtype) is output_tensor.dtype
                and self.on_device(output_tensor, input_tensor)
                and output_tensor.is_contiguous()
                and not output_tensor.is_nested
                and input_tensor.is_contiguous()
                and not input_tensor.is_nested
                and (traced or not (output_tensor.is_neg() or input_tensor.is_neg()))
                and output_tensor.numel() == self._world_size * input_tensor.numel()
                and not dtype.is_complex  # one dtype read for both tests
            )
        except RuntimeError:
            plain = False
        if not plain:
            self._check_all_gather(output_tensor, input_tensor, async_op)
            # The backend takes the concatenated shape as it is, the stacked one (and 0-d inputs) as flat views, which
            # have the same layout (both tensors are contiguous).
            if output_tensor.dim() != input_tensor.dim():
                output_tensor, input_tensor = output_tensor.view(-1), input_tensor.view(-1)
        if traced or (_coalescing and group in _coalescing) or has_torch_function_unary(input_tensor):
            return _all_gather_flat(
                output_tensor, input_tensor, group=self._traced_group("all_gather"), async_op=async_op
            )
        if not plain and input_tensor.is_complex():  # the check made both the same dtype
            output_tensor, input_tensor = torch.view_as_real(output_tensor), torch.view_as_real(input_tensor)
        opts = self._async.all_gather if async_op else self._sync.all_gather
        lock = self._lock
        if not lock.acquire(False):
            raise self._overlap("all_gather")
        try:
            work = group.all_gather_single(output_tensor, input_tensor, opts)
            if async_op:
                return self._handle(work, "all_gather")
            if work is not None:  # NCCL returns no work for a blocking call (it runs on the current stream)
                work.wait()
        except LAUNCH_ERRORS as err:
            raise self._failure("all_gather", err) from err
        finally:
            lock.release()
        return None

    def reduce_scatter(
        self, output: torch.Tensor, input_: torch.Tensor, op: Any = _SUM, async_op: bool = False
    ) -> Any | None:
        """Reduce ``input_`` across the group and leave this rank's dim-0 slice in ``output``.

        Args:
            output: Shape ``(n, *rest)``.
            input_: Shape ``(world_size * n, *rest)``, same dtype and device.
            op: A supported ``ReduceOp``.
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
                and isinstance(output, _Tensor)
                and isinstance(input_, _Tensor)
                and output.dim() == 1 == input_.dim()
                and (dtype := input_.dtype) is output.dtype
                and self.on_device(output, input_)
                and output.is_contiguous()
                and not output.is_nested
                and input_.is_contiguous()
                and not input_.is_nested
                and (traced or not (output.is_neg() or input_.is_neg()))
                and input_.numel() == output.numel() * self._world_size
                and not dtype.is_complex  # one dtype read for these tests
                and dtype is not _BOOL
            )
        except RuntimeError:
            plain = False
        if not plain:
            self._check_reduce_scatter(output, input_, op, async_op)
            op = launched_op(op, input_.dtype)
            # Any shapes of the right sizes: both tensors are contiguous, so flat views have their layout.
            if output.dim() != 1:
                output = output.view(-1)
            if input_.dim() != 1:
                input_ = input_.view(-1)
        if traced or (_coalescing and group in _coalescing) or has_torch_function_unary(input_):
            return _reduce_scatter_flat(
                output, input_, op=op, group=self._traced_group("reduce_scatter"), async_op=async_op
            )
        if not plain and input_.is_complex():  # SUM or AVG (checked): exact on the real pairs
            output, input_ = torch.view_as_real(output).view(-1), torch.view_as_real(input_).view(-1)
        if plain:
            opts = self._async.reduce_scatter_sum if async_op else self._sync.reduce_scatter_sum
        else:
            opts = (self._async if async_op else self._sync).reduce_scatter[op]
        lock = self._lock
        if not lock.acquire(False):
            raise self._overlap("reduce_scatter")
        try:
            work = group.reduce_scatter_single(output, input_, opts)
            if async_op:
                return self._handle(work, "reduce_scatter")
            if work is not None:  # NCCL returns no work for a blocking call (it runs on the current stream)
                work.wait()
        except LAUNCH_ERRORS as err:
            raise self._failure("reduce_scatter", err) from err
        finally:
            lock.release()
        return None

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input_: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        async_op: bool = False,
    ) -> Any | None:
        """Split ``input_`` along dim 0, send the i-th piece to group rank i, concatenate what arrives into ``output``.

        Without split sizes both tensors split evenly into ``world_size`` pieces.

        Returns:
            A work handle if ``async_op``, else ``None``; ``None`` on a non-member.
        """
        group = self._group
        if group is None:
            return None
        traced = compiling()  # constant under dynamo, which cannot trace is_neg
        try:  # flat tensors split evenly
            plain = (
                output_split_sizes is None
                and input_split_sizes is None
                and isinstance(output, _Tensor)
                and isinstance(input_, _Tensor)
                and output.dim() == 1 == input_.dim()
                and (dtype := input_.dtype) is output.dtype
                and self.on_device(output, input_)
                and output.is_contiguous()
                and not output.is_nested
                and input_.is_contiguous()
                and not input_.is_nested
                and (traced or not (output.is_neg() or input_.is_neg()))
                and not output.numel() % self._world_size
                and not input_.numel() % self._world_size
                and not dtype.is_complex  # one dtype read for both tests
            )
        except RuntimeError:
            plain = False
        if not plain:
            self._check_all_to_all_single(output, input_, output_split_sizes, input_split_sizes, async_op)
        if _coalescing and group in _coalescing:
            raise self._coalesced("all_to_all_single")
        if traced or has_torch_function_unary(input_):
            return dist.all_to_all_single(
                output,
                input_,
                output_split_sizes,
                input_split_sizes,
                group=self._traced_group("all_to_all_single"),
                async_op=async_op,
            )
        if not plain and input_.is_complex():  # the check made both the same dtype
            output, input_ = torch.view_as_real(output), torch.view_as_real(input_)
        opts = self._async.all_to_all if async_op else self._sync.all_to_all
        lock = self._lock
        if not lock.acquire(False):
            raise self._overlap("all_to_all_single")
        try:
            work = group.all_to_all_single(output, input_, output_split_sizes or [], input_split_sizes or [], opts)
            if async_op:
                return self._handle(work, "all_to_all_single")
            if work is not None:  # NCCL returns no work for a blocking call (it runs on the current stream)
                work.wait()
        except LAUNCH_ERRORS as err:
            raise self._failure("all_to_all_single", err) from err
        finally:
            lock.release()
        return None

    def barrier(self) -> None:
        """Block until every rank of the group reaches this call (no-op on a non-member)."""
        group = self._group
        if group is None:
            return None
        if _coalescing and group in _coalescing:
            raise self._coalesced("barrier")
        if compiling():
            return dist.barrier(group=self._traced_group("barrier"), device_ids=self._barrier_device_ids())
        opts = self._barrier_options()
        lock = self._lock
        if not lock.acquire(False):
            raise self._overlap("barrier")
        try:
            work = group.barrier(opts)
            if work is not None:
                work.wait()
        except LAUNCH_ERRORS as err:
            raise self._failure("barrier", err) from err
        finally:
            lock.release()
        return None
