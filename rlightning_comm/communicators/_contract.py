"""The extension points of :class:`Communicator`, checked when a subclass is created and when it is registered.

A subclass that gets one wrong would otherwise fail on its first slow-path call with a bare ``TypeError`` (a
one-argument ``check_device``), or never (an ``on_device`` written as a method takes ``self`` as its first tensor).
:func:`check_shapes` runs at class creation on what the class itself defines; :func:`check_complete` runs at
registration on the whole class. Both raise one ``TypeError`` that lists every problem.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed import ReduceOp

_RENAMED = {"_check_device": "check_device", "_on_device": "on_device"}
EXTENSION_POINTS = (
    "device: a property, the torch.device the backend stages its own buffers on",
    "check_device(self, tensor, name) -> None: raise ValueError when the backend cannot use tensor's device",
    "on_device(a, b) -> bool: a @staticmethod, true only when both tensors are on one device check_device accepts",
    "backend: a class attribute, the torch.distributed backend name (str)",
    "supported_reduce_ops: a class attribute, a frozenset of ReduceOp members",
)
"""What a subclass provides (``on_device`` and ``supported_dtypes`` are optional), for the messages."""


def _takes(fn: Any, *args: str) -> bool:
    try:
        inspect.signature(fn).bind(*args)
    except (TypeError, ValueError):
        return False
    return True


def _problems(cls: type, names: Any) -> list[str]:
    problems = [
        f"{old} is now named {new}: rename the override" for old, new in _RENAMED.items() if old in cls.__dict__
    ]
    for name in names:
        value = inspect.getattr_static(cls, name, None)
        if value is None:
            continue
        if name == "device" and not (isinstance(value, property) or getattr(value, "__isabstractmethod__", False)):
            problems.append(f"device must be a property (decorate it with @property); got {type(value).__name__}")
        elif name == "check_device" and not (callable(value) and _takes(value, "self", "tensor", "name")):
            problems.append("check_device must be a method check_device(self, tensor, name) -> None")
        elif name == "on_device" and not (isinstance(value, staticmethod) and _takes(value.__func__, "a", "b")):
            shape = (
                "a method that also takes self"
                if callable(value) and not isinstance(value, staticmethod)
                else "not a function of (a, b)"
            )
            problems.append(f"on_device must be a @staticmethod on_device(a, b) -> bool; got {shape}")
        elif name == "backend" and not (isinstance(value, str) and value):
            problems.append(f"backend must be a non-empty str naming a torch.distributed backend; got {value!r}")
        elif name == "supported_reduce_ops" and not (
            isinstance(value, (set, frozenset)) and all(isinstance(op, type(ReduceOp.SUM)) for op in value)
        ):
            problems.append(
                f"supported_reduce_ops must be a frozenset of ReduceOp members (ReduceOp.SUM, ...); got {value!r}"
            )
        elif name == "supported_dtypes" and not (
            isinstance(value, (set, frozenset)) and all(isinstance(d, torch.dtype) for d in value)
        ):
            problems.append(f"supported_dtypes must be None or a frozenset of torch dtypes; got {value!r}")
    return problems


_CHECKED = ("device", "check_device", "on_device", "backend", "supported_reduce_ops", "supported_dtypes")


def _raise(cls: type, problems: list[str], when: str) -> None:
    if problems:
        listed = "".join(f"\n  - {p}" for p in problems)
        expected = "".join(f"\n  - {e}" for e in EXTENSION_POINTS)
        raise TypeError(f"{cls.__name__} {when}:{listed}\nA Communicator subclass provides:{expected}")


def check_shapes(cls: type) -> None:
    """At class creation: what ``cls`` itself defines of the extension points has the documented shape.

    Raises:
        TypeError: listing each mis-shaped or renamed member.
    """
    _raise(cls, _problems(cls, [n for n in _CHECKED if n in cls.__dict__]), "does not fit the Communicator contract")


def check_complete(cls: type) -> None:
    """At registration: ``cls`` is concrete, and every extension point it has (its own or inherited) has its shape.

    Raises:
        TypeError: listing what is missing or mis-shaped.
    """
    missing = [f"{name} is missing (still abstract)" for name in sorted(getattr(cls, "__abstractmethods__", ()))]
    missing += [f"{name} is missing" for name in ("backend", "supported_reduce_ops") if not hasattr(cls, name)]
    _raise(cls, missing + _problems(cls, _CHECKED), "cannot be registered")
