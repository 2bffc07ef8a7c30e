"""Native calls on the library's daemon threads, kept out of the interpreter's finalisation.

Before Python 3.14, a daemon thread that takes the interpreter lock back once the interpreter has begun finalising is
ended on the spot with ``pthread_exit``. When that happens as a call into torch returns, inside the destructor of
pybind11's ``gil_scoped_release`` (which released the lock for the call, and is ``noexcept``), the forced unwinding of
``pthread_exit`` cannot pass it: libstdc++ aborts the process ("terminate called without an active exception"). A
connected mode makes such calls on its daemon threads: the watch posting a loss in the store and breaking the group (a
gloo wait, an NCCL ``abort``), the grace timer breaking it, a group build left behind by a loss.

So those calls run inside :func:`native_call`: at the interpreter's exit (an ``atexit`` hook, which runs before the
finalisation begins) no new one starts, and the hook waits for the ones in flight, at most :data:`EXIT_WAIT` seconds.
A call that may last longer ends when :func:`exiting` says so (the group build's store, in :mod:`.connect._groups`).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Iterator

EXIT_WAIT = 5.0  # seconds the interpreter's exit waits for the native calls in flight

_cond = threading.Condition()
_active = 0
_exiting = False


@contextlib.contextmanager
def native_call() -> Iterator[bool]:
    """Run a native call of a daemon thread inside this block; it yields whether the call may start (``False`` once the
    interpreter exits: skip it)."""
    global _active
    with _cond:
        allowed = not _exiting
        if allowed:
            _active += 1
    try:
        yield allowed
    finally:
        if allowed:
            with _cond:
                _active -= 1
                _cond.notify_all()


def exiting() -> bool:
    """Whether the interpreter is exiting (a long native call ends when it is)."""
    return _exiting


def _at_exit() -> None:
    global _exiting
    with _cond:
        _exiting = True
        _cond.wait_for(lambda: _active == 0, EXIT_WAIT)


atexit.register(_at_exit)
