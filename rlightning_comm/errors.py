"""The library's exception types.

Bad values raise the builtin ``ValueError``/``TypeError``; wrong state and failed collectives raise :class:`CommError`
or one of its subclasses.
"""

from __future__ import annotations


class CommError(RuntimeError):
    """Base class of the library's runtime errors (wrong state, failed collective)."""


class CommTimeoutError(CommError):
    """A collective did not complete within its group's timeout."""


class CommMismatchError(CommError):
    """Ranks disagreed about a collective they were about to run (debug mode's consistency check),
    or the members of a connected mode about what must match before its group is built (its preflight).

    Raised on every rank of the group before the collective starts (or the group is built), so the group stays usable.
    """


class PeerLostError(CommError):
    """A member of a connected mode died, left or stopped answering: the mode refuses every call until it is re-formed.

    Raised by a call in flight and by every later call on the mode, on every surviving member, within milliseconds of a
    death or a departure, and within ``liveness_timeout`` (plus a quarter) of a member that stopped answering (the mode
    watches its members over connections of its own, with heartbeats); by ``connect`` on every other member when a
    member is lost while the generation forms. Re-form the mode by calling :meth:`CommContext.connect` again on every
    survivor and on the lost member's replacement, which builds the next generation.

    Args:
        message: What happened and what to do.
        mode: The connected mode.
        generation: The generation that lost the member.
        member: The lost member's rank in the mode, or ``None`` when not known.
    """

    def __init__(self, message: str, mode: str, generation: int, member: int | None) -> None:
        super().__init__(
            message, mode, generation, member
        )  # every argument in args, so the error pickles (Ray sends errors back)

    @property
    def mode(self) -> str:
        """The connected mode."""
        return self.args[1]

    @property
    def generation(self) -> int:
        """The generation that lost the member."""
        return self.args[2]

    @property
    def member(self) -> int | None:
        """The lost member's rank in the mode, or ``None`` when not known."""
        return self.args[3]

    def __str__(self) -> str:
        return str(self.args[0])


class ObjectRefusedError(CommError):
    """A received object was refused: not plain data in safe mode, or over the size limit.

    Nothing was deserialised, the caller's list is unchanged and the group stays usable (the payload was received in
    full and dropped).
    """


class ModeNotBoundError(CommError, KeyError):
    """No communicator is bound for the requested mode.

    Also a ``KeyError``: the mode is an unknown name in the context's registry.
    """

    def __str__(self) -> str:
        # KeyError.__str__ would wrap the message in quotes.
        return str(self.args[0]) if self.args else ""
