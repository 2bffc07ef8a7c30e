"""The communicator contract: one process group, every collective of the API."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol  # the traceable collectives; sequence_parallel uses them too
from torch.distributed import ReduceOp
from torch.overrides import has_torch_function_unary

from rlightning_comm._compat import all_gather_single as _all_gather_flat
from rlightning_comm._compat import reduce_scatter_single as _reduce_scatter_flat
from rlightning_comm.communicators._checks import InputChecks
from rlightning_comm.communicators._launch import DirectLaunch, as_real, compiling, rooted_args
from rlightning_comm.communicators._threads import InFlight
from rlightning_comm.communicators._values import ValueCollectives
from rlightning_comm.errors import CommError

_SUM = ReduceOp.SUM

COLLECTIVES = (
    "all_gather",
    "all_reduce",
    "all_reduce_dict",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce_scatter",
    "scatter",
)
"""Names of the :class:`Communicator` methods that run a collective (what debug mode checks and stats record)."""


class Communicator(InputChecks, InFlight, DirectLaunch, ValueCollectives, ABC):
    """Collectives on one process group, bound to one mode by :class:`CommContext`.

    Every method takes and returns what the torch.distributed function of the
    same name does, except: ``src``/``dst`` must be global ranks of this group
    (checked); inputs are validated before any collective starts (a bad
    argument raises locally instead of hanging the peers); on a non-member
    every collective returns ``None`` and changes nothing; ``all_gather`` takes
    one output tensor (torch's list form is refused: pass a tensor of shape
    ``(world_size, *input.shape)``); ``gather``/``scatter`` read their list on
    the root only (torch refuses one on other ranks; it is ignored here).

    Failures: a collective that a peer never joins raises
    :class:`CommTimeoutError` after the group's ``timeout``; one that fails in
    the backend (a peer died, the group broke) raises :class:`CommError`; both
    name the mode and the op and chain the backend's error. An ``async_op``
    call returns a :class:`~rlightning_comm.failures.WorkHandle` whose
    ``wait()`` raises the same errors. Tensors must be contiguous: a strided
    view is refused (``ValueError``) rather than copied, so no op ever reads or
    writes the memory around a view.

    Threads: any thread may call, one call at a time (a pool, a
    weight-updater thread, a gradient hook on autograd's threads). A call that
    starts while another thread's call is in flight on the same communicator
    raises :class:`CommError` naming both threads, before anything is sent
    (two threads' calls could pair up differently on different ranks).

    Subclasses implement what differs between backends: :attr:`device`,
    :meth:`_check_device` and the class attributes :attr:`backend` and
    :attr:`supported_reduce_ops`. Register a subclass with
    :func:`register_communicator` to use it as ``init_group(..., backend=name)``.

    Args:
        group: The torch process group, or ``None`` on a rank that is not a member.
        ranks: Global ranks of the group, in group-rank order.
        mode: Name of the mode this communicator is bound to (used in messages).
        timeout: The group's timeout in seconds (used in messages), if known.
    """

    backend: ClassVar[str]
    """The torch.distributed backend the context creates this communicator's group with."""

    supported_reduce_ops: ClassVar[frozenset[Any]]
    """The ``ReduceOp`` values this backend implements."""

    integer_avg_supported: ClassVar[bool] = True
    """Whether ``ReduceOp.AVG`` works on integer tensors with this backend."""

    def __init__(self, group: dist.ProcessGroup | None, ranks: Sequence[int], mode: str, timeout: float | None = None) -> None:
        self._group = group
        self._timeout = None if timeout is None else float(timeout)
        self._init_claim()
        self._ranks = tuple(int(r) for r in ranks)
        self._group_rank_of = {r: i for i, r in enumerate(self._ranks)}
        self._mode = str(mode)
        self._world_size = len(self._ranks)
        self._global_rank = dist.get_rank() if dist.is_initialized() else 0
        if group is not None and self._global_rank not in self._group_rank_of:
            raise ValueError(f"global rank {self._global_rank} has a group for mode {self._mode!r} but is not in its ranks {list(self._ranks)}")
        self._rank = self._ranks.index(self._global_rank) if group is not None else -1
        self._init_launch()

    @classmethod
    def setup_process(cls) -> None:
        """Prepare this process before the world is initialised with this backend.

        Called by :meth:`CommContext.init_distributed_env` before
        ``init_process_group``; the default does nothing.
        """

    @property
    def mode(self) -> str:
        """Name of the mode this communicator is bound to."""
        return self._mode

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The torch process group, ``None`` on a non-member rank."""
        return self._group

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks of the group, in group-rank order."""
        return self._ranks

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self._world_size

    @property
    def timeout(self) -> float | None:
        """The group's timeout in seconds (``None`` when the creator did not pass it)."""
        return self._timeout

    @property
    def is_member(self) -> bool:
        """Whether this process is a member of the group."""
        return self._group is not None

    @property
    def rank(self) -> int:
        """This process's rank within the group.

        Raises:
            CommError: this process is not a member of the group.
        """
        if self._group is None:
            raise CommError(f"global rank {self._global_rank} is not a member of mode {self._mode!r} (ranks {list(self._ranks)}); it has no rank there")
        return self._rank

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device this backend stages its own buffers on (dict reduction, objects)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mode={self._mode!r}, ranks={list(self._ranks)}, member={self.is_member})"

    @abstractmethod
    def _check_device(self, tensor: torch.Tensor, name: str) -> None:
        """Raise ``ValueError`` when this backend cannot use ``tensor``'s device."""

    # -------------------------------------------------------------- collectives
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
            CommError: the backend failed (a peer died, the group broke), or
                another thread's call is in flight on this communicator (every op).
            TypeError: ``tensor`` is not a tensor.
            ValueError: non-contiguous tensor, wrong device, or ``op`` unsupported
                by the backend or the dtype.
        """
        group = self._group
        if group is None:
            return None
        self._check_all_reduce(tensor, op, async_op)
        if compiling() or has_torch_function_unary(tensor):
            return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        opts = self._async if async_op else self._sync
        return self._launch("all_reduce", group.allreduce, ([as_real(tensor)], opts.allreduce_sum if op is _SUM else opts.allreduce[op]), async_op)

    def all_gather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, async_op: bool = False) -> Any | None:
        """Gather ``input_tensor`` from every rank into ``output_tensor``, concatenated along dim 0.

        Args:
            output_tensor: Shape ``(world_size * n, *rest)`` for an input of
                shape ``(n, *rest)`` (or ``(world_size, *input.shape)``), same
                dtype and device as the input.
            input_tensor: This rank's contribution.
            async_op: Return a work handle instead of waiting.

        Returns:
            A work handle if ``async_op``, else ``None``; ``None`` on a non-member.
        """
        group = self._group
        if group is None:
            return None
        self._check_all_gather(output_tensor, input_tensor, async_op)
        # The backend takes the concatenated shape as it is; the stacked one (and 0-d inputs) as flat views, which have
        # the same layout (both tensors are contiguous). Only then: a view costs the backend more than our Python does.
        if output_tensor.dim() != input_tensor.dim():
            output_tensor, input_tensor = output_tensor.view(-1), input_tensor.view(-1)
        if compiling() or has_torch_function_unary(input_tensor):
            return _all_gather_flat(output_tensor, input_tensor, group=group, async_op=async_op)
        opts = (self._async if async_op else self._sync).all_gather
        if input_tensor.is_complex():  # the check made both the same dtype
            output_tensor, input_tensor = torch.view_as_real(output_tensor), torch.view_as_real(input_tensor)
        return self._launch("all_gather", group.all_gather_single, (output_tensor, input_tensor, opts), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Any | None:
        """Copy ``tensor`` from global rank ``src`` into ``tensor`` on every rank.

        Returns:
            A work handle if ``async_op``, else ``None``; ``None`` on a non-member.
        """
        group = self._group
        if group is None:
            return None
        self._check_broadcast(tensor, src, async_op)
        if compiling():  # dynamo does not rewrite dist.broadcast: the functional one, copied back in place
            tensor.copy_(funcol.wait_tensor(funcol.broadcast(tensor, self._group_rank_of[src], group)))
            return None
        if has_torch_function_unary(tensor):
            return dist.broadcast(tensor, src=src, group=group, async_op=async_op)
        return self._launch("broadcast", group.broadcast, ([as_real(tensor)], (self._async if async_op else self._sync).broadcast[src]), async_op)

    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, async_op: bool = False) -> Any | None:
        """Gather ``tensor`` from every rank into ``gather_list`` on global rank ``dst``.

        Args:
            tensor: This rank's contribution.
            gather_list: On ``dst``, one tensor per rank shaped like ``tensor``;
                ignored on other ranks.
            dst: Global rank that receives.
            async_op: Return a work handle instead of waiting.

        Returns:
            A work handle if ``async_op``, else ``None``; ``None`` on a non-member.
        """
        group = self._group
        if group is None:
            return None
        self._check_gather(tensor, gather_list, dst, async_op)
        on_root = self._global_rank == dst
        if compiling() or has_torch_function_unary(tensor):
            return dist.gather(tensor, list(gather_list) if on_root else None, dst=dst, group=group, async_op=async_op)
        tensor, outputs = rooted_args(tensor, gather_list, on_root)
        return self._launch("gather", group.gather, (outputs, [tensor], (self._async if async_op else self._sync).gather[dst]), async_op)

    def scatter(self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, async_op: bool = False) -> Any | None:
        """Send ``scatter_list[i]`` from global rank ``src`` to the group's i-th rank, into ``tensor``.

        Args:
            tensor: Output on every rank.
            scatter_list: On ``src``, one tensor per rank shaped like ``tensor``;
                ignored on other ranks.
            src: Global rank that sends.
            async_op: Return a work handle instead of waiting.

        Returns:
            A work handle if ``async_op``, else ``None``; ``None`` on a non-member.
        """
        group = self._group
        if group is None:
            return None
        self._check_scatter(tensor, scatter_list, src, async_op)
        on_root = self._global_rank == src
        if compiling() or has_torch_function_unary(tensor):
            return dist.scatter(tensor, list(scatter_list) if on_root else None, src=src, group=group, async_op=async_op)
        tensor, inputs = rooted_args(tensor, scatter_list, on_root)
        return self._launch("scatter", group.scatter, ([tensor], inputs, (self._async if async_op else self._sync).scatter[src]), async_op)

    def reduce_scatter(self, output: torch.Tensor, input_: torch.Tensor, op: Any = _SUM, async_op: bool = False) -> Any | None:
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
        self._check_reduce_scatter(output, input_, op, async_op)
        # Any shapes of the right sizes: both tensors are contiguous, so flat views have their layout (a view costs the
        # backend more than the rest of the call's Python, so 1-d tensors go as they are).
        if output.dim() != 1:
            output = output.view(-1)
        if input_.dim() != 1:
            input_ = input_.view(-1)
        if compiling() or has_torch_function_unary(input_):
            return _reduce_scatter_flat(output, input_, op=op, group=group, async_op=async_op)
        table = self._async if async_op else self._sync
        opts = table.reduce_scatter_sum if op is _SUM else table.reduce_scatter[op]
        return self._launch("reduce_scatter", group.reduce_scatter_single, (output, input_, opts), async_op)

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
        self._check_all_to_all_single(output, input_, output_split_sizes, input_split_sizes, async_op)
        if compiling() or has_torch_function_unary(input_):
            return dist.all_to_all_single(output, input_, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        opts = (self._async if async_op else self._sync).all_to_all
        if input_.is_complex():  # the check made both the same dtype
            output, input_ = torch.view_as_real(output), torch.view_as_real(input_)
        args = (output, input_, output_split_sizes or [], input_split_sizes or [], opts)
        return self._launch("all_to_all_single", group.all_to_all_single, args, async_op)

    def barrier(self) -> None:
        """Block until every rank of the group reaches this call (no-op on a non-member)."""
        group = self._group
        if group is None:
            return None
        if compiling():
            return dist.barrier(group=group, device_ids=self._barrier_device_ids())
        return self._launch("barrier", group.barrier, (self._barrier_options(),), False)
