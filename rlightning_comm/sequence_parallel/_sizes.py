"""How a sequence is split across ranks: the torch.tensor_split rule, caller-given lengths, and lengths exchanged in one collective."""

from __future__ import annotations

import math
import operator
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from rlightning_comm.sequence_parallel._collectives import all_gather_flat
from rlightning_comm.sequence_parallel._resolve import Group

# Shape metadata exchanged per rank: ndim, dtype code, length along the dim, then the shape (the dim's entry zeroed).
_META_SHAPE = 13
_META_LEN = 3 + _META_SHAPE


def sequence_split_sizes(length: int, world_size: int) -> list[int]:
    """Lengths of the chunks ``torch.tensor_split`` makes: the first ``length % world_size`` ranks get one more.

    Pass the result as ``seq_lens=`` to the gather-type ops to skip the
    exchange of lengths when every rank already knows them.

    Raises:
        ValueError: ``length`` is negative or ``world_size`` is not positive.
    """
    length, world_size = operator.index(length), operator.index(world_size)
    if length < 0 or world_size < 1:
        raise ValueError(f"expected length >= 0 and world_size >= 1; got length={length}, world_size={world_size}")
    base, extra = divmod(length, world_size)
    return [base + 1 if r < extra else base for r in range(world_size)]


def _as_sizes(sizes: Any, group: Group, name: str) -> list[int]:
    if type(sizes) is list and len(sizes) == group.world_size and all(type(s) is int and s >= 0 for s in sizes):
        return list(sizes)  # the common case, checked quickly; a copy, so later edits by the caller cannot reach backward
    if isinstance(sizes, (str, bytes, torch.Tensor)) or not isinstance(sizes, Sequence):
        raise TypeError(f"{name} must be a list of {group.world_size} ints, one per rank of {group.name}; got {type(sizes).__name__}")
    try:
        out = [operator.index(s) for s in sizes]
    except TypeError:
        raise TypeError(f"{name} must hold ints; got {list(sizes)!r} ({group.name})") from None
    if len(out) != group.world_size or min(out) < 0:
        raise ValueError(f"{name} must hold {group.world_size} non-negative ints, one per rank of {group.name}; got {out}")
    return out


def split_sizes(total: int, group: Group, sizes: Any, name: str) -> list[int]:
    """Per-rank chunk lengths of a dim of length ``total``: ``sizes`` checked, or the tensor_split rule when ``None``."""
    if sizes is None:
        return sequence_split_sizes(total, group.world_size)
    out = _as_sizes(sizes, group, name)
    if sum(out) != total:
        raise ValueError(f"{name} must sum to the length being split, {total}; got {out} (sum {sum(out)}, {group.name})")
    return out


def local_sizes(input_: torch.Tensor, dim: int, group: Group, sizes: Any, name: str) -> list[int]:
    """Every rank's length along ``dim``: ``sizes`` checked against this rank's length, or exchanged when ``None``.

    With one rank nothing is exchanged.
    """
    if sizes is None:
        return [input_.shape[dim]] if group.world_size == 1 else exchange_sizes(input_, dim, group)
    out = _as_sizes(sizes, group, name)
    if out[group.rank] != input_.shape[dim]:
        raise ValueError(f"{name}[{group.rank}] must be this rank's input length along dim {dim}, {input_.shape[dim]}; got {out[group.rank]} ({group.name})")
    return out


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())


_DTYPE_NAMES = {_dtype_code(d): str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _meta(input_: torch.Tensor, dim: int) -> list[int]:
    shape = list(input_.shape)
    shape[dim] = 0
    if len(shape) > _META_SHAPE:  # fold the trailing dims: still a strong check, fixed size on the wire
        shape = shape[: _META_SHAPE - 1] + [math.prod(shape[_META_SHAPE - 1 :])]
    shape += [-1] * (_META_SHAPE - len(shape))
    return [input_.dim(), _dtype_code(input_.dtype), input_.shape[dim], *shape]


def exchange_sizes(input_: torch.Tensor, dim: int, group: Group) -> list[int]:
    """All-gather every rank's length along ``dim`` in one small collective, and check the ranks agree on the rest.

    Raises:
        ValueError: on every rank alike, when ranks disagree on the number of
            dims, the dtype, or the shape outside ``dim``.
    """
    meta = torch.tensor(_meta(input_, dim), dtype=torch.int64, device=input_.device)
    rows = all_gather_flat(meta, group).view(group.world_size, _META_LEN).tolist()
    mine = rows[group.rank]
    for r, row in enumerate(rows):
        if row[:2] != mine[:2] or row[3:] != mine[3:]:
            raise ValueError(
                f"ranks of {group.name} must pass tensors that differ only along dim {dim}; rank {r} has "
                f"{_describe(row, dim)}, rank {group.rank} has {_describe(mine, dim)}"
            )
    return [row[2] for row in rows]


def _describe(row: list[int], dim: int) -> str:
    ndim = row[0]
    shape = [str(s) for s in row[3 : 3 + min(ndim, _META_SHAPE)]]
    if dim < len(shape):
        shape[dim] = str(row[2])
    return f"shape ({', '.join(shape)}) of {_DTYPE_NAMES.get(row[1], 'an unknown dtype')}"
