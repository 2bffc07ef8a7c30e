"""Packing a dict of numbers and tensors into one buffer for ``all_reduce_dict``, and back.

Three rules keep every rank's buffer laid out alike, whatever order each rank built its dict in and whichever device
each tensor is on:

* **One total key order.** Keys are ordered by :func:`ordered_keys`: ``None``, then real numbers, then strings, then
  bytes, then tuples of those (lexicographically); within a kind by value. A key outside these kinds (or a NaN) has no
  order every rank agrees on and is refused.
* **Numbers first, then tensors**, each in key order, so the numbers are one
  slice: one host-to-device copy on the way in and one device-to-host copy
  (``tolist``) on the way out. A tensor on the communicator's device costs no copy; one elsewhere costs one each way.
* **Exact integers.** With a floating ``dtype`` a dict that holds numbers is reduced in float64 (tensors are cast back
  to ``dtype``), so an integer count comes back exact while every value and partial result stays within ``2**53`` in
  magnitude; with an integer ``dtype`` everything is reduced in that dtype. The choice depends only on what every rank
  must agree on anyway (the dtype, and which keys hold numbers), never on a value's Python type, so ``{"n": 0}`` on one
  rank and ``{"n": 2.5}`` on another reduce together.
"""

from __future__ import annotations

import array
import math
import numbers
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch

_PLAIN_NUMBERS = frozenset({float, int, bool})
_EXACT_LANE = torch.float64
EXACT_INT_BOUND = 2**53
"""Integers reduced by ``all_reduce_dict`` with a floating ``dtype`` are exact up to this magnitude (values and
results)."""


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _is_numpy_bool(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def _rank(key: Any) -> tuple[Any, ...]:
    """The position of ``key`` in the total key order (see the module docstring)."""
    if key is None:
        return (0,)
    if isinstance(key, numbers.Real) or _is_numpy_bool(key):
        if isinstance(key, float) and math.isnan(key):
            raise TypeError("a NaN key has no order")
        return (1, key)
    if isinstance(key, str):
        return (2, key)
    if isinstance(key, bytes):
        return (3, key)
    if isinstance(key, tuple):
        return (4, tuple(map(_rank, key)))
    raise TypeError(f"key {key!r} of type {_type_name(key)}")


def ordered_keys(dictionary: Mapping[Any, Any], mode: str) -> list[Any]:
    """The keys of ``dictionary`` in the one total order every rank uses.

    Raises:
        TypeError: a key has no place in the order (not None, a real number, str, bytes, or a tuple of those; or a NaN).
    """
    keys = list(dictionary)
    if set(map(type, keys)) <= {str}:
        return sorted(keys)  # the metrics case; the same order as the general one
    try:
        return sorted(keys, key=_rank)
    except TypeError as err:
        raise TypeError(
            "all_reduce_dict keys must be None, real numbers, str, bytes or tuples of those, so that every rank "
            f"orders them alike; got {err} (mode {mode!r})"
        ) from None


def check_dtype(dtype: Any, mode: str) -> None:
    """Raise unless ``dtype`` is a real torch dtype."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"dtype must be a torch.dtype such as torch.float32; got {_type_name(dtype)} {dtype!r} (mode {mode!r})"
        )
    if dtype.is_complex:
        raise ValueError(f"dtype must be a real floating-point or integer dtype; got {dtype} (mode {mode!r})")


def _is_number(key: Any, value: Any, mode: str) -> bool:
    """Whether ``value`` is packed as a number (``False``: a tensor); raise for anything else."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise TypeError(
                f"all_reduce_dict value for key {key!r} is a {value.layout} tensor; expected a dense tensor. Hint: "
                f"pass t.to_dense() (mode {mode!r})"
            )
        if value.is_complex():
            raise TypeError(
                f"all_reduce_dict value for key {key!r} is a complex tensor ({value.dtype}); expected a real tensor or "
                f"number (mode {mode!r})"
            )
        return False
    if isinstance(value, numbers.Real) or _is_numpy_bool(value):
        return True
    if isinstance(value, numbers.Number):
        raise TypeError(
            f"all_reduce_dict value for key {key!r} must be a real number or a tensor; got the complex number "
            f"{value!r} (mode {mode!r})"
        )
    raise TypeError(
        f"all_reduce_dict value for key {key!r} must be a number or a tensor; got {_type_name(value)} (mode {mode!r})"
    )


def check(dictionary: Mapping[Any, Any], dtype: Any, mode: str) -> None:
    """Every check :func:`pack` makes, without packing (what ``Communicator._check_all_reduce_dict`` runs).

    Raises:
        TypeError: a key has no place in the total order, a value is neither a real number nor a dense real tensor, or
            ``dtype`` is not a torch dtype.
        ValueError: ``dtype`` is complex.
    """
    check_dtype(dtype, mode)
    if not set(map(type, dictionary)) <= {str}:
        ordered_keys(dictionary, mode)  # sorting by rank is what tells whether the keys have the order
    if not set(map(type, dictionary.values())) <= _PLAIN_NUMBERS:  # the metrics case needs no per-value work
        for key, value in dictionary.items():
            _is_number(key, value, mode)


def describe(dictionary: Mapping[Any, Any], dtype: Any, mode: str) -> tuple[list[Any], list[Any]]:
    """:func:`check`, then the ordered keys and, per key, ``None`` for a number or the tensor's shape (debug mode's
    fingerprint)."""
    check(dictionary, dtype, mode)
    keys = ordered_keys(dictionary, mode)
    return keys, [None if _is_number(k, dictionary[k], mode) else tuple(dictionary[k].shape) for k in keys]


def pack(
    dictionary: Mapping[Any, Any], dtype: torch.dtype, device: torch.device, mode: str, *, checked: bool = False
) -> tuple[torch.Tensor | None, Callable[[torch.Tensor], dict[Any, Any]]]:
    """Pack the values of ``dictionary`` into one fresh buffer on ``device`` (layout: see the module docstring).

    Every check of :func:`check` runs before anything is allocated, unless ``checked`` says the caller has just run
    them.

    Returns:
        The buffer (``None`` for an empty dict) and a function that turns the reduced buffer into the result dict:
        numbers as Python floats (ints for an integer ``dtype``), tensors as ``dtype`` tensors of their shape on their
        own device.

    Raises:
        TypeError, ValueError: as :func:`check`.
    """
    if not checked:
        check(dictionary, dtype, mode)
    try:
        keys = sorted(dictionary)  # checked keys that sort natively sort in the total order
    except TypeError:
        keys = sorted(dictionary, key=_rank)
    if len(keys) < 2:
        values = [dictionary[k] for k in keys]
    else:
        values = operator.itemgetter(*keys)(dictionary)  # twice as fast as a map for a dict of metrics
    if not values:
        return None, lambda flat: {}
    lane = _EXACT_LANE if dtype.is_floating_point else dtype
    if set(map(type, values)) <= _PLAIN_NUMBERS:
        # The metrics case: one buffer straight from the floats, no per-value work in torch.
        if lane is _EXACT_LANE:
            host = torch.frombuffer(array.array("d", values), dtype=lane)  # shares the fresh array's memory
        else:
            host = torch.tensor(values, dtype=lane)
        flat = host if device.type == "cpu" else host.to(device)
        return flat, lambda reduced: dict(zip(keys, reduced.tolist()))
    number_keys, number_values, tensor_keys, tensors = [], [], [], []
    for key, value in zip(keys, values):
        if _is_number(key, value, mode):
            number_keys.append(key)
            # numpy scalars, Fractions, ...: as the lane's Python type (float keeps an int exact only below 2**53
            # anyway)
            number_values.append(
                value if type(value) in _PLAIN_NUMBERS else (float(value) if lane.is_floating_point else int(value))
            )
        else:
            tensor_keys.append(key)
            tensors.append(value)
    if not number_keys:
        lane = dtype  # tensors alone: reduced in the dtype asked for
    segments = []
    if number_keys:
        numbers_host = torch.tensor(number_values, dtype=lane)
        segments.append(
            numbers_host if device.type == "cpu" else numbers_host.to(device)
        )  # the one host-to-device copy
    segments.extend(t.detach().to(device=device, dtype=lane).reshape(-1) for t in tensors)
    flat = torch.cat(segments)  # always a fresh buffer: the caller's tensors stay untouched
    n = len(number_keys)

    def unpack(reduced: torch.Tensor) -> dict[Any, Any]:
        result = dict(zip(number_keys, reduced[:n].tolist()))  # the one device-to-host copy
        at = n
        for key, value in zip(tensor_keys, tensors):
            size = value.numel()
            result[key] = reduced[at : at + size].view(value.shape).to(device=value.device, dtype=dtype)
            at += size
        return {key: result[key] for key in keys}

    return flat, unpack
