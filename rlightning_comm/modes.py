"""Names of the communication groups a :class:`~rlightning_comm.CommContext` binds."""

from __future__ import annotations

from enum import Enum


class CommMode(str, Enum):
    """A named communication group.

    A member compares and hashes equal to its string name (``CommMode.GLOBAL == "GLOBAL"``), so every API that takes a
    mode also takes the plain string, and a custom mode is just any other string.
    """

    GLOBAL = "GLOBAL"
    INTRA_NODE = "INTRA_NODE"
    INTER_NODE = "INTER_NODE"
    TRAIN_DATA_PARALLEL = "TRAIN_DATA_PARALLEL"
    DATA_PARALLEL = "DATA_PARALLEL"
    TENSOR_PARALLEL = "TENSOR_PARALLEL"
    SEQUENCE_PARALLEL = "SEQUENCE_PARALLEL"
    WEIGHT_TRANSFER = "WEIGHT_TRANSFER"

    def __str__(self) -> str:
        return self.value

    __hash__ = str.__hash__


class ParallelMode(str, Enum):
    """The seed's ``ParallelMode``: every :class:`CommMode` name, with equal values.

    In the seed ``ParallelMode`` extends ``CommMode``, so ``ParallelMode.INTRA_NODE`` is a name too; here both carry
    every name and compare and hash equal (``ParallelMode.INTRA_NODE == CommMode.INTRA_NODE == "INTRA_NODE"``), so
    either spelling resolves to the same bound communicator.
    """

    GLOBAL = "GLOBAL"
    INTRA_NODE = "INTRA_NODE"
    INTER_NODE = "INTER_NODE"
    TRAIN_DATA_PARALLEL = "TRAIN_DATA_PARALLEL"
    DATA_PARALLEL = "DATA_PARALLEL"
    TENSOR_PARALLEL = "TENSOR_PARALLEL"
    SEQUENCE_PARALLEL = "SEQUENCE_PARALLEL"
    WEIGHT_TRANSFER = "WEIGHT_TRANSFER"

    def __str__(self) -> str:
        return self.value

    __hash__ = str.__hash__


def mode_name(mode: CommMode | ParallelMode | str) -> str:
    """Return the plain string name of ``mode``.

    Raises:
        TypeError: ``mode`` is not a string or a mode enum member.
        ValueError: ``mode`` is the empty string.
    """
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a CommMode, a ParallelMode or a str; got {type(mode).__name__} {mode!r}")
    name = mode.value if isinstance(mode, Enum) else str(mode)
    if not name:
        raise ValueError("mode must be a non-empty string; got ''")
    return name
