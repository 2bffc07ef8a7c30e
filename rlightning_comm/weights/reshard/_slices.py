"""Blocks of global tensors: :class:`TensorSlice`, and what one member holds and wants, read from its arguments.

Every check here returns the problem it finds (an exception type and a message) instead of raising it:
:func:`reshard_state_dict` shares each member's verdict, so a problem anywhere raises the same error on every member
before any byte moves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from rlightning_comm.weights.core._checks import Problem

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (first index, end index) per dimension, in global coordinates


@dataclass(frozen=True, eq=False)
class TensorSlice:
    """A block of a global tensor: ``tensor`` holds the elements at ``offsets`` (one per dimension) of a tensor of
    ``global_shape``, over a region of ``tensor.shape``.

    ``tensor`` may be any strided view (the q rows of a fused ``qkv_proj`` weight, a column block of a row-parallel
    weight): a destination's slice is written in place through it. :mod:`rlightning_comm.weights.layouts` builds the
    slices of common engine layouts.

    Args:
        tensor: The block's elements.
        offsets: Index of the block's first element in the global tensor, per dimension.
        global_shape: Shape of the global tensor.
    """

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        # Lists and torch.Size become tuples; what cannot is reported by the call that uses the slice, on every member.
        for field in ("offsets", "global_shape"):
            value = getattr(self, field)
            if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
                object.__setattr__(self, field, tuple(value))


class Block(NamedTuple):
    """One block a member holds or wants: its tensor (a view), where it lies, and how its memory is laid out."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    plain: bool  # contiguous-capable memory holding its values as they read (no lazy conjugate or negation)

    def meta(self) -> list[Any]:
        return [list(self.offsets), list(self.shape), list(self.strides), self.plain]


class Named(NamedTuple):
    """Everything one member holds and wants of one name."""

    dtype: str
    global_shape: tuple[int, ...]
    held: list[Block]
    wanted: list[Block]


def _int_tuple(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, tuple):
        return None
    for v in value:  # a loop, not all() over a generator: called for every block of every call
        if type(v) is not int and (not isinstance(v, int) or isinstance(v, bool)):
            return None
    return value


def _block(name: str, value: Any, role: str) -> tuple[Block | None, tuple[int, ...], str | None]:
    """``value`` as a block, its global shape, or what is wrong with it."""
    what = f"{role}[{name!r}]"
    if isinstance(value, TensorSlice):
        tensor, offsets, global_shape = value.tensor, _int_tuple(value.offsets), _int_tuple(value.global_shape)
        if not isinstance(tensor, torch.Tensor):
            return None, (), f"{what}: TensorSlice.tensor must be a torch.Tensor; got {type(tensor).__name__}"
        if offsets is None or global_shape is None:
            return (
                None,
                (),
                f"{what}: offsets and global_shape must be sequences of ints; got {value.offsets!r}, "
                f"{value.global_shape!r}",
            )
        if not len(offsets) == len(global_shape) == tensor.dim():
            return (
                None,
                (),
                f"{what}: offsets {offsets} and global_shape {global_shape} need one entry per dimension of the "
                f"tensor (shape {tuple(tensor.shape)})",
            )
        local = tensor.shape
        bad = [d for d, (o, n, g) in enumerate(zip(offsets, local, global_shape)) if o < 0 or o + n > g]
        if bad:
            d = bad[0]
            return (
                None,
                (),
                f"{what}: the slice is out of bounds in dimension {d}: elements {offsets[d]} to "
                f"{offsets[d] + tensor.shape[d]} of a global size of {global_shape[d]} (offsets {offsets}, shape "
                f"{tuple(tensor.shape)}, global_shape {global_shape})",
            )
    elif _is_dtensor(value):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if any(p.is_partial() for p in value.placements):
            return (
                None,
                (),
                f"{what}: a DTensor with a Partial placement is not a value yet ({value.placements}); reduce it first",
            )
        global_shape = tuple(value.shape)
        local_shape, offsets = compute_local_shape_and_global_offset(global_shape, value.device_mesh, value.placements)
        tensor = value.to_local().detach()
        if tuple(tensor.shape) != tuple(local_shape):
            return (
                None,
                (),
                f"{what}: the DTensor's local shard has shape {tuple(tensor.shape)}, its placements say "
                f"{tuple(local_shape)}",
            )
        offsets = tuple(int(o) for o in offsets)
    elif isinstance(value, torch.Tensor):
        tensor, offsets, global_shape = value, (0,) * value.dim(), tuple(value.shape)
    else:
        return (
            None,
            (),
            f"{what}: expected a Tensor, DTensor or TensorSlice (or a sequence of them); got {type(value).__name__}",
        )
    if tensor.is_nested or tensor.layout != torch.strided or tensor.device.type == "meta":
        return None, (), f"{what}: a {tensor.layout} tensor on {tensor.device} holds no plain strided data"
    shape, strides = tuple(tensor.shape), tensor.stride()
    if role == "wanted" and 0 in strides and any(s == 0 and n > 1 for s, n in zip(strides, shape)):
        return None, (), f"{what}: an expanded view (stride 0) cannot be written in place"
    if tensor.requires_grad:
        tensor = tensor.detach()  # written in place on a destination; only read on a source
    plain = not tensor.is_conj() and not tensor.is_neg()
    return Block(tensor, offsets, shape, strides, plain), global_shape, None


def _is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor: nothing is one
        return False
    return isinstance(value, DTensor)


def _values(value: Any) -> list[Any]:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return list(value)
    return [value]


def _overlap(a: Block, b: Block) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a.offsets, a.shape, b.offsets, b.shape))
    return (lo, hi) if all(a < h for a, h in zip(lo, hi)) else None


def collect(held: Any, wanted: Any, device: torch.device) -> tuple[dict[str, Named], Problem]:
    """This member's blocks per name, or what is wrong with its arguments; never raises."""
    try:
        return _collect(held, wanted, device)
    except Exception as err:  # noqa: BLE001 - whatever a tensor raises here is this member's verdict, shared like any other
        return {}, (RuntimeError, f"its tensors could not be read: {type(err).__name__}: {err}")


def _collect(held: Any, wanted: Any, device: torch.device) -> tuple[dict[str, Named], Problem]:
    names: dict[str, Named] = {}
    kind = device.type
    for role, mapping in (("held", held), ("wanted", wanted)):
        if mapping is None:
            continue
        if not isinstance(mapping, Mapping):
            return {}, (
                TypeError,
                f"{role} must be a mapping of names to tensors or slices, or None; got {type(mapping).__name__}",
            )
        for name, value in mapping.items():
            if not isinstance(name, str):
                return {}, (TypeError, f"{role}: names must be str; got {name!r}")
            for one in _values(value):
                block, global_shape, wrong = _block(name, one, role)
                if wrong is not None:
                    return {}, (TypeError if "expected a" in wrong or "must be a torch" in wrong else ValueError, wrong)
                here = block.tensor.device
                if here.type != kind or (kind != "cpu" and here != device):
                    return {}, (
                        ValueError,
                        f"{role}[{name!r}] is on {here}; the mode's communicator moves tensors on {device}: move it "
                        "there first",
                    )
                dtype = str(block.tensor.dtype)
                entry = names.get(name)
                if entry is None:
                    entry = names[name] = Named(dtype, global_shape, [], [])
                if (entry.dtype, entry.global_shape) != (dtype, global_shape):
                    return {}, (
                        ValueError,
                        f"{role}[{name!r}]: blocks of one name disagree on this member: dtype {dtype} and global shape "
                        f"{global_shape} against {entry.dtype} and {entry.global_shape}",
                    )
                getattr(entry, role).append(block)
    for name, entry in names.items():
        blocks = entry.wanted
        for i in range(len(blocks)):
            for j in range(i):
                both = _overlap(blocks[i], blocks[j])
                if both is not None and math.prod(h - a for a, h in zip(*both)) > 0:
                    return {}, (
                        ValueError,
                        f"wanted[{name!r}]: two wanted slices overlap (at offsets {blocks[j].offsets} and "
                        f"{blocks[i].offsets}, region {_region(both)}); each element may be wanted once per member",
                    )
    return names, None


def _region(box: Box) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in zip(*box)) + "]"


def region(box: Box) -> str:
    """``box`` as Python's slice notation, ``[0:4, 8:16]``."""
    return _region(box)


def metadata(names: dict[str, Named]) -> list[Any]:
    """This member's metadata, sorted by name: what the plan is computed from (JSON-ready)."""
    return [
        [name, e.dtype, list(e.global_shape), [b.meta() for b in e.held], [b.meta() for b in e.wanted]]
        for name, e in sorted(names.items())
    ]
