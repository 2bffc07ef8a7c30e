"""The library's exception types.

Bad values raise the builtin ``ValueError``/``TypeError``; wrong state and
failed collectives raise :class:`CommError` or one of its subclasses.
"""

from __future__ import annotations


class CommError(RuntimeError):
    """Base class of the library's runtime errors (wrong state, failed collective)."""


class CommTimeoutError(CommError):
    """A collective did not complete within its group's timeout."""


class CommMismatchError(CommError):
    """Ranks disagreed about a collective they were about to run (debug mode's consistency check).

    Raised on every rank of the group before the collective starts, so the
    group stays usable.
    """


class ObjectRefusedError(CommError):
    """A received object was refused: not plain data in safe mode, or over the size limit.

    Nothing was deserialised, the caller's list is unchanged and the group
    stays usable (the payload was received in full and dropped).
    """


class ModeNotBoundError(CommError, KeyError):
    """No communicator is bound for the requested mode.

    Also a ``KeyError``: the mode is an unknown name in the context's registry.
    """

    def __str__(self) -> str:
        # KeyError.__str__ would wrap the message in quotes.
        return str(self.args[0]) if self.args else ""
