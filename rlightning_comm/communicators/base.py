"""The communicator contract: one process group, every collective of the API."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from rlightning_comm.communicators._contract import check_shapes
from rlightning_comm.communicators._launch import DirectLaunch
from rlightning_comm.communicators._op_checks import OpChecks
from rlightning_comm.communicators._p2p import PointToPoint
from rlightning_comm.communicators._rooted import RootedCollectives
from rlightning_comm.communicators._tensor_collectives import TensorCollectives
from rlightning_comm.communicators._threads import InFlight
from rlightning_comm.communicators._values import ValueCollectives
from rlightning_comm.errors import CommError

_SUM = ReduceOp.SUM

COLLECTIVES = (
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_reduce_dict",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
)
"""Names of the :class:`Communicator` methods that communicate (what debug mode checks and stats record), point-to-point
included."""


class Communicator(
    OpChecks, InFlight, DirectLaunch, TensorCollectives, RootedCollectives, PointToPoint, ValueCollectives, ABC
):
    """Collectives on one process group, bound to one mode by :class:`CommContext`.

    Every method takes and returns what the torch.distributed function of the same name does, except: ``src``/``dst``
    must be global ranks of this group (checked); inputs are validated before any collective starts (a bad argument
    raises locally instead of hanging the peers); on a non-member every collective returns ``None`` and changes nothing;
    ``all_gather`` takes one output tensor (torch's list form is refused: pass a tensor of shape ``(world_size,
    *input.shape)``); ``gather``/``scatter`` read their list on the root only (torch refuses one on other ranks; it is
    ignored here).

    Failures: a collective that a peer never joins raises
    :class:`CommTimeoutError` after the group's ``timeout``; one that fails in the backend (a peer died, the group
    broke) raises :class:`CommError`; both name the mode and the op and chain the backend's error. An ``async_op`` call
    returns a :class:`~rlightning_comm.failures.WorkHandle` whose ``wait()`` raises the same errors. Tensors must be
    contiguous: a strided view is refused (``ValueError``) rather than copied, so no op ever reads or writes the memory
    around a view.

    Threads: any thread may call, one call at a time (a pool, a
    weight-updater thread, a gradient hook on autograd's threads). A call that starts while another thread's call is in
    flight on the same process group (through this communicator or any other of that group) raises :class:`CommError`
    naming both threads, before anything is sent (two threads' calls could pair up differently on different ranks).

    Subclasses implement what differs between backends, the extension points:

    * :attr:`device` (a property): where the backend stages its own buffers;
    * :meth:`check_device` ``(self, tensor, name) -> None``: refuse a tensor whose device the backend cannot use;
    * :meth:`on_device` ``(a, b) -> bool`` (a ``@staticmethod``, optional): the fast path's device test, true only where
      :meth:`check_device` would accept both tensors;
    * the class attributes :attr:`backend` and :attr:`supported_reduce_ops` (and optionally
      :attr:`integer_avg_supported`, :attr:`supported_dtypes`, :meth:`setup_process`, :meth:`bind_device`).

    A subclass that defines one of them with another shape is a ``TypeError`` when the class is created;
    :func:`register_communicator` also refuses a class that still lacks one, listing everything that is missing.
    Register a subclass to use it as ``init_group(..., backend=name)``.

    Args:
        group: The torch process group, or ``None`` on a rank that is not a member.
        ranks: Global ranks of the group, in group-rank order.
        mode: Name of the mode this communicator is bound to (used in messages).
        timeout: The group's timeout in seconds (used in messages), if known.
        bounded_wait: On NCCL, every blocking call (and every ``WorkHandle.wait``) waits on the host for its work,
            within the group's timeout, so a peer that never joins raises :class:`CommTimeoutError` instead of torch's
            watchdog taking the process down; the group must have been created with ``TORCH_NCCL_BLOCKING_WAIT=1`` (the
            context sets it for ``init_distributed_env(bounded_wait=True)``). No effect on gloo, whose calls always wait
            so.
        rank: For a group outside torch.distributed's world (a connected mode, see :meth:`CommContext.connect`): this
            process's rank in the numbering of ``ranks``, whose ``src``/``dst`` then mean that numbering. ``None`` (a
            group of the world) reads the world rank. A group outside the world is a backend object that
            torch.distributed's functions do not know, so its compiled and ``__torch_function__`` paths are refused
            (:class:`CommError`); the eager path calls the group itself.
    """

    backend: ClassVar[str]
    """The torch.distributed backend the context creates this communicator's group with."""

    supported_reduce_ops: ClassVar[frozenset[Any]]
    """The ``ReduceOp`` values this backend implements."""

    integer_avg_supported: ClassVar[bool] = True
    """Whether ``ReduceOp.AVG`` works on integer tensors with this backend."""

    supported_dtypes: ClassVar[frozenset[torch.dtype] | None] = None
    """The dtypes this backend moves (complex ones as their real pairs), checked before any collective; ``None``: the
    backend's own check decides."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        ranks: Sequence[int],
        mode: str,
        timeout: float | None = None,
        *,
        bounded_wait: bool = False,
        rank: int | None = None,
    ) -> None:
        self._group = group
        self._timeout = None if timeout is None else float(timeout)
        # gloo's own wait already blocks the host within the group's timeout; NCCL's does only in blocking-wait mode,
        # and only for a call that returns its work, so there blocking calls are launched as async ones and waited.
        self._bounded_wait = bool(bounded_wait) and self.backend == "nccl"
        self._init_claim()
        self._ranks = tuple(int(r) for r in ranks)
        self._group_rank_of = {r: i for i, r in enumerate(self._ranks)}
        self._mode = str(mode)
        self._world_size = len(self._ranks)
        self._outside_world = rank is not None
        self._global_rank = int(rank) if rank is not None else dist.get_rank() if dist.is_initialized() else 0
        if group is not None and self._global_rank not in self._group_rank_of:
            raise ValueError(
                f"global rank {self._global_rank} has a group for mode {self._mode!r} but is not in its ranks "
                f"{list(self._ranks)}"
            )
        self._rank = self._ranks.index(self._global_rank) if group is not None else -1
        self._init_launch()

    @classmethod
    def setup_process(cls) -> None:
        """Prepare this process before the world is initialised with this backend.

        Called by :meth:`CommContext.init_distributed_env` before ``init_process_group``; the default does nothing.
        """

    @classmethod
    def bind_device(cls) -> torch.device | None:
        """The accelerator this process's groups of this backend are bound to, or ``None`` (host backends: the default).

        :meth:`CommContext.init_distributed_env` passes it to ``init_process_group(device_id=...)`` (torch then connects
        eagerly and splits later groups from the world's communicator), and :meth:`CommContext.init_group` calls it
        before creating a group, so a bad environment is refused before anything is created.
        """
        return None

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
    def bounded_wait(self) -> bool:
        """Whether blocking calls wait on the host within the group's timeout because of the ``bounded_wait`` option
        (NCCL only)."""
        return self._bounded_wait

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
            raise CommError(
                f"global rank {self._global_rank} is not a member of mode {self._mode!r} (ranks {list(self._ranks)}); "
                "it has no rank there"
            )
        return self._rank

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device this backend stages its own buffers on (dict reduction, objects)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mode={self._mode!r}, ranks={list(self._ranks)}, member={self.is_member})"

    @abstractmethod
    def check_device(self, tensor: torch.Tensor, name: str) -> None:
        """Raise ``ValueError`` when this backend cannot use ``tensor``'s device (an extension point).

        Called by the full checks on every tensor argument, after its type and layout are checked and before its dtype
        is.

        Args:
            tensor: The tensor an op was given.
            name: The argument's name, for the message (``"tensor"``, ``"gather_list[1]"``).
        """

    @staticmethod
    def on_device(a: torch.Tensor, b: torch.Tensor) -> bool:
        """Whether ``a`` and ``b`` are on one device, of a kind :meth:`check_device` accepts: the collectives' fast path
        (an extension point).

        A ``@staticmethod`` of two tensors; an op passes one tensor twice to test one. A few attribute reads, traceable
        by dynamo (no ``operator.attrgetter``); false sends the call to the full checks, which call
        :meth:`check_device`. The default is always
        false: a subclass that does not override it gets the full checks on
        every call, and so does a subclass that overrides :meth:`check_device` without overriding this (it falls back to
        the default; see :meth:`__init_subclass__`).
        """
        return False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Check the extension points the subclass defines; one that changes :meth:`check_device` but not
        :meth:`on_device` gets the always-false default.

        Otherwise an inherited fast-path test (gloo's "both on the CPU") would accept tensors the subclass's stricter
        :meth:`check_device` refuses.

        Raises:
            TypeError: an extension point has another shape than documented (the message lists each, and what is
                expected).
        """
        super().__init_subclass__(**kwargs)
        check_shapes(cls)
        if "check_device" in cls.__dict__ and "on_device" not in cls.__dict__:
            cls.on_device = Communicator.__dict__["on_device"]  # type: ignore[method-assign]
