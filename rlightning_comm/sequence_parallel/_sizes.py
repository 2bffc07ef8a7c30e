"""How a sequence is split across ranks: the torch.tensor_split rule, equal local lengths, or caller-given lengths.

Nothing here communicates: the default rules need no exchange, so the ops stay one collective each way with no host
sync.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch


def sequence_split_sizes(length: int, world_size: int) -> list[int]:
    """Lengths of the chunks ``torch.tensor_split`` makes: the first ``length % world_size`` ranks get one more.

    This is the default split of the scatter-type ops. Their default counterparts on the gather side assume equal
    lengths, so after an uneven default split pass this list as ``seq_lens=`` to the gather.

    Raises:
        ValueError: ``length`` is negative or ``world_size`` is not positive.
    """
    length, world_size = operator.index(length), operator.index(world_size)
    if length < 0 or world_size < 1:
        raise ValueError(f"expected length >= 0 and world_size >= 1; got length={length}, world_size={world_size}")
    base, extra = divmod(length, world_size)
    return [base + 1 if r < extra else base for r in range(world_size)]


def _as_sizes(sizes: Any, group: Any, name: str) -> list[int]:
    if type(sizes) is list and len(sizes) == group.world_size and all(type(s) is int and s >= 0 for s in sizes):
        return list(
            sizes
        )  # the common case, checked quickly; a copy, so later edits by the caller cannot reach backward
    if isinstance(sizes, (str, bytes, torch.Tensor)) or not isinstance(sizes, Sequence):
        raise TypeError(
            f"{name} must be a list of {group.world_size} ints, one per rank of {group.name}; got "
            f"{type(sizes).__name__}"
        )
    try:
        out = [operator.index(s) for s in sizes]
    except TypeError:
        raise TypeError(f"{name} must hold ints; got {list(sizes)!r} ({group.name})") from None
    if len(out) != group.world_size or min(out) < 0:
        raise ValueError(
            f"{name} must hold {group.world_size} non-negative ints, one per rank of {group.name}; got {out}"
        )
    return out


def split_sizes(total: int, group: Any, sizes: Any, name: str) -> list[int]:
    """Per-rank chunk lengths of a dim of length ``total``: ``sizes`` checked, or the tensor_split rule when
    ``None``."""
    if sizes is None:
        return sequence_split_sizes(total, group.world_size)
    out = _as_sizes(sizes, group, name)
    if sum(out) != total:
        raise ValueError(
            f"{name} must sum to the length being split, {total}; got {out} (sum {sum(out)}, {group.name})"
        )
    return out


def local_sizes(input_: torch.Tensor, dim: int, group: Any, sizes: Any, name: str) -> list[int]:
    """Every rank's length along ``dim``: ``sizes`` checked against this rank's length, or this rank's length for every
    rank when ``None``.

    ``None`` is the equal-lengths rule: every rank holds as many positions as this one (nothing is exchanged; debug mode
    checks it across ranks).
    """
    if sizes is None:
        group.assume_lengths(name, dim, input_.shape[dim])
        return [input_.shape[dim]] * group.world_size
    out = _as_sizes(sizes, group, name)
    if out[group.rank] != input_.shape[dim]:
        raise ValueError(
            f"{name}[{group.rank}] must be this rank's input length along dim {dim}, {input_.shape[dim]}; got "
            f"{out[group.rank]} ({group.name})"
        )
    return out


def forgotten_lengths_hint(wire: list[list[int]], rank: int, name: str, dim: int, length: int) -> str | None:
    """The hint for a mismatch the equal-lengths rule made: ``name`` was not given and the ranks' lengths differ.

    ``wire`` holds every rank's shape of the tensor sent (group rank order), ``length`` this rank's length along
    ``dim``. ``None`` unless the shapes differ in exactly one dim, the one that holds this rank's length.
    """
    mine = wire[rank]
    if any(len(w) != len(mine) for w in wire):
        return None
    differ = [i for i in range(len(mine)) if any(w[i] != mine[i] for w in wire)]
    if len(differ) != 1 or mine[differ[0]] != length:
        return None
    lengths = [w[differ[0]] for w in wire]
    total, ws = sum(lengths), len(lengths)
    if lengths == sequence_split_sizes(total, ws):
        given = f"sequence_split_sizes({total}, {ws})"
        why = f", as the default split of {total} over a group of {ws} leaves them"
    else:
        given, why = str(lengths), ""
    return (
        f"Hint: {name} was not given, so each rank took its own length along dim {dim} as every rank's, but the ranks "
        "hold "
        f"{lengths} (in group rank order){why}: pass {name}={given} on every rank"
    )
