"""One thread drives a communicator: calls from a second thread are refused, never paired up silently.

Two threads issuing collectives on one process group can run them in one
order on one rank and in another order on a peer; when the shapes agree the
collectives pair up wrongly with no error. Serialising the calls with a lock
would not help (the order would still differ across ranks), so a
communicator belongs to the first thread that runs a collective on it.

The check on the hot path is one attribute read: every collective starts with::

    try:
        group = self._owned.group
    except AttributeError:
        group = self._enter()

``_owned`` is a ``threading.local`` that holds the group only in the owning
thread, so the owner reads it and every other thread takes the slow path,
which claims the communicator or raises.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from rlightning_comm.errors import CommError

if TYPE_CHECKING:
    import torch.distributed as dist

_LOCK = threading.Lock()


class ThreadOwned:
    """Mixin of :class:`Communicator`: the owning thread and the slow path of the thread check."""

    _group: Any
    _mode: str
    _owned: threading.local
    _owner: threading.Thread | None

    def _init_ownership(self) -> None:
        self._owned = threading.local()
        self._owner = None

    def release_thread(self) -> None:
        """Give up this thread's ownership, so that another thread may run collectives here next.

        Call it from the owning thread once it has finished communicating
        (a thread that has ended releases implicitly).

        Raises:
            CommError: another live thread owns this communicator.
        """
        with _LOCK:
            owner = self._owner
            current = threading.current_thread()
            if owner is not None and owner is not current and owner.is_alive():
                raise CommError(f"release_thread() on mode {self._mode!r} was called from thread {current.name!r}, but thread {owner.name!r} owns it")
            self._owner = None
            self._owned = threading.local()  # forgets the owner's fast path

    def _enter(self) -> dist.ProcessGroup | None:
        """The thread check's slow path: claim this communicator for the calling thread, or refuse.

        Returns:
            The group (``None`` on a non-member, which claims nothing).

        Raises:
            CommError: another live thread owns this communicator.
        """
        group = self._group
        if group is None:
            return None
        with _LOCK:
            owner = self._owner
            current = threading.current_thread()
            if owner is not None and owner is not current and owner.is_alive():
                raise CommError(
                    f"mode {self._mode!r} is driven by thread {owner.name!r}; thread {current.name!r} may not run collectives on it too: "
                    f"two threads' calls can pair up differently on different ranks. Hint: bind one mode per thread "
                    f"(init_group), or call release_thread() from {owner.name!r} when it is done"
                )
            self._owner = current
            self._owned.group = group
        return group
