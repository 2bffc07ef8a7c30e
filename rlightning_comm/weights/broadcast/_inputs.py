"""What one rank can tell about its own weight-transfer arguments before anything is exchanged.

Every check here returns the problem it finds (an exception type and a message) instead of raising it: the handshake
shares each rank's verdict with every member, so a problem anywhere raises the same error everywhere before any weight
moves.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from rlightning_comm.weights.broadcast._plan import Entry, Plan
from rlightning_comm.weights.core._checks import Problem, same_view

Span = tuple[int, int, int, str, torch.Tensor]  # device index, first byte, end byte, name, tensor
Loader = Callable[[list[tuple[str, torch.Tensor]]], Any]

_DTYPE_NAMES: dict[torch.dtype, str] = {}
_by_place = operator.itemgetter(0, 1)  # (device, address): a sort key that never compares the tensors
_EXACT_CHECK_BYTES = (
    1 << 28
)  # memory whose overlap is worked out byte by byte; beyond it a suspected overlap is refused


def named_tensors(state_dict: Any, is_source: bool) -> tuple[list[tuple[str, torch.Tensor]] | Loader | None, Problem]:
    """The named tensors of any accepted input (a destination's ``load`` callable as it is), or what is wrong with
    it."""
    if isinstance(state_dict, nn.Module):
        items = list(state_dict.state_dict().items())
    elif isinstance(state_dict, Mapping):
        items = list(state_dict.items())
    elif isinstance(state_dict, Sequence) and not isinstance(state_dict, (str, bytes)):
        items = list(state_dict)
        for i, item in enumerate(items):
            if not (isinstance(item, tuple) and len(item) == 2):
                return None, (
                    TypeError,
                    f"a list of named tensors must hold (name, tensor) pairs; item {i} is {type(item).__name__}",
                )
    elif callable(state_dict):
        if is_source:
            return None, (
                TypeError,
                "the source passed a callable: a load callable is for destinations; the source passes its tensors",
            )
        return state_dict, None
    else:
        expected = (
            "a Mapping of names to tensors, an nn.Module, a list of (name, tensor) or (on a destination) a load "
            "callable"
        )
        return None, (TypeError, f"state_dict must be {expected}; got {type(state_dict).__name__}")
    seen: set[str] = set()
    for name, tensor in items:
        if not isinstance(name, str):
            return None, (TypeError, f"tensor names must be str; got {type(name).__name__} {name!r}")
        if name in seen:
            return None, (ValueError, f"tensor name {name!r} appears more than once")
        seen.add(name)
        if not isinstance(tensor, torch.Tensor):
            return None, (TypeError, f"{name!r} must be a torch.Tensor; got {type(tensor).__name__}")
    return items, None


def describe(
    items: list[tuple[str, torch.Tensor]], is_source: bool, device_type: str
) -> tuple[Problem, list[Entry], list[Span]]:
    """One pass over this rank's tensors: what it cannot do with one of them, its manifest, and (on a destination) their
    spans of memory.

    A problem is a layout, a device, or on a destination memory that cannot be written (an expanded or zero-stride
    view). The manifest holds names, dtypes and shapes, and on the source which entries are the very same tensor as an
    earlier one (:func:`same_view`; only tensors at an address seen before are compared in full), sent once.
    """
    first_at: dict[int, int] = {}
    entries: list[Entry] = []
    spans: list[Span] = []
    strided = torch.strided
    for i, (name, t) in enumerate(items):
        if (
            t.is_nested or t.is_quantized or t.layout != strided or not (t.is_cpu or t.is_cuda)
        ):  # (a meta tensor is neither)
            problem = _unusable(name, t, is_source, device_type)
            if problem is not None:
                return problem, [], []
        n = t.numel()
        alias = -1
        if n and is_source:
            ptr = t.data_ptr()
            first = first_at.setdefault(ptr, i)
            if first != i:  # rare: scan every earlier tensor at this address
                alias = next((j for j in range(first, i) if items[j][1].numel() and same_view(items[j][1], t)), -1)
        elif n:
            start = t.data_ptr()
            if t.is_contiguous():
                end = start + n * t.element_size()
            elif n > 1 and _self_overlapping(t):
                layout = f"{name!r} (shape {list(t.shape)}, strides {list(t.stride())})"
                why = (
                    "has elements that share memory (an expanded or zero-stride view): it cannot hold the source's "
                    "values"
                )
                return (ValueError, f"{layout} {why}; pass a tensor of its own (clone() it)"), [], []
            else:
                end = (
                    start
                    + (sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1) * t.element_size()
                )
            spans.append((t.get_device(), start, end, name, t))
        dtype = t.dtype
        entries.append(
            (name, _DTYPE_NAMES.get(dtype) or _DTYPE_NAMES.setdefault(dtype, str(dtype)), tuple(t.shape), alias)
        )
    return None, entries, spans


def _unusable(name: str, t: torch.Tensor, is_source: bool, device_type: str) -> Problem:
    if t.is_nested or t.layout != torch.strided or t.is_quantized:
        kind = "nested" if t.is_nested else "quantized" if t.is_quantized else f"layout {t.layout}"
        return ValueError, f"{name!r} must be a dense tensor; got a {kind} tensor"
    if t.is_meta:
        return (
            ValueError,
            f"{name!r} is a meta tensor: it has no data to {'send' if is_source else 'receive into'}; materialise it "
            "first (to_empty())",
        )
    usable = {"cpu", "cuda", device_type}
    if t.device.type not in usable:
        return ValueError, f"{name!r} is on {t.device}; expected a tensor on one of {sorted(usable)}"
    return None


def mismatch(source: tuple[Entry, ...], mine: list[Entry]) -> str | None:
    """What differs between this rank's tensors and the source's, or ``None``."""
    theirs = {name: (dtype, shape) for name, dtype, shape, _ in source}
    ours = {name: (dtype, shape) for name, dtype, shape, _ in mine}
    lines = []
    missing = [n for n in theirs if n not in ours]
    unexpected = [n for n in ours if n not in theirs]
    differ = [
        f"{n!r}: source {theirs[n][0]} {list(theirs[n][1])}, here {ours[n][0]} {list(ours[n][1])}"
        for n in theirs
        if n in ours and theirs[n] != ours[n]
    ]
    for label, names in (("missing here", missing), ("not on the source", unexpected), ("differ", differ)):
        if names:
            lines.append(f"{len(names)} {label}: {', '.join(map(str, names[:5]))}{', ...' if len(names) > 5 else ''}")
    return "; ".join(lines) or None


def overlapping(spans: list[Span]) -> list[tuple[str, str, bool]]:
    """On a destination: ``(name, name, same view)`` of every two tensors whose memory overlaps (``spans`` from
    :func:`describe`).

    Spans of memory are sorted and swept once (the common case, no two spans meeting, ends there); tensors whose spans
    meet but which are not the same view are compared byte by byte.
    """
    spans.sort(key=_by_place)
    device, reach = None, 0
    for span in spans:
        if span[0] == device and span[1] < reach:
            break
        device, reach = span[0], max(reach, span[2]) if span[0] == device else span[2]
    else:
        return []
    found = []
    active: list[tuple[Any, ...]] = []
    for span in spans:
        active = [a for a in active if a[0] == span[0] and a[2] > span[1]]
        for other in active:
            same = same_view(other[4], span[4])
            if same or _share_memory(other[4], span[4]):
                found.append((other[3], span[3], same))
        active.append(span)
    return found


def uncovered(pairs: list[tuple[str, str, bool]], plan: Plan) -> Problem:
    """The destination's overlapping tensors that the source does not hold as one tied tensor (they cannot all get its
    values)."""
    index = {name: i for i, name in enumerate(plan.names)}
    root = dict(plan.aliases)
    for a, b, same in pairs:
        ia, ib = index.get(a), index.get(b)
        if same and ia is not None and ib is not None and root.get(ia, ia) == root.get(ib, ib):
            continue
        how = "are one tensor" if same else "share memory"
        return ValueError, (
            f"{a!r} and {b!r} {how} here, but on the source they are not one tied tensor: they cannot both hold the "
            "source's values; "
            "pass tensors of their own (clone() one)"
        )
    return None


def _bytes_of(marks: torch.Tensor, base: int, t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a view of ``marks`` (one byte per byte of memory from address ``base``)."""
    item = t.element_size()
    return marks.as_strided((*t.shape, item), (*(s * item for s in t.stride()), 1), t.data_ptr() - base)


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether any byte of ``a`` is a byte of ``b`` (their spans overlap; each has no overlap of its own)."""
    base = min(a.data_ptr(), b.data_ptr())
    end = max(
        t.data_ptr() + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size() for t in (a, b)
    )
    if end - base > _EXACT_CHECK_BYTES:
        return True  # too large to work out here: refused as overlapping
    marks = torch.zeros(end - base, dtype=torch.uint8)
    _bytes_of(marks, base, a).fill_(1)
    return bool(_bytes_of(marks, base, b).any())


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (a non-contiguous ``t`` of more than one element)."""
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1)
    reach = 0  # the last element offset the smaller-stride dimensions reach
    for stride, size in dims:
        if stride <= reach:
            break
        reach += (size - 1) * stride
    else:
        return False  # each stride steps past everything below it: no two elements meet
    if any(stride == 0 for stride, _ in dims) or math.prod(n for _, n in dims) > _EXACT_CHECK_BYTES // 8:
        return True
    offsets = torch.zeros((), dtype=torch.int64)
    for stride, size in dims:
        offsets = (offsets.unsqueeze(-1) + torch.arange(size) * stride).reshape(-1)
    return offsets.unique().numel() < offsets.numel()
