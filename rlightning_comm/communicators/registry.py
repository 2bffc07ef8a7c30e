"""Name -> communicator class registry behind ``init_group(..., backend=name)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from rlightning_comm.communicators.base import Communicator

_C = TypeVar("_C", bound="type[Communicator]")

_REGISTRY: dict[str, type[Communicator]] = {}


def register_communicator(name: str) -> Callable[[_C], _C]:
    """Class decorator that registers a :class:`Communicator` subclass under ``name``.

    ``CommContext().init_group(ranks, mode, backend=name)`` then binds an instance of the class. Registering another
    class under a taken name is an error; registering the same class again is a no-op.

    Args:
        name: The backend name users pass as ``backend=``.

    Raises:
        TypeError: ``name`` is not a non-empty string, or the decorated object is not a ``Communicator`` subclass, or it
            lacks an extension point or has one of another shape (the message lists each).
        ValueError: ``name`` is already registered to another class.
    """
    from rlightning_comm.communicators._contract import check_complete
    from rlightning_comm.communicators.base import Communicator

    if not isinstance(name, str) or not name:
        raise TypeError(f"communicator name must be a non-empty str; got {name!r}")

    def decorate(cls: _C) -> _C:
        if not (isinstance(cls, type) and issubclass(cls, Communicator)):
            raise TypeError(f"register_communicator({name!r}) expects a Communicator subclass; got {cls!r}")
        check_complete(cls)
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"communicator name {name!r} is already registered to {existing.__qualname__}; pick another name"
            )
        _REGISTRY[name] = cls
        return cls

    return decorate


def get_communicator_class(name: str) -> type[Communicator]:
    """Return the class registered under ``name``.

    Raises:
        KeyError: nothing is registered under ``name``; the message lists what is.
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise KeyError(f"No communicator registered as {name!r}; registered: {sorted(_REGISTRY)}") from None


def registered_communicators() -> dict[str, type[Communicator]]:
    """A copy of the registry: name -> class."""
    return dict(_REGISTRY)
