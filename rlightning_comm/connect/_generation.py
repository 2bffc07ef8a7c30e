"""One generation of a connected mode on this process: its group, its communicator, its watch, and what a loss does
to them.

A loss costs the hot path nothing: when the watch reports one, :meth:`Connection.lose` swaps the communicator's group
for a stand-in whose every method raises :class:`PeerLostError` (so later calls refuse at once, with no check of their
own) and breaks the real group, so calls in flight fail at once too. The communicator's failure translation, which only
runs when the backend raised, turns what they raise into :class:`PeerLostError`.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from rlightning_comm._compat import native_call
from rlightning_comm.communicators.base import Communicator
from rlightning_comm.connect._forming import Opening
from rlightning_comm.connect._groups import break_group
from rlightning_comm.connect._liveness import Watch
from rlightning_comm.errors import CommError, CommTimeoutError, PeerLostError
from rlightning_comm.failures import comm_failure

# After a backend error that is not a timeout, how long a call waits for the watch's word on a loss (it comes within
# milliseconds of a death; the backend may notice the closed connection first).
_VERDICT_WAIT = 2.0
DESTROY = "destroy() the context"  # the advice of comm_failure for a broken group, which a connected mode replaces
_OWN_TIMEOUT = "Application timeout caused pair closure"  # gloo, when a wait of this process timed out


# What a member that left in order is reported as (see _liveness): its calls are over, so nothing is broken at once.
_ORDERLY = ("left", "closed this generation")
_ORDERLY_GRACE = 1.0  # seconds a call in flight gets to complete after an orderly departure


class _Refused:
    """Stands in for the group of a lost (or closed) generation: every method raises :class:`PeerLostError`."""

    def __init__(self, error: Callable[[str], PeerLostError]) -> None:
        self._error = error

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise self._error(name)

        return refuse


class Connection:
    """One generation of a connected mode on this process."""

    def __init__(self, mode: str, generation: int, timeout: float) -> None:
        self.mode = mode
        self.generation = generation
        self.timeout = timeout
        self.arrival = timeout  # connect's wait for the members (its connect_timeout)
        self.comm: Communicator | None = None
        self.group: Any = None
        self.watch: Watch | None = None
        self.lost: tuple[int | None, str] | None = None
        self.lost_at: float | None = None  # time.monotonic() of the loss
        # The group's name: the same on every member (debug mode keys its checks by it), set once the opening is known.
        self.name = f"connected/{mode}"
        self.opening: Opening | None = None  # the generation whose verdict this process read
        self.store: dist.Store | None = (
            None  # rank 0: the mode's store, where a loss of the formed generation is posted
        )
        self.key: int | None = None
        self.server: dist.TCPStore | None = (
            None  # rank 0: the store server the group is built through  # rank 0: the generation's key in the store
        )
        self._lost_event = threading.Event()
        self._lock = threading.Lock()
        self._failed = False  # a backend error was translated already: the group is broken since
        self._broken = False  # break_group was called on the group
        self._grace: threading.Timer | None = None  # breaks the group after an orderly departure's grace

    def attach(self, comm: Communicator) -> None:
        """Make ``comm`` this generation's: its failures are translated here (an instance attribute over the
        class's)."""
        self.comm = comm
        comm._failure = self.failure  # type: ignore[method-assign]
        comm._left_behind = self.left_behind  # type: ignore[attr-defined]  # read at an atomic sync's commit point
        if self.lost is not None:  # lost while the group was being built
            self._refuse()

    def lose(self, member: int | None, what: str) -> None:
        """A member was lost (on the watch's thread, or by :meth:`close`): refuse every later call, fail every call in
        flight."""
        with self._lock:
            if self.lost is not None:
                return
            self.lost = (member, what)
            self.lost_at = time.monotonic()
        if self.store is not None and member is not None:  # late arrivals claiming its rank go to the next generation
            with native_call() as allowed, contextlib.suppress(RuntimeError):  # RuntimeError: the store is closing
                if allowed:
                    self.store.set(f"{self.key}/lost", json.dumps(member))
        self._refuse()
        if self.group is not None:
            if member is not None and what.startswith(_ORDERLY):
                # An orderly departure comes after the leaver returned from its last call: a call in flight here that it
                # took part in completes (its last messages may still be on their way, as when rank 0 leaves right after
                # a barrier); one it never joined is failed after the grace.
                self._grace = threading.Timer(_ORDERLY_GRACE, self._break, (self.group,))
                self._grace.daemon = True
                self._grace.start()
            else:
                self._break(self.group)
        self._lost_event.set()

    def _break(self, group: Any) -> None:
        """Break ``group`` (once: the grace's timer and :meth:`close` may both come here)."""
        with self._lock:
            if self._broken:
                return
            self._broken = True
        with native_call() as allowed:  # on the watch's thread, or the grace's timer: see rlightning_comm._compat
            try:
                if allowed:
                    break_group(group)
            except Exception:  # noqa: BLE001 - destroyed meanwhile: nothing is in flight on it any more
                pass

    def left_behind(self) -> bool:
        """Whether the others may have gone on without this process: it was stopped for most of the liveness bound
        (see :meth:`Watch.stalled`), whether or not the loss they saw has reached it yet."""
        watch = self.watch
        return watch is not None and watch.stalled()

    def interrupt(self) -> None:
        """Raise :class:`PeerLostError` if this generation was lost (called by the forming's waits)."""
        if self.lost is not None:
            raise self._lost_error("connect")

    def _refuse(self) -> None:
        if self.comm is not None:
            self.comm._group = _Refused(self._lost_error)

    def _lost_error(self, op: str) -> PeerLostError:
        member, what = self.lost or (None, "was lost")
        mode, g = self.mode, self.generation
        if member is None:
            message = f"{op} on mode {mode!r} (generation {g}) is refused: this process {what}"
        else:
            died = member == 0 and what.startswith("died")
            host = (
                " (rank 0, the store's host: re-form the mode at an address the new rank 0 listens on)" if died else ""
            )
            message = (
                f"{op} on mode {mode!r} (generation {g}) failed: member {member}{host} {what}. The mode refuses every "
                "call until it is "
                f"re-formed: every surviving member, and a replacement for the lost one, calls connect({mode!r}, ...) "
                f"again (generation {g + 1})"
            )
        return PeerLostError(message, mode, g, member)

    def failure(self, op: str, err: BaseException) -> CommError:
        """The communicator's failure translation: :class:`PeerLostError` once a loss is known, else the usual error.

        A timeout of the group stays a :class:`CommTimeoutError` (a member was absent) unless the loss was known well
        before it (then the timeout is the loss's doing: gloo's sends to a receiver that died mid-message wait it out);
        any other backend error waits briefly for the watch, which tells a death within milliseconds.
        """
        if isinstance(err, PeerLostError):  # the stand-in of a lost generation
            return self._lost_error(op)
        error = comm_failure(err, self.mode, op, self.timeout)
        if DESTROY not in str(error):  # the backend's own check refused the call here: the group still works
            return error
        first, self._failed = not self._failed, True
        if first and self.lost is None and _OWN_TIMEOUT in str(err):
            # This process's own timeout closed the group's connections during this very call (gloo reports it on the
            # call's other waits); only a later call's failure with that text is a group broken before it.
            error = CommTimeoutError(
                f"{op} on mode {self.mode!r} timed out after {self.timeout:g} s (the group's timeout): a peer did not "
                f"join it; {DESTROY}. Backend: {err}"
            )
        if isinstance(error, CommTimeoutError):
            if self.lost_at is None or time.monotonic() - self.lost_at < _VERDICT_WAIT:
                return self._re_form_hint(error)
        elif self.lost is None and not self._lost_event.wait(_VERDICT_WAIT):
            return self._re_form_hint(error)
        return self._lost_error(op)

    def _re_form_hint(self, error: CommError) -> CommError:
        """``error`` telling to re-form the mode (all of this process's context need not go)."""
        hint = (
            f"re-form the mode: every member calls connect({self.mode!r}, ...) again (generation {self.generation + 1})"
        )
        return type(error)(str(error).replace(DESTROY, hint))

    def close(self, what: str) -> None:
        """Leave this generation (the members are told); the communicator refuses every call from now on."""
        if self.watch is not None:
            self.watch.close()
        self.lose(None, what)
        if self._grace is not None and self.group is not None:
            # This process leaves during an orderly departure's grace: nothing of it waits on the group any more, so the
            # group is broken (and released) now, not by a timer holding it for the rest of the grace.
            self._grace.cancel()
            self._break(self.group)
        self.group = None  # the backend goes with its last reference (its connections close)
        # The communicator refers to this generation (its failure translation, its stand-in group): without the way back
        # they form no reference cycle, so the communicator, and what it keeps (the weight transfer's staging buffers),
        # go as soon as nobody holds it, not at the garbage collector's next full pass.
        self.comm = None
