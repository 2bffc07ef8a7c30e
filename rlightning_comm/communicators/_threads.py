"""Any thread may use a communicator, one call at a time; an overlapping call from a second thread is refused.

Two threads issuing collectives on one process group at the same time can
run them in one order on one rank and in another order on a peer; when the
shapes agree the collectives pair up wrongly with no error. Waiting for the
other thread would not help (the order would still differ across ranks), so
a call that starts while another thread's call is in flight on the same
communicator raises :class:`CommError` naming both threads, before anything
is sent; the call in flight goes on undisturbed. Calls that follow each other
are fine from any thread: a pool of threads, a weight-updater thread, a
gradient hook on autograd's threads.

The claim on the hot path is one non-blocking lock acquire, one store of the
caller's thread id and one release::

    if lock.acquire(False):
        self._holder = get_ident()  # ... launch ... then _holder = 0, release
    elif self._holder != get_ident():
        raise overlap

A thread that already holds the claim (``all_reduce_dict`` calling
``all_reduce``, debug mode's :meth:`_exclusive` around a call) goes straight
through. ``_holder`` is cleared before the lock is released, so a thread that
fails to acquire reads either the holder's id or 0, never its own.
Under ``torch.compile`` there is no claim: a graph holds no lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rlightning_comm.errors import CommError

get_ident = threading.get_ident


class InFlight:
    """Mixin of :class:`Communicator`: the one-call-at-a-time claim."""

    _group: Any
    _mode: str
    _lock: Any
    _holder: int
    _holder_op: str

    def _init_claim(self) -> None:
        self._lock = threading.Lock()
        self._holder = 0
        self._holder_op = ""

    def _claim(self, op: str) -> bool:
        """Claim this communicator for ``op`` in the calling thread.

        Returns:
            ``True`` when this call took the claim (release it with
            :meth:`_release`), ``False`` when the calling thread already held it.

        Raises:
            CommError: another thread's call is in flight here.
        """
        if self._lock.acquire(False):
            self._holder = get_ident()
            self._holder_op = op
            return True
        if self._holder == get_ident():
            return False
        raise self._overlap(op)

    def _release(self) -> None:
        self._holder = 0
        self._lock.release()

    @contextmanager
    def _exclusive(self, op: str) -> Iterator[None]:
        """Hold the claim for ``op`` around a block that spans more than one call (debug mode's fingerprint exchange and the call).

        Reentrant in the claiming thread; a non-member claims nothing.

        Raises:
            CommError: another thread's call is in flight here.
        """
        claimed = self._group is not None and self._claim(op)
        try:
            yield
        finally:
            if claimed:
                self._release()

    def _overlap(self, op: str) -> CommError:
        holder = self._holder
        names = {t.ident: t.name for t in threading.enumerate()}
        other = f"thread {names[holder]!r}" if holder in names else "another thread"
        doing = f" ({self._holder_op})" if holder else ""
        return CommError(
            f"{op} on mode {self._mode!r} from thread {threading.current_thread().name!r} overlaps a call{doing} that {other} has in flight there; "
            "nothing was sent. Two threads' calls can pair up differently on different ranks, so one communicator takes one call at a time. "
            "Hint: order the calls (one thread after the other), or bind one mode per thread (init_group)"
        )

    def _active_group(self) -> Any:
        """The group, after refusing a caller that overlaps another thread's call in flight (claims nothing)."""
        holder = self._holder
        if holder and holder != get_ident() and self._lock.locked():
            raise self._overlap("a collective")
        return self._group
