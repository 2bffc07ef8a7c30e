"""Packing a dict of numbers and tensors into one buffer for ``all_reduce_dict``, and back."""

from __future__ import annotations

import array
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch

_PLAIN_NUMBERS = frozenset({float, int})


def pack(dictionary: Mapping[Any, Any], dtype: torch.dtype, device: torch.device, mode: str) -> tuple[torch.Tensor | None, Callable[[torch.Tensor], dict[Any, Any]]]:
    """Pack the values of ``dictionary`` into one fresh ``dtype`` buffer on ``device``.

    Keys are taken in sorted order when they are sortable (insertion order
    otherwise), so ranks that built the same dict differently agree.

    Returns:
        The buffer (``None`` for an empty dict) and a function that turns the
        reduced buffer into the result dict: numbers as Python floats (ints
        for an integer ``dtype``), tensors as ``dtype`` tensors of their shape
        on their own device.

    Raises:
        TypeError: a value is neither a number nor a tensor.
    """
    try:
        keys = sorted(dictionary)
    except TypeError:
        keys = list(dictionary)
    values = list(map(dictionary.__getitem__, keys))
    if not values:
        return None, lambda flat: {}
    if set(map(type, values)) <= _PLAIN_NUMBERS:
        # Only plain numbers (the metrics case): one buffer, one host transfer back.
        if dtype.is_floating_point:  # array("d") converts like float(), ~3x faster than torch.tensor(list)
            flat = torch.frombuffer(array.array("d", values), dtype=torch.float64).to(device=device, dtype=dtype, copy=True)
        else:
            flat = torch.tensor(values, dtype=dtype, device=device)
        return flat, lambda reduced: dict(zip(keys, reduced.tolist()))
    segments: list[torch.Tensor] = []
    run: list[Any] = []
    layout: list[tuple[Any, torch.Tensor | None]] = []  # None marks a number
    number_positions: list[int] = []
    offset = 0
    for key, value in zip(keys, values):
        if isinstance(value, torch.Tensor):
            if run:
                segments.append(torch.tensor(run, dtype=dtype, device=device))
                run = []
            segments.append(value.detach().to(device=device, dtype=dtype).reshape(-1))
            layout.append((key, value))
            offset += value.numel()
        elif isinstance(value, numbers.Number):
            run.append(value)
            layout.append((key, None))
            number_positions.append(offset)
            offset += 1
        else:
            raise TypeError(f"all_reduce_dict value for key {key!r} must be a number or a tensor; got {type(value).__name__} (mode {mode!r})")
    if run:
        segments.append(torch.tensor(run, dtype=dtype, device=device))
    flat = torch.cat(segments)  # always a fresh buffer: the caller's tensors stay untouched

    def unpack(reduced: torch.Tensor) -> dict[Any, Any]:
        # One host transfer for all the numbers, not one .item() per key.
        index = torch.tensor(number_positions, dtype=torch.long, device=reduced.device)
        numbers_out = iter(reduced[index].tolist())
        result: dict[Any, Any] = {}
        at = 0
        for key, value in layout:
            if value is None:
                result[key] = next(numbers_out)
                at += 1
            else:
                n = value.numel()
                result[key] = reduced[at : at + n].view_as(value).to(value.device)
                at += n
        return result

    return flat, unpack
