"""Turn what the caller names as a group into (process group, size, rank), and the local input checks every op shares."""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from rlightning_comm.communicators.base import Communicator
from rlightning_comm.context import CommContext
from rlightning_comm.errors import CommError
from rlightning_comm.failures import comm_failure


class Group(NamedTuple):
    """A resolved group: the torch process group, its size, this process's rank in it, and what the caller passed."""

    pg: Any
    world_size: int
    rank: int
    source: Any

    @property
    def name(self) -> str:
        """The group as error messages name it (built only when one is raised)."""
        if isinstance(self.source, Communicator):
            return f"mode {self.source.mode!r}"
        return f"process group {getattr(self.source, 'group_name', '?')!r}"

    def failure(self, op: str, err: BaseException) -> CommError:
        """The library's error for a backend failure of ``op`` (a timeout or a broken group), as the communicators raise it."""
        if isinstance(self.source, Communicator):
            return self.source._failure(op, err)
        return comm_failure(err, str(getattr(self.source, "group_name", "?")), op, None)


def resolve_group(group: Any) -> Group:
    """Resolve a :class:`CommMode` (or its string), a :class:`Communicator` or a torch ``ProcessGroup``.

    Raises:
        TypeError: ``group`` is none of these.
        ModeNotBoundError: a mode that :class:`CommContext` has not bound.
        CommError: this process is not a member of the group.
    """
    if isinstance(group, str):
        group = CommContext().get_communicator(group)
    if isinstance(group, Communicator):
        if not group.is_member:
            raise CommError(f"this process is not a member of mode {group.mode!r} (ranks {list(group.ranks)}); sequence-parallel ops need a member")
        return Group(group.group, group.world_size, group.rank, group)
    if isinstance(group, dist.ProcessGroup):
        return Group(group, group.size(), group.rank(), group)  # non-members hold NON_GROUP_MEMBER, not a ProcessGroup
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise CommError("this process is not a member of the given group (got GroupMember.NON_GROUP_MEMBER); sequence-parallel ops need a member")
    raise TypeError(
        f"group must be a CommMode or its string name, a Communicator or a torch.distributed ProcessGroup; got {type(group).__name__} {group!r}. "
        "Hint: for the whole world pass CommMode.GLOBAL or torch.distributed.group.WORLD"
    )


def check_input(input_: Any, group: Group, name: str = "input_") -> None:
    """Raise ``TypeError`` for a non-tensor and ``ValueError`` for a device the group's backend cannot use.

    A communicator applies its own backend's device rule; a raw process group
    refuses CPU tensors when it is a plain NCCL group (a ``cpu:gloo,cuda:nccl``
    group takes them). Strided inputs are fine: the ops copy into one buffer.
    """
    if not isinstance(input_, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(input_).__name__} ({group.name})")
    if group.world_size == 1:
        return
    if isinstance(group.source, Communicator):
        group.source._check_device(input_, name)
    elif input_.device.type != "cuda" and group.pg.name() == "nccl":
        raise ValueError(f"{name} is on {input_.device}, but {group.name} uses NCCL, which needs CUDA tensors. Hint: move it with .cuda()")


def check_flag(value: Any, name: str) -> bool:
    """Return ``value`` if it is a bool; raise ``TypeError`` otherwise (a truthy tensor or string is a mistake, not a flag)."""
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
        raise ValueError(f"{name}={dim} is out of range for a tensor of {ndim} dimension(s); expected {-ndim} <= {name} < {ndim}")
    return dim % ndim
