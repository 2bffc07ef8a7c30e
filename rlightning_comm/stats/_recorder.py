"""The recording machinery behind :mod:`rlightning_comm.stats`: call wrappers, async completion, lazy CUDA events."""

from __future__ import annotations

import functools
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rlightning_comm._compat import native_call
from rlightning_comm.bandwidth import bus_factor, gbps
from rlightning_comm.communicators.base import COLLECTIVES

if TYPE_CHECKING:
    from rlightning_comm.communicators.base import Communicator

TRACKED_OPS = COLLECTIVES
"""The communicator methods that stats record: every collective."""

_NOT_OURS = object()
# gloo's send and recv works may be waited once only (a second waiter waits for a second message): no watcher thread for
# them; they are timed to the return of the caller's wait() instead (on CUDA the end event then follows the transfer).
_TIMED_AT_WAIT = frozenset({"send", "recv"})
_FOLD_EVERY = 1024  # outstanding CUDA records before completed ones are folded in
_perf_counter = time.perf_counter


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


# The ops that take async_op. Each returns (S in bytes, the tensor whose device decides how to time) from the call's
# arguments.
def _size_first(comm: Communicator, a: tuple[Any, ...], k: dict[str, Any], name: str) -> tuple[int, Any]:
    t = _arg(a, k, 0, name)
    return _nbytes(t), t


def _size_per_rank(comm: Communicator, a: tuple[Any, ...], k: dict[str, Any]) -> tuple[int, Any]:
    t = _arg(a, k, 0, "tensor")
    return _nbytes(t) * comm.world_size, t


def _size_second(comm: Communicator, a: tuple[Any, ...], k: dict[str, Any], name: str) -> tuple[int, Any]:
    t = _arg(a, k, 1, name)
    return _nbytes(t), t


_SIZES: dict[str, Callable[[Communicator, tuple[Any, ...], dict[str, Any]], tuple[int, Any]]] = {
    "all_reduce": functools.partial(_size_first, name="tensor"),
    "all_gather": functools.partial(_size_first, name="output_tensor"),
    "broadcast": functools.partial(_size_first, name="tensor"),
    "gather": _size_per_rank,
    "scatter": _size_per_rank,
    "reduce_scatter": functools.partial(_size_second, name="input_"),
    "all_to_all_single": functools.partial(_size_second, name="input_"),
    "reduce": functools.partial(_size_first, name="tensor"),
    "send": functools.partial(_size_first, name="tensor"),
    "recv": functools.partial(_size_first, name="tensor"),
}


class _Recorder:
    """The process-wide recording state (the context is a singleton, so is this)."""

    def __init__(self) -> None:
        self.enabled = False
        self._wrapped: weakref.WeakSet[Communicator] = weakref.WeakSet()
        # (mode, op) -> [count, bytes, bus_bytes, total_s, max_s, group_size, in_flight]
        self._acc: dict[tuple[str, str], list[Any]] = {}
        # Completed work not yet folded in: (key, n, bytes, factor, seconds or (start, end) events, was_async).
        # Callbacks of other threads only ever append here (deque appends are atomic).
        self._done: deque[tuple[tuple[str, str], int, int, float, Any, bool]] = deque()
        self._cuda_backlog = 0
        self._next_fold = _FOLD_EVERY
        self._local = threading.local()
        self._lock = threading.Lock()
        self._watch: queue.SimpleQueue[tuple[Any, Callable[[], None]]] | None = None

    # ------------------------------------------------------------- wrapping
    def attach(self, comm: Communicator) -> None:
        """Put a recording wrapper on top of each tracked method of ``comm`` (idempotent).

        A wrapper wraps whatever the attribute resolves to now (the class's method, or another instance-level wrapper
        such as debug mode's) and remembers it, so :meth:`detach_all` puts back exactly what was there.
        """
        if not self.enabled or not comm.is_member:
            return
        for op in TRACKED_OPS:
            below = vars(comm).get(op)
            if getattr(below, "_rlc_stats_below", _NOT_OURS) is not _NOT_OURS:
                continue  # ours already on top
            wrapper = self._wrap(comm, op, getattr(comm, op))
            wrapper._rlc_stats_below = below  # type: ignore[attr-defined]
            setattr(comm, op, wrapper)
        self._wrapped.add(comm)

    def detach_all(self) -> None:
        for comm in list(self._wrapped):
            for op in TRACKED_OPS:
                current = vars(comm).get(op)
                below = getattr(current, "_rlc_stats_below", _NOT_OURS)
                if below is _NOT_OURS:
                    continue  # replaced since (debug mode re-wrapped it): not ours to remove
                if below is None:
                    del vars(comm)[op]
                else:
                    setattr(comm, op, below)
        self._wrapped = weakref.WeakSet()

    def _wrap(self, comm: Communicator, op: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        key = (comm.mode, op)
        n = comm.world_size
        factor = bus_factor(op, n)
        size_of = _SIZES.get(op)
        waited = op in _TIMED_AT_WAIT
        staged_on = comm.device  # where dict and object payloads are staged: the device bound to the communicator
        staged = staged_on if staged_on.type == "cuda" else None
        local = self._local
        rec = self

        @functools.wraps(inner)
        def record(*args: Any, **kwargs: Any) -> Any:
            if getattr(local, "depth", 0):  # called from another tracked op (all_reduce_dict -> all_reduce)
                result = inner(*args, **kwargs)
                if size_of is not None:
                    local.inner_bytes += size_of(comm, args, kwargs)[0]
                return result
            nbytes, probe = size_of(comm, args, kwargs) if size_of is not None else (0, None)
            # CUDA events go on the current stream of the data's device, not the calling thread's current device.
            cuda = (probe.device if probe.is_cuda else None) if isinstance(probe, torch.Tensor) else staged
            local.depth, local.inner_bytes = 1, 0
            try:
                if cuda is not None:
                    start: Any = torch.cuda.Event(enable_timing=True)
                    start.record(torch.cuda.current_stream(cuda))
                else:
                    start = _perf_counter()
                result = inner(*args, **kwargs)
            finally:
                local.depth = 0
            nbytes += local.inner_bytes
            if result is None or size_of is None:  # ops without async_op return data, not work
                rec._finish(key, n, nbytes, factor, start, cuda, False)
            elif waited:
                return rec._track_waited(key, n, nbytes, factor, result, start, cuda)
            else:
                rec._track_async(key, n, nbytes, factor, result, start, cuda)
            return result

        return record

    # ------------------------------------------------------------ recording
    def _finish(
        self,
        key: tuple[str, str],
        n: int,
        nbytes: int,
        factor: float,
        start: Any,
        cuda: torch.device | None,
        was_async: bool,
    ) -> None:
        """Record the end of a call: now, on the current stream of the CUDA device ``cuda`` if given; may run on another
        thread."""
        if cuda:  # a torch.device, or None / False for a host call
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(cuda))
            with self._lock:
                self._done.append((key, n, nbytes, factor, (start, end), was_async))
                self._cuda_backlog += 1
                fold = self._cuda_backlog >= self._next_fold and not was_async
            if fold:
                self._fold(wait=False)  # completed events only; at most once per _FOLD_EVERY records
                with self._lock:
                    self._next_fold = self._cuda_backlog + _FOLD_EVERY
        elif was_async:
            self._done.append((key, n, nbytes, factor, _perf_counter() - start, True))
        else:
            seconds = _perf_counter() - start
            with self._lock:
                self._add(key, n, nbytes, factor, seconds, False)

    def _add(self, key: tuple[str, str], n: int, nbytes: int, factor: float, seconds: float, was_async: bool) -> None:
        """Fold one finished call into the accumulator; the caller holds ``_lock`` (callbacks of other threads record
        too)."""
        acc = self._acc.get(key)
        if acc is None:
            acc = self._acc[key] = [0, 0, 0.0, 0.0, 0.0, n, 0]
        acc[0] += 1
        acc[1] += nbytes
        acc[2] += nbytes * factor
        acc[3] += seconds
        acc[4] = max(acc[4], seconds)
        acc[5] = n
        if was_async and acc[6] > 0:
            acc[6] -= 1

    def _in_flight(self, key: tuple[str, str], n: int) -> None:
        """Count one more async call of ``key`` in flight (until its completion is folded in)."""
        with self._lock:
            acc = self._acc.get(key)
            if acc is None:
                acc = self._acc[key] = [0, 0, 0.0, 0.0, 0.0, n, 0]
            acc[6] += 1

    def _track_async(
        self, key: tuple[str, str], n: int, nbytes: int, factor: float, work: Any, start: Any, cuda: torch.device | None
    ) -> None:
        self._in_flight(key, n)

        def finished(_fut: Any = None) -> None:
            self._finish(key, n, nbytes, factor, start, cuda, True)

        try:
            future = work.get_future()
        except RuntimeError:  # e.g. gloo's reduce_scatter: no future, so a watcher thread waits on it
            self._watcher().put((work, finished))
            return
        if cuda:
            future.then(finished)  # the callback's current stream of the device is ordered after the collective
        else:
            future.add_done_callback(finished)

    def _track_waited(
        self, key: tuple[str, str], n: int, nbytes: int, factor: float, work: Any, start: Any, cuda: torch.device | None
    ) -> Any:
        """An async point-to-point call: timed to the return of its ``wait()`` (its work may not be waited twice)."""
        self._in_flight(key, n)
        return _WaitTimed(work, lambda: self._finish(key, n, nbytes, factor, start, cuda, True))

    def _watcher(self) -> queue.SimpleQueue[tuple[Any, Callable[[], None]]]:
        with self._lock:
            if self._watch is None:
                self._watch = queue.SimpleQueue()
                threading.Thread(
                    target=_watch_works, args=(self._watch,), name="rlightning-comm-stats", daemon=True
                ).start()
            return self._watch

    def _fold(self, wait: bool = True) -> None:
        with self._lock:
            pending = []
            while self._done:
                item = self._done.popleft()
                key, n, nbytes, factor, seconds, was_async = item
                if isinstance(seconds, tuple):
                    start, end = seconds
                    if wait:
                        end.synchronize()
                    elif not end.query():
                        pending.append(item)
                        continue
                    seconds = start.elapsed_time(end) / 1e3
                    self._cuda_backlog -= 1
                self._add(key, n, nbytes, factor, seconds, was_async)
            self._done.extendleft(reversed(pending))

    # -------------------------------------------------------------- reading
    def snapshot(self) -> dict[str, dict[str, dict[str, Any]]]:
        self._fold()
        with self._lock:
            rows = sorted((key, tuple(acc)) for key, acc in self._acc.items())
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for (mode, op), (count, nbytes, bus_bytes, total, peak, n, in_flight) in rows:
            out.setdefault(mode, {})[op] = {
                "count": count,
                "bytes": nbytes,
                "total_time_s": total,
                "max_time_s": peak,
                "mean_time_s": total / count if count else 0.0,
                "algbw_gbps": gbps(nbytes, total),
                "busbw_gbps": gbps(bus_bytes, total),
                "group_size": n,
                "in_flight": in_flight,
            }
        return out

    def reset(self) -> None:
        with self._lock:
            self._acc = {}
            self._done.clear()
            self._cuda_backlog = 0
            self._next_fold = _FOLD_EVERY


class _WaitTimed:
    """The handle of an async point-to-point call under stats: its first ``wait()`` records the call's end."""

    def __init__(self, work: Any, finished: Callable[[], None]) -> None:
        self._work = work
        self._finished: Callable[[], None] | None = finished

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        finished, self._finished = self._finished, None
        if finished is not None:
            finished()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _watch_works(works: queue.SimpleQueue[tuple[Any, Callable[[], None]]]) -> None:
    while True:
        work, finished = works.get()
        # A wait that returned into the interpreter's finalisation would abort the process (see native_call): the exit
        # waits for this one (bounded), and once it has begun no new one starts.
        with native_call() as allowed:
            if not allowed:
                return
            try:
                work.wait()  # releases the GIL; the caller's own wait() sees the same result
            except Exception:  # noqa: BLE001, S112 - the caller's wait() reports the failure; record nothing
                continue
        finished()
