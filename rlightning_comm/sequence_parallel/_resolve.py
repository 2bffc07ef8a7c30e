"""Turn what the caller names as a group into a :class:`Group` (eager) or a :class:`TracedGroup` (under torch.compile),
and the local input checks every op shares.

A :class:`Group` issues its collectives through the group's :class:`Communicator` methods, so debug mode and stats see
them; a raw ``ProcessGroup`` gets a communicator of its backend's registered class, made once per group. A
:class:`TracedGroup` holds only the group's name and two ints (nothing that breaks a graph when an autograd ctx keeps
it: pytorch#129942) and uses the functional collectives.

Under torch.compile the resolution is traced, as the collective facades' mode lookup is: dynamo reads the context's
binding of the mode and the communicator's group name, size and rank, and guards on each value it read. A binding that
changes (``destroy()`` and a new declaration, the same group name with this rank elsewhere, or the name now another
mode's) fails a guard and the function is traced again; an unbound mode raises while tracing. Nothing of this runs in
the compiled steady state but the guards.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from rlightning_comm.communicators.base import Communicator
from rlightning_comm.communicators.registry import get_communicator_class
from rlightning_comm.context import CommContext
from rlightning_comm.errors import CommError, CommMismatchError
from rlightning_comm.sequence_parallel._sizes import forgotten_lengths_hint

_WRAPPED: weakref.WeakKeyDictionary[Any, Communicator] = weakref.WeakKeyDictionary()
_CONTEXT = CommContext()


class Group:
    """A resolved group on the eager path: its communicator, size and this process's rank in it."""

    __slots__ = ("_assumed", "comm", "rank", "world_size")

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.world_size = comm.world_size
        self.rank = comm.rank
        self._assumed: tuple[str, int, int] | None = None

    def assume_lengths(self, name: str, dim: int, length: int) -> None:
        """Note that ``name`` was not given, so every rank's length along ``dim`` was taken as this rank's ``length``.

        A debug-mode mismatch of the collective that follows then says so, when the ranks' shapes show their lengths
        differ.
        """
        self._assumed = (name, dim, length)

    def _explain(self, err: CommMismatchError, sent: str) -> None:
        """Raise ``err`` with the hint naming the lengths argument when its shapes of the argument ``sent`` call for it;
        else return."""
        shapes = getattr(err, "shapes", None)
        if self._assumed is None or shapes is None:
            return
        wire = [shapes.get(r, {}).get(sent) for r in self.comm.ranks]
        hint = None if None in wire else forgotten_lengths_hint(wire, self.rank, *self._assumed)
        if hint is not None:
            hinted = CommMismatchError(f"{err}. {hint}")
            hinted.shapes = shapes  # type: ignore[attr-defined]
            raise hinted from err

    @property
    def name(self) -> str:
        """The group as error messages name it."""
        return f"mode {self.comm.mode!r}"

    def all_to_all(self, send: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None) -> torch.Tensor:
        """``all_to_all_single`` of the contiguous ``send`` (rows along dim 0) into a new tensor with the same row
        shape."""
        out = torch.empty_like(send) if out_splits is None else send.new_empty((sum(out_splits), *send.shape[1:]))
        try:
            self.comm.all_to_all_single(out, send, out_splits, in_splits)
        except CommMismatchError as err:
            self._explain(err, "input_")
            raise
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's contiguous ``x`` (same shape everywhere), stacked: ``[world_size, *x.shape]``."""
        out = x.new_empty((self.world_size, *x.shape))
        try:
            self.comm.all_gather(out, x)
        except CommMismatchError as err:
            self._explain(err, "input_tensor")
            raise
        return out

    def reduce_scatter(self, send: torch.Tensor) -> torch.Tensor:
        """Sum of the contiguous ``send`` (``[world_size, *chunk]``) over the ranks, keeping row ``rank``: ``chunk``."""
        out = send.new_empty(send.shape[1:])
        self.comm.reduce_scatter(out, send)
        return out


class TracedGroup(NamedTuple):
    """A resolved group under torch.compile: the process group's name, its size and this process's rank in it."""

    group_name: str
    world_size: int
    rank: int

    @property
    def name(self) -> str:
        """The group as error messages name it."""
        return f"process group {self.group_name!r}"

    def assume_lengths(self, name: str, dim: int, length: int) -> None:
        """As :meth:`Group.assume_lengths`; nothing to note: compiled code runs no debug mode."""

    def all_to_all(self, send: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None) -> torch.Tensor:
        """As :meth:`Group.all_to_all`, with the functional collective."""
        return funcol.wait_tensor(funcol.all_to_all_single(send, out_splits, in_splits, self.group_name))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """As :meth:`Group.all_gather`, with the functional collective."""
        return funcol.wait_tensor(funcol.all_gather_tensor(x.reshape(-1), 0, self.group_name)).view(
            self.world_size, *x.shape
        )

    def reduce_scatter(self, send: torch.Tensor) -> torch.Tensor:
        """As :meth:`Group.reduce_scatter`, with the functional collective."""
        return funcol.wait_tensor(funcol.reduce_scatter_tensor(send.reshape(-1), "sum", 0, self.group_name)).view(
            send.shape[1:]
        )


def _communicator(group: Any) -> Communicator:
    if isinstance(group, Communicator):
        comm = group
    elif isinstance(group, str):
        comm = _CONTEXT.get_communicator(group)
    elif isinstance(group, dist.ProcessGroup):
        comm = _WRAPPED.get(group)
        if comm is None:
            cls = get_communicator_class(str(dist.get_backend(group)).split(":")[-1].split(",")[0])
            comm = _WRAPPED[group] = cls(
                group, dist.get_process_group_ranks(group), f"process group {group.group_name}"
            )
    elif group is dist.GroupMember.NON_GROUP_MEMBER:
        raise CommError(
            "this process is not a member of the given group (got GroupMember.NON_GROUP_MEMBER); sequence-parallel ops "
            "need a member"
        )
    else:
        raise TypeError(
            "group must be a CommMode or its string name, a Communicator or a torch.distributed ProcessGroup; got "
            f"{type(group).__name__} {group!r}. "
            "Hint: for the whole world pass CommMode.GLOBAL or torch.distributed.group.WORLD"
        )
    if not comm.is_member:
        raise CommError(
            f"this process is not a member of mode {comm.mode!r} (ranks {list(comm.ranks)}); sequence-parallel ops "
            "need a member"
        )
    return comm


def _bound_to(pg: dist.ProcessGroup) -> Communicator | None:
    """The context's communicator whose group is ``pg``, matched by group name (what dynamo guards on a group)."""
    name = pg.group_name
    for mode in _CONTEXT.bound_modes():
        comm = _CONTEXT.get_communicator(mode)
        if comm.group is not None and comm.group.group_name == name:
            return comm
    return None


def _traced(group: Any) -> TracedGroup:
    """Resolve under torch.compile, reading only values dynamo guards: a new binding retraces (see the module
    docstring)."""
    if isinstance(group, dist.ProcessGroup):
        # dynamo bakes pg.rank() and pg.size() without a guard (only the group's name is guarded), so a group the
        # context binds is read through its communicator; any other group is the caller's to keep.
        comm = _bound_to(group)
        if comm is None:
            return TracedGroup(group.group_name, group.size(), group.rank())
    else:
        comm = _communicator(group)
    return TracedGroup(comm.group.group_name, comm.world_size, comm.rank)


def resolve_group(group: Any) -> Group | TracedGroup:
    """Resolve a :class:`CommMode` (or its string), a :class:`Communicator` or a torch ``ProcessGroup``.

    Raises:
        TypeError: ``group`` is none of these.
        ModeNotBoundError: a mode that :class:`CommContext` has not bound.
        CommError: this process is not a member of the group.
    """
    if torch.compiler.is_compiling():
        return _traced(group)
    return Group(_communicator(group))


def check_input(input_: Any, group: Group | TracedGroup, name: str = "input_") -> None:
    """Raise ``TypeError`` for a non-tensor and ``ValueError`` for a device the group's backend cannot use.

    Strided inputs are fine: the ops copy into one buffer.
    """
    if not isinstance(input_, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(input_).__name__} ({group.name})")
    if group.world_size > 1 and isinstance(group, Group):
        group.comm.check_device(input_, name)


def check_flag(value: Any, name: str) -> bool:
    """Return ``value`` if it is a bool; raise ``TypeError`` otherwise (a truthy tensor or string is a mistake, not a
    flag)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__} {value!r}")
    return value


def normalize_dim(dim: Any, ndim: int, name: str) -> int:
    """Return ``dim`` in ``[0, ndim)``, accepting negative dims as torch does.

    Raises:
        TypeError: ``dim`` is not an int.
        ValueError: ``dim`` is out of range.
    """
    if isinstance(dim, bool):
        raise TypeError(f"{name} must be an int; got bool {dim!r}")
    try:
        dim = operator.index(dim)
    except TypeError:
        raise TypeError(f"{name} must be an int; got {type(dim).__name__} {dim!r}") from None
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{name}={dim} is out of range for a tensor of {ndim} dimension(s); expected {-ndim} <= {name} < {ndim}"
        )
    return dim % ndim
