"""CommContext's switches for optional behaviour: debug mode, object-collective defaults, communication stats.

Kept apart from the registry in :mod:`rlightning_comm.context`; :class:`CommContext` inherits them.
"""

from __future__ import annotations

import threading
from typing import Any

from rlightning_comm import debug
from rlightning_comm import stats as _stats
from rlightning_comm.communicators import _objects
from rlightning_comm.communicators.base import Communicator
from rlightning_comm.config import GroupConfig


class ContextPolicies:
    """Mixin of :class:`CommContext`: per-context switches that apply to every bound communicator."""

    _comms: dict[str, Communicator]
    _configs: dict[str, GroupConfig]
    _debug: bool
    _lock: threading.RLock

    # --------------------------------------------------------------- policies
    def set_debug(self, enabled: bool = True) -> None:
        """Switch debug mode on or off for every bound communicator and those bound later.

        On, every collective first runs its local checks, then exchanges a fingerprint of the call (op, shapes, dtypes,
        reduce op, src/dst, dictionary keys, split sizes, a per-group sequence number, and this rank's refusal if its
        checks failed) through the world's store. Before anything is sent, every rank of the group raises the refusing
        rank's error (naming it) when one rank's arguments were refused, :class:`CommMismatchError` when the ranks
        disagree, or (on the ranks that came) :class:`CommTimeoutError` naming the ranks that did not arrive within the
        group's timeout; the group stays usable and in step in all three cases. Off (the default), communicators run no
        extra code at all. Every rank must switch at the same point of its sequence of collectives.
        ``RLIGHTNING_COMM_DEBUG=1`` switches it on when the world is initialised. :meth:`destroy` switches it off.

        Raises:
            TypeError: ``enabled`` is not a bool.
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool; got {type(enabled).__name__} {enabled!r}")
        with self._lock:
            self._debug = enabled
            for name, comm in self._comms.items():
                if enabled:
                    debug.enable(comm, self._configs[name].timeout)
                else:
                    debug.disable(comm)
                _stats.on_bind(comm)  # debug mode replaced or removed the methods: stats go back on top

    def is_debug(self) -> bool:
        """Whether debug mode is on (see :meth:`set_debug`)."""
        return self._debug

    def set_object_defaults(self, safe: bool = False, max_bytes: int | None = None) -> None:
        """Set what ``broadcast_object_list`` and ``all_gather_object`` do when a call leaves ``safe`` or ``max_bytes``
        out.

        Args:
            safe: Receivers accept only plain data (None, bool, int, float, str, bytes, lists, tuples and dicts of
                those, tensors) and refuse anything else without running it.
            max_bytes: Receivers refuse payloads over this many serialised bytes; ``None`` means no limit.

        :meth:`destroy` restores ``safe=False, max_bytes=None``.

        Raises:
            TypeError: ``safe`` is not a bool.
            ValueError: ``max_bytes`` is not a positive int or ``None``.
        """
        _objects.set_defaults(safe, max_bytes)

    def get_object_defaults(self) -> tuple[bool, int | None]:
        """The ``(safe, max_bytes)`` defaults of ``broadcast_object_list`` and ``all_gather_object``."""
        return _objects.get_defaults()

    # ------------------------------------------------------------------- stats
    def enable_stats(self) -> None:
        """Record count, bytes, time and bandwidth of every collective, per mode and op.

        Off by default; while off nothing wraps the communicators. Modes bound later are recorded too. See
        :mod:`rlightning_comm.stats` for what is measured and how (async and CUDA work included).
        """
        _stats.enable(self._comms.values())

    def disable_stats(self) -> None:
        """Stop recording and unwrap every communicator; the figures stay until :meth:`reset_stats`."""
        _stats.disable()

    def stats(self) -> dict[str, dict[str, dict[str, Any]]]:
        """The recorded figures as plain data: ``{mode: {op: {"count", "bytes", "total_time_s", ...}}}``.

        See :func:`rlightning_comm.stats.snapshot` for the fields.
        """
        return _stats.snapshot()

    def reset_stats(self) -> None:
        """Forget the recorded figures (recording goes on if enabled)."""
        _stats.reset()

    def stats_table(self) -> str:
        """The recorded figures as a fixed-width table, one line per mode and op, ready to log."""
        return _stats.format_table()
