"""The eager launch: the process group called directly, with option objects built once when the communicator is bound.

``torch.distributed.all_reduce(t, group=pg)`` builds an options object, looks up the group rank of ``src``, checks the
tensor and the membership again, consults the coalescing manager and goes through a logging wrapper on every call. A
communicator knows its group, its ranks and its checks, so on the eager path it calls ``pg.allreduce([t], opts)`` with
``opts`` built at bind time and ``src``'s group rank read from a dict. What that skips, decided:

* torch's ``_coalescing_manager`` (a private API) is consulted only for its
  state (``group in _compat.COALESCING``, a dict lookup): inside a manager on
  the communicator's group, ``all_reduce``, ``all_gather`` and ``reduce_scatter`` go to ``torch.distributed``, which
  records them for the manager's one coalesced call; the other ops are refused.
* c10d's exception logger: the library translates every backend failure into its own error (naming the mode, the op and
  the timeout) instead.
* ``__torch_function__`` dispatch and dynamo: a tensor subclass or an active torch function mode, and tracing under
  ``torch.compile``, take the ``torch.distributed`` function itself (``compiling() or has_torch_function_unary(t)`` at
  the top of each method), which dynamo rewrites into functional collectives (``broadcast``, which dynamo does not
  rewrite, calls the functional one itself).

What torch's wrappers do that matters is kept: complex tensors go as real pairs where torch does it (``all_reduce``,
``broadcast``, ``all_gather``, ``scatter``, ``all_to_all_single``) and also for ``gather`` (an exact byte copy that gloo
otherwise refuses), and a blocking call waits for its work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllgatherOptions

from rlightning_comm.errors import CommError
from rlightning_comm.failures import LAUNCH_ERRORS, WorkHandle, comm_failure

compiling = torch.compiler.is_dynamo_compiling
"""Whether dynamo is tracing (constant ``False`` in eager, ``True`` while dynamo traces; cheaper than
``torch.compiler.is_compiling``)."""


def as_real(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the backend can move it: a complex tensor as its real pairs (exact), anything else as it is."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def rooted_args(tensor: torch.Tensor, tensors: Any, on_root: bool) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """gather/scatter: ``tensor`` and the root's list as the process group takes them (complex as real pairs; ``[]`` off
    the root)."""
    if tensor.is_complex():  # the check made the list's dtype the tensor's
        tensor = torch.view_as_real(tensor)
        tensors = [torch.view_as_real(t) for t in tensors] if on_root else None
    return tensor, [list(tensors)] if on_root else []


def _with(cls: Any, async_op: bool, **fields: Any) -> Any:
    opts = cls()
    opts.asyncOp = async_op
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


class Options:
    """The backend option objects of one group for blocking (``async_op=False``) or async calls, built once."""

    __slots__ = (
        "all_gather",
        "all_to_all",
        "allreduce",
        "allreduce_sum",
        "async_op",
        "broadcast",
        "gather",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_sum",
        "reduce_sum",
        "scatter",
    )

    def __init__(self, group_rank_of: dict[int, int], reduce_ops: frozenset[Any], async_op: bool) -> None:
        self.async_op = async_op
        ops = reduce_ops | {ReduceOp.SUM}
        self.allreduce = {op: _with(dist.AllreduceOptions, async_op, reduceOp=op) for op in ops}
        self.reduce_scatter = {op: _with(dist.ReduceScatterOptions, async_op, reduceOp=op) for op in ops}
        # SUM without the dict: hashing a ReduceOp costs more than the rest of the lookup.
        self.allreduce_sum = self.allreduce[ReduceOp.SUM]
        self.reduce_scatter_sum = self.reduce_scatter[ReduceOp.SUM]
        self.broadcast = {
            r: _with(dist.BroadcastOptions, async_op, rootRank=g, rootTensor=0) for r, g in group_rank_of.items()
        }
        self.gather = {r: _with(dist.GatherOptions, async_op, rootRank=g) for r, g in group_rank_of.items()}
        self.scatter = {r: _with(dist.ScatterOptions, async_op, rootRank=g) for r, g in group_rank_of.items()}
        self.reduce_sum = {
            r: _with(dist.ReduceOptions, async_op, reduceOp=ReduceOp.SUM, rootRank=g, rootTensor=0)
            for r, g in group_rank_of.items()
        }
        self.reduce: dict[
            tuple[Any, int], Any
        ] = {}  # (op, dst) -> options, built on first use (ops x ranks may be many)
        self.all_gather = _with(AllgatherOptions, async_op)
        self.all_to_all = _with(dist.AllToAllOptions, async_op)


class DirectLaunch:
    """Mixin of :class:`Communicator`: options built at bind time, handles and failure translation (each method launches
    itself, see :mod:`._tensor_collectives`)."""

    _group: Any
    _mode: str
    _timeout: float | None
    _bounded_wait: bool
    _lock: Any
    _group_rank_of: dict[int, int]
    _outside_world: bool
    supported_reduce_ops: Any

    def _init_launch(self) -> None:
        self._async = Options(self._group_rank_of, self.supported_reduce_ops, True)
        # Bounded wait: blocking calls launch as async ones, so the backend returns a work whose wait() blocks the host.
        self._sync = (
            self._async if self._bounded_wait else Options(self._group_rank_of, self.supported_reduce_ops, False)
        )
        self._barrier_opts: Any = None

    def _failure(self, op: str, err: BaseException) -> Exception:
        return comm_failure(err, self._mode, op, self._timeout)

    def _reduce_options(self, op: Any, dst: int, async_op: bool) -> Any:
        """``reduce``'s options for a checked ``op`` and root ``dst``, built once per pair."""
        table = self._async if async_op else self._sync
        opts = table.reduce.get((op, dst))
        if opts is None:
            opts = table.reduce[(op, dst)] = _with(
                dist.ReduceOptions, table.async_op, reduceOp=op, rootRank=self._group_rank_of[dst], rootTensor=0
            )
        return opts

    def _run(self, op: str, launch: Callable[[], Any]) -> None:
        """A blocking launch off the hot path (the object collectives): ``launch()`` returns the backend's work, waited
        here.

        The caller holds the claim. Backend failures become the library's errors naming ``op``.
        """
        try:
            work = launch()
            if work is not None:
                work.wait()
        except LAUNCH_ERRORS as err:
            raise self._failure(op, err) from err

    def _handle(self, work: Any, op: str) -> WorkHandle:
        return WorkHandle(work, self._mode, op, self._timeout, failure=self._failure)

    def _traced_group(self, op: str) -> Any:
        """The group for torch.distributed's own functions (the compiled and ``__torch_function__`` paths).

        Raises:
            CommError: the group is outside torch's world (a connected mode): those functions do not know it.
        """
        if self._outside_world:
            raise CommError(
                f"{op} on mode {self._mode!r} cannot run under torch.compile or through __torch_function__ (a tensor "
                "subclass or a "
                "torch function mode): the mode is connected outside torch.distributed's world, whose functions do not "
                "know its group. "
                "Hint: call it outside the compiled region, with a plain tensor"
            )
        return self._group

    def _coalesced(self, op: str) -> CommError:
        return CommError(
            f"{op} on mode {self._mode!r} was called inside torch's _coalescing_manager on this mode's group, which "
            "coalesces only "
            "all_reduce, all_gather and reduce_scatter (those go to torch.distributed and are issued when the manager "
            "exits); "
            "nothing was sent. Hint: call it before or after the manager's block"
        )

    def _overlap(self, op: str) -> CommError:  # provided by InFlight
        raise NotImplementedError

    def _barrier_options(self) -> Any:
        opts = self._barrier_opts
        if opts is None:
            opts = dist.BarrierOptions()
            opts.asyncOp = self._bounded_wait
            device_ids = self._barrier_device_ids()
            if device_ids:
                opts.device_ids = device_ids
                opts.device = torch.device("cuda", device_ids[0])
            else:
                opts.device = torch.device("cpu")
            self._barrier_opts = opts
        return opts

    def _barrier_device_ids(self) -> list[int] | None:
        """Devices a barrier synchronises (NCCL needs this rank's GPU); ``None`` for host backends."""
        return None
