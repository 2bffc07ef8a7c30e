"""Backend failures as the library's errors, naming the mode, the op and the timeout.

torch.distributed reports a timed-out or broken collective as a bare ``RuntimeError`` (gloo: ``Timed out waiting 1500ms
for recv operation to complete``, ``Connection reset by peer``, ``Application timeout caused pair closure``). The
communicators catch it where the backend is called, in the call itself for a blocking op and in :meth:`WorkHandle.wait`
for an async one, and raise what :func:`comm_failure` builds from it, chained to the original.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from rlightning_comm.errors import CommError, CommTimeoutError

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
