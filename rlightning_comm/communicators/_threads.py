"""Any thread may use a communicator, one call at a time; an overlapping call from a second thread is refused.

Two threads issuing collectives on one process group at the same time can run them in one order on one rank and in
another order on a peer; when the shapes agree the collectives pair up wrongly with no error. Waiting for the other
thread would not help (the order would still differ across ranks), so a call that starts while another thread's call is
in flight on the same process group raises :class:`CommError` naming both threads, before anything is sent; the call in
flight goes on undisturbed. Calls that follow each other are fine from any thread: a pool of threads, a weight-updater
thread, a gradient hook on autograd's threads.

The claim belongs to the process group, not to the communicator: every communicator made on one group (the mode's, and
the one a sequence-parallel op makes for the raw ``ProcessGroup`` of that mode) shares one lock, so an overlap is
refused whichever of them the second call goes through.

The claim on the hot path is one non-blocking acquire and one release of a
re-entrant lock (``threading.RLock``, which knows its owning thread in C)::

    if not lock.acquire(False):
        raise overlap  # another thread holds it
    try: ... launch, wait ... finally: lock.release()

A thread that already holds the claim (``all_reduce_dict`` calling ``all_reduce``, debug mode's :meth:`_exclusive`
around a call) acquires it again at once. Under ``torch.compile`` there is no claim: a graph holds no lock.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rlightning_comm.errors import CommError

_OWNER = re.compile(r"owner=(\d+)")
_CLAIMS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()  # process group -> its claim
_CLAIMS_LOCK = threading.Lock()


class InFlight:
    """Mixin of :class:`Communicator`: the one-call-at-a-time claim."""

    _group: Any
    _mode: str
    _lock: Any

    def _init_claim(self) -> None:
        """Take the claim of ``self._group``, shared with every other communicator on that group (made at bind time)."""
        if self._group is None:  # a non-member claims nothing
            self._lock = threading.RLock()
            return
        with _CLAIMS_LOCK:
            lock = _CLAIMS.get(self._group)
            if lock is None:
                lock = _CLAIMS[self._group] = threading.RLock()
        self._lock = lock

    @contextmanager
    def _exclusive(self, op: str) -> Iterator[None]:
        """Hold the claim for ``op`` around a block that spans more than one call (debug mode's fingerprint exchange and
        the call).

        Reentrant in the claiming thread; a non-member claims nothing.

        Raises:
            CommError: another thread's call is in flight here.
        """
        if self._group is None:
            yield
            return
        lock = self._lock
        if not lock.acquire(False):
            raise self._overlap(op)
        try:
            yield
        finally:
            lock.release()

    def _overlap(self, op: str) -> CommError:
        # The RLock's repr names its owner's thread id (it may have let go since: then "another thread").
        found = _OWNER.search(repr(self._lock))
        names = {t.ident: t.name for t in threading.enumerate()}
        holder = int(found.group(1)) if found else None
        other = f"thread {names[holder]!r}" if holder in names else "another thread"
        return CommError(
            f"{op} on mode {self._mode!r} from thread {threading.current_thread().name!r} overlaps a call that {other} "
            "has in flight there; "
            "nothing was sent. Two threads' calls can pair up differently on different ranks, so a process group takes "
            "one call at a time. "
            "Hint: order the calls (one thread after the other), or bind one mode per thread (init_group)"
        )
