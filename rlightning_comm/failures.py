"""Backend failures as the library's errors, naming the mode, the op and the timeout.

torch.distributed reports a timed-out or broken collective as a bare ``RuntimeError`` (gloo: ``Timed out waiting 1500ms
for recv operation to complete``, ``Connection reset by peer``, ``Application timeout caused pair closure``). The
communicators catch it where the backend is called, in the call itself for a blocking op and in :meth:`WorkHandle.wait`
for an async one, and raise what :func:`comm_failure` builds from it, chained to the original.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from rlightning_comm._compat import native_call
from rlightning_comm.errors import CommError, CommTimeoutError, PeerLostError

_T = TypeVar("_T")

# After a timeout gloo closes the group's connections: the next op fails at once with this text, which names a timeout
# but is not one.
_BROKEN_MARKERS = (
    "pair closure",
    "connection reset",
    "connection closed",
    "closed by peer",
    "broken pipe",
    "connection refused",
)
_TIMEOUT_MARKERS = ("timed out", "timeout")
# The backend's own argument checks on this rank, which fail before this rank sends anything, so its connections are
# intact: gloo's algorithm setup and ProcessGroupGloo's validation (a transport enforce is a broken pair instead), and
# ProcessGroupNCCL's checks (torch 2.13 raises most of them as ValueError / TypeError, older releases as RuntimeError).
_LOCAL_MARKERS = (
    "enforce fail",
    "processgroupgloo::",
    "invalid scalar type",
    "invalid tensor",
    "invalid root",
    "must be cuda and dense",
    "must be contiguous",
    "must be non-overlapping and dense",
    "not supported for nccl",
    "unsupported float8 type",
    "float8 dtypes are not currently supported",
    "cannot use reduceop",
    "unhandled reduceop",
    "does not support",
    "expecting one tensor only",
    "tensor list must be",
    "invalid argument",
)
LAUNCH_ERRORS = (RuntimeError, TypeError, ValueError)
"""What a launch catches: backend failures (``RuntimeError``, ``DistBackendError``) and the backend's own argument
refusals."""


def close_gloo_group(group: Any) -> None:
    """Close every connection of a gloo ``group`` on this process, so that every member's pending operation with it
    fails now.

    For a group a failure has made unusable: its members would otherwise wait out the group's timeout on a receive this
    process will never match. A receive from any member, waited for one millisecond: on its timeout gloo closes every
    connection of the group's context (its own reaction to a timeout), and the other end of each sees it closed at once.
    """
    try:
        if group.size() > 1:
            group.recv_anysource([torch.empty(1, dtype=torch.uint8)], _CLOSE_TAG).wait(timedelta(milliseconds=1))
    except RuntimeError:
        pass  # the timeout that closed the connections, or a context already broken
    except CommError:
        pass  # a connected mode's stand-in for a lost generation's group: the watch has broken the real one


_CLOSE_TAG = 0x4C4F5354  # "LOST": no member ever sends with it

LOSS_GRACE = 1.25
"""Seconds :func:`unless_lost` still waits for a call once a loss is known: a connected mode gives a call in flight 1 s
after an orderly departure before it breaks the group, and a call that a broken group fails does so within
milliseconds."""
_LOOK = 0.02  # seconds between two looks at ``lost`` while the helper thread runs the call


def mode_lost(comm: Any) -> bool:
    """Whether ``comm``'s connected mode has lost a member (its group then refuses every call); ``False`` elsewhere."""
    try:
        comm.group.size()
    except PeerLostError:
        return True
    return False


def await_work(comm: Any, work: Any, op: str) -> None:
    """Wait for ``work``, a send or receive of ``comm``'s group; on a connected mode, no longer than a loss allows.

    gloo fails the pending operations of a connection that closes (the watch breaks the group on a loss), but not a
    receive it is reading a message into: a receive whose sender died or stopped mid-message would wait out the group's
    timeout. So on a connected mode the wait runs on a helper thread and is given up once the loss is known
    (:func:`unless_lost`).

    Raises:
        PeerLostError: given up after a loss (naming the lost member).
        CommTimeoutError: given up after the group's timeout and then some (the work's own timeout raises first).
        Exception: what ``work.wait()`` raised.
    """
    if not comm._outside_world:
        work.wait()
        return
    limit = (comm.timeout or 1800.0) + 5.0
    try:
        unless_lost(work.wait, lambda: mode_lost(comm), limit, f"{op} on mode {comm.mode!r}")
    except Abandoned as err:
        try:
            comm.group.size()  # a lost generation's stand-in raises its PeerLostError
        except PeerLostError as lost:
            raise comm._failure(op, lost) from err
        raise CommTimeoutError(f"{err} (the group's timeout is {comm.timeout:g} s)") from err


class Abandoned(RuntimeError):
    """:func:`unless_lost` gave up on a call (it goes on, on its thread, until it returns by itself)."""


def unless_lost(call: Callable[[], _T], lost: Callable[[], bool], timeout: float, what: str) -> _T:
    """``call()``, run on a helper thread and waited for until it returns, or until :data:`LOSS_GRACE` seconds after
    ``lost()`` first said ``True``, or ``timeout`` seconds.

    For a native call that a loss can leave blocked with nothing left to wake it: a gloo receive whose sender stopped or
    died in the middle of its message (gloo fails a pair's pending operations when the pair closes, but not the receive
    it is reading into, which then waits out the group's timeout), or an operation on a store whose host went dark
    (torch's store client waits for the reply without a bound). The abandoned call runs inside
    :func:`~rlightning_comm._compat.native_call`, so that it does not return into the interpreter's finalisation.

    Args:
        call: The blocking call.
        lost: Whether the group's connected mode has lost a member (``lambda: False`` elsewhere).
        timeout: The most seconds to wait with no loss known.
        what: What the call waits for, for the message.

    Returns:
        What ``call`` returned.

    Raises:
        Abandoned: the call did not return within the bound (it goes on on its thread, its result dropped).
        Exception: what ``call`` raised.
    """
    done: dict[str, Any] = {}

    def run() -> None:
        with native_call() as allowed:
            try:
                if not allowed:
                    raise Abandoned(f"{what}: the interpreter exits")
                done["result"] = call()
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                done["error"] = err

    thread = threading.Thread(target=run, name=f"rlightning-comm-wait {what}", daemon=True)
    thread.start()
    start = time.monotonic()
    seen: float | None = None
    while True:
        thread.join(_LOOK)
        if not thread.is_alive():
            break
        now = time.monotonic()
        if seen is None and lost():
            seen = now
        if (seen is not None and now - seen >= LOSS_GRACE) or now - start >= timeout:
            why = "the mode lost a member" if seen is not None else f"{timeout:g} s passed"
            raise Abandoned(f"{what} did not end: {why}; given up on")
    if "error" in done:
        raise done["error"]
    return done["result"]


def comm_failure(err: BaseException, mode: str, op: str, timeout: float | None) -> Exception:
    """Build the library's error for a backend error raised by ``op`` on ``mode``.

    Args:
        err: What the backend raised.
        mode: The mode of the communicator that ran ``op``.
        op: Name of the collective.
        timeout: The group's timeout in seconds, if known.

    Returns:
        A :class:`CommTimeoutError` when the backend timed out waiting for a peer; the same ``TypeError`` /
        ``ValueError`` (or, for any other local refusal, a :class:`CommError`) saying that the backend's own check
        refused the call on this rank and the group still works; else a :class:`CommError` saying a peer is gone or the
        group is broken. The caller raises it ``from err``.
    """
    text = str(err).strip()
    lowered = text.lower()
    if isinstance(err, (TypeError, ValueError)):  # an argument check: no transport error is ever one of these
        return (TypeError if isinstance(err, TypeError) else ValueError)(_refused(op, mode, text))
    if not any(m in lowered for m in _BROKEN_MARKERS) and any(m in lowered for m in _TIMEOUT_MARKERS):
        limit = "its timeout" if timeout is None else f"{timeout:g} s (the group's timeout)"
        return CommTimeoutError(
            f"{op} on mode {mode!r} timed out after {limit}: a peer did not join it "
            "(it skipped the call, is blocked elsewhere or died). The group is unusable now; destroy() the context. "
            f"Backend: {text}"
        )
    if isinstance(err, NotImplementedError) or (
        "transport" not in lowered and any(m in lowered for m in _LOCAL_MARKERS)
    ):
        return CommError(_refused(op, mode, text))
    return CommError(
        f"{op} on mode {mode!r} failed: a peer is gone or an earlier failure broke the group. The group is unusable "
        f"now; destroy() the context. Backend: {text}"
    )


def _refused(op: str, mode: str, text: str) -> str:
    return (
        f"{op} on mode {mode!r} was refused by the backend's own check on this rank, before this rank sent anything: "
        f"the group still works here, but peers that entered this call wait until the group's timeout. "
        f"Fix the arguments (debug mode compares them across ranks first). Backend: {text}"
    )


class WorkHandle:
    """The handle an ``async_op=True`` collective returns: torch's work object whose :meth:`wait` raises the library's
    errors.

    Every other attribute (``is_completed``, ``get_future``, ...) is the wrapped torch work's own. A backend that
    returned no work (``None``: the op completed in the call, or runs in stream order) gets a handle that is
    complete: ``wait()`` and ``is_completed()`` return ``True`` and
    ``get_future()`` a completed future.
    """

    __slots__ = ("_failure", "_mode", "_op", "_timeout", "_work")

    def __init__(
        self,
        work: Any,
        mode: str,
        op: str,
        timeout: float | None,
        failure: Callable[[str, BaseException], CommError] | None = None,
    ) -> None:
        self._work = work
        self._mode = mode
        self._op = op
        self._timeout = timeout
        self._failure = (
            failure  # the communicator's own translation (a connected mode names a lost member), else comm_failure
        )

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        """Block until the collective completes, as torch's ``Work.wait``.

        Raises:
            CommTimeoutError: a peer did not join within the group's timeout.
            CommError: the collective failed (a peer is gone, the group is broken).
        """
        work = self._work
        if work is None:
            return True
        try:
            return work.wait(*args, **kwargs)
        except LAUNCH_ERRORS as err:
            failure = self._failure
            raise (
                comm_failure(err, self._mode, self._op, self._timeout) if failure is None else failure(self._op, err)
            ) from err

    def is_completed(self) -> bool:
        """Whether the collective has completed (torch's ``Work.is_completed``)."""
        return True if self._work is None else self._work.is_completed()

    def get_future(self) -> Any:
        """torch's ``Work.get_future``; a completed future when the backend returned no work."""
        if self._work is None:
            future: torch.futures.Future[Any] = torch.futures.Future()
            future.set_result(None)
            return future
        return self._work.get_future()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)

    def __repr__(self) -> str:
        return f"WorkHandle(op={self._op!r}, mode={self._mode!r}, work={self._work!r})"
