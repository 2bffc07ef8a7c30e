"""``async_op=True`` on both weight-sync calls: this member's bytes captured, the call run on a thread of its own.

A source (a holder) returns as soon as its bytes are captured: a copy of the tensors it sends, on their own devices,
into buffers kept for the next publish (a fresh copy of a large model costs several times more to fault in than to
fill). Its caller may then change its tensors: the sync sends the captured bytes. The call itself (the agreement, the
data phase, verification and commit) runs on a thread of its own, exactly as a blocking call would;
:meth:`StateDictTransfer.wait` returns its report, or raises what it raised (on every member, as the blocking call
does). A destination captures nothing: its tensors are written in the background, so it must not read or write them
until ``wait()`` returns.

Publishes on one mode queue, in the order they were made: a publish made while another drains starts once that one has
finished (every member makes its calls in the same order, so the queues agree). At most :data:`MAX_QUEUED` publishes
wait behind the one draining: one more blocks its caller until the oldest has finished (bounded memory: one capture per
publish). Any other weight-sync call on the mode first waits for the publishes before it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlightning_comm._compat import native_call
from rlightning_comm.errors import CommError
from rlightning_comm.weights.core._memory import Kept

MAX_QUEUED = 1
"""Publishes that may wait behind the one draining on a mode before a new one blocks its caller."""

_Key = tuple[Any, ...]


def _key(t: torch.Tensor) -> _Key:
    return (t.dtype, tuple(t.shape), t.stride(), t.device)


class Captures:
    """The buffers publishes copy into, kept per communicator and reused when a publish of the same tensors finished."""

    def __init__(self) -> None:
        self._free: list[tuple[tuple[_Key, ...], list[torch.Tensor]]] = []
        self._lock = threading.Lock()

    def take(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        """Copies of ``tensors`` (same dtypes, shapes and devices, and strides where they are dense; the same view
        captured once, so tied tensors stay tied), in buffers kept from an earlier publish where they fit; and the
        token that gives them back (:meth:`give_back`)."""
        firsts: dict[tuple[int, _Key], int] = {}
        order: list[int] = []
        uniques: list[torch.Tensor] = []
        for t in tensors:
            where = (t.data_ptr(), _key(t))
            if where not in firsts:
                firsts[where] = len(uniques)
                uniques.append(t)
            order.append(firsts[where])
        keys = tuple(_key(t) for t in uniques)  # of the tensors captured: what the next publish of them looks for
        with self._lock:
            found = next((i for i, (k, _) in enumerate(self._free) if k == keys), None)
            buffers = self._free.pop(found)[1] if found is not None else None
        if buffers is None:
            buffers = [torch.empty_like(t, memory_format=torch.preserve_format) for t in uniques]  # overlap: dense
        with torch.no_grad():
            for buffer, t in zip(buffers, uniques):
                buffer.copy_(t.detach())
        for device in {b.device for b in buffers if b.is_cuda}:
            # The copies ran on the caller's stream; the publish's thread reads them on another: the caller may change
            # its tensors once they are done (untested: no GPU has run this path yet).
            torch.cuda.current_stream(device).synchronize()
        return [buffers[i] for i in order], (keys, buffers)

    def give_back(self, token: Any) -> None:
        """Keep the buffers of a finished publish for the next one (at most two sets: one draining, one filling)."""
        with self._lock:
            self._free.append(token)
            del self._free[:-2]


def captures(memory: Kept) -> Captures:
    """The communicator's :class:`Captures`, made on first use."""
    if memory.captures is None:
        memory.captures = Captures()
    return memory.captures


class StateDictTransfer:
    """The handle ``broadcast_state_dict(..., async_op=True)`` and ``reshard_state_dict(..., async_op=True)`` return:
    the call, running on a thread of its own; :meth:`wait` returns its report.

    Made by the calls, not by users. Args:
        memory: The communicator's memory, where the mode's queue of publishes lives.
        run: The blocking call, on the captured bytes.
        op: The call's name, for the thread's name.
        release: Called once the call finished (either way): gives the capture's buffers back.
    """

    def __init__(self, memory: Kept, run: Callable[[], Any], op: str, release: Callable[[], None] | None) -> None:
        self._run, self._release = run, release
        self._done = threading.Event()
        self._report: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=f"rlightning-comm {op}", daemon=True)
        with memory.publish_lock:
            queue = [p for p in memory.publishes if not p._done.is_set()]
            waits_for = queue[-(MAX_QUEUED + 1)] if len(queue) > MAX_QUEUED else None
            self._after = queue[-1] if queue else None
            memory.publishes = [*queue, self]
        if waits_for is not None:  # bounded: the caller waits for the oldest before it adds one more capture
            waits_for._done.wait()
        self._thread.start()

    def _main(self) -> None:
        try:
            if self._after is not None:
                self._after._done.wait()  # in order, as on every other member
            # Kept out of the interpreter's finalisation: at its exit no publish starts, and the exit waits (bounded)
            # for the ones in flight (a native call returning into the finalisation would abort the process).
            with native_call() as allowed:
                if not allowed:
                    raise CommError("the publish did not start: the interpreter exits")
                self._report = self._run()
        except BaseException as err:  # noqa: BLE001 - raised by wait(), in the caller's thread
            self._error = err
        finally:
            self._run = None  # the captured bytes go with it
            if self._release is not None:
                self._release()
            self._done.set()

    def is_completed(self) -> bool:
        """Whether the call has finished (returned or raised): :meth:`wait` then returns at once."""
        return self._done.is_set()

    def wait(self) -> Any:
        """Wait for the call to finish; its report (the same on a second call), or what it raised.

        Raises:
            CommTimeoutError, CommError, CommMismatchError, TypeError, ValueError: what the blocking call raises, on
                every member as it does.
        """
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._report


def drain(memory: Kept) -> None:
    """Before a weight-sync call on the mode: wait for every publish made before it (on a publish's own thread, the
    ones queued before that publish; on any other thread, all of them)."""
    me = threading.current_thread()
    with memory.publish_lock:
        queue = list(memory.publishes)
    mine = next((i for i, p in enumerate(queue) if p._thread is me), len(queue))
    for p in queue[:mine]:
        p._done.wait()
