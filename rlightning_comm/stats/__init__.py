"""Opt-in per-mode communication statistics: count, bytes, time and bandwidth of every collective.

Use it through the context: ``ctx.enable_stats()``, then ``ctx.stats()`` (plain data), ``ctx.stats_table()`` (a readable
table to log), ``ctx.reset_stats()`` and ``ctx.disable_stats()``.

Zero cost when off: enabling stores a recording wrapper as an *instance* attribute of each bound communicator, over each
method of :data:`TRACKED_OPS` (so a subclass's override is what gets wrapped); communicators bound while stats are on
are wrapped as they are bound; disabling deletes the instance attributes, so the communicator's methods are its class's
own functions again and nothing of this module is left on the hot path. Stats compose with debug
mode (which shadows the same methods): each wrapper remembers what it wrapped
and disabling puts exactly that back; when debug mode is switched, the context puts the stats wrappers back on top.

What is recorded, per mode and op:

* ``bytes`` is the op's size ``S`` in the nccl-tests convention (see :mod:`rlightning_comm.bandwidth`), the same on
  every rank; ``all_reduce_dict`` counts the packed buffer it reduces (its inner ``all_reduce`` is not counted as a call
  of its own); ``broadcast_object_list`` and ``barrier`` record 0 bytes (the pickled size is not known without pickling
  twice).
* Time on CPU tensors is wall time around the call. An async call (``async_op=True``) is timed from its launch to its
  completion, taken from a callback on the work's future, not to the return of the launch; until it completes it counts
  as ``in_flight``. An async ``send`` / ``recv`` is timed to the return of its handle's ``wait()`` instead (gloo's
  point-to-point work may not be waited twice), and counts as in flight until then. Failed calls (a bad argument) are
  not recorded.
* On CUDA tensors time comes from CUDA events recorded on the current stream of the tensor's device (for dicts and
  objects, the communicator's bound device; never the calling thread's current device) before and after the call (for
  async calls the second event is recorded from the work future's callback, on a stream ordered after the collective).
  No event is waited on when an op runs: events are resolved when stats are read (``stats()``/``stats_table()`` wait for
  outstanding ones), and already completed ones are folded in now and then so the backlog stays small.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rlightning_comm.stats._recorder import TRACKED_OPS, _Recorder

if TYPE_CHECKING:
    from rlightning_comm.communicators.base import Communicator

__all__ = ["TRACKED_OPS", "disable", "enable", "format_table", "is_enabled", "on_bind", "reset", "snapshot"]

_RECORDER = _Recorder()


def enable(comms: Iterable[Communicator]) -> None:
    """Start recording: wrap every member communicator of ``comms``, and those bound from now on."""
    _RECORDER.enabled = True
    for comm in comms:
        _RECORDER.attach(comm)


def disable() -> None:
    """Stop recording and remove every wrapper; what was recorded stays until :func:`reset`."""
    _RECORDER.enabled = False
    _RECORDER.detach_all()


def is_enabled() -> bool:
    """Whether stats are being recorded."""
    return _RECORDER.enabled


def on_bind(comm: Communicator) -> None:
    """Called by the context for each communicator it binds (or whose methods debug mode changed): wraps it if stats are
    on."""
    if _RECORDER.enabled:
        _RECORDER.attach(comm)


def snapshot() -> dict[str, dict[str, dict[str, Any]]]:
    """Per mode, per op: ``count``, ``bytes``, ``total_time_s``, ``max_time_s``, ``mean_time_s``,
    ``algbw_gbps``, ``busbw_gbps`` (bus factor of the op's group size), ``group_size``, ``in_flight``.

    Completed async work and CUDA events are folded in first (this waits for outstanding CUDA events).
    """
    return _RECORDER.snapshot()


def reset() -> None:
    """Forget everything recorded so far (recording goes on if enabled)."""
    _RECORDER.reset()


def format_table(data: dict[str, dict[str, dict[str, Any]]] | None = None) -> str:
    """A fixed-width table of :func:`snapshot` (or of ``data``), one line per mode and op."""
    data = snapshot() if data is None else data
    head = (
        f"{'mode':<20} {'op':<22} {'count':>8} {'bytes':>14} {'total ms':>10} {'mean us':>10} {'max us':>10} "
        f"{'algbw GB/s':>11} {'busbw GB/s':>11}"
    )
    lines = [head, "-" * len(head)]
    for mode, ops in data.items():
        for op, s in ops.items():
            lines.append(
                f"{mode:<20} {op:<22} {s['count']:>8} {s['bytes']:>14} {s['total_time_s'] * 1e3:>10.3f} "
                f"{s['mean_time_s'] * 1e6:>10.1f} "
                f"{s['max_time_s'] * 1e6:>10.1f} {s['algbw_gbps']:>11.3f} {s['busbw_gbps']:>11.3f}"
                + (f"  ({s['in_flight']} in flight)" if s["in_flight"] else "")
            )
    if len(lines) == 2:
        lines.append("(nothing recorded)")
    return "\n".join(lines)
