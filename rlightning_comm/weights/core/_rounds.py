"""The small rounds of a weight sync: every member's few words (or one text) on every member, and a problem found on
one member raised on all of them.

Both weight-sync calls agree through these rounds before any byte moves, and verify through them afterwards. They call
the mode's own process group directly (not the communicator's methods, which stats or debug mode may wrap), so they
work on a group outside torch's world and use no store. Over gloo with host tensors a round is two hops of
point-to-point messages through group rank 0, run in the calling threads; a gloo all-gather hands its work to a worker
thread and runs a ring, which took about twice as long on 3 ranks here. Other backends all-gather; on CUDA on a stream
of the rounds' own, read back through pinned memory, so the host waits for the round's few bytes only and never for the
work the caller queued on its stream.
"""

from __future__ import annotations

import contextlib
import json
import struct
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.distributed_c10d import AllgatherOptions

from rlightning_comm.errors import CommError, CommTimeoutError
from rlightning_comm.failures import LAUNCH_ERRORS, await_work, close_gloo_group, unless_lost
from rlightning_comm.weights.core._checks import Problem
from rlightning_comm.weights.core._memory import Kept
from rlightning_comm.weights.core._wire import mode_store, point_to_point

_NOTE = "rounds/absent"  # the key (with the round's number) under which member 0 names the members that did not come
_GRACE = 1.0  # seconds a member whose round failed looks for member 0's note (written within milliseconds)
HANDSHAKE_TAG = 0x5755  # the point-to-point tag of the rounds over gloo (the data's is the next-lower one)
ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (TypeError, ValueError, RuntimeError, NotImplementedError)
}
"""The exception types a member's problem may have, by name: what a shared problem is raised as on every member."""


def on_device(comm: Any, memory: Kept, run: Any) -> torch.Tensor:
    """``run(device)``, a collective that returns a tensor on ``comm``'s device, and that tensor on the host.

    On CUDA on the rounds' own stream: the collective then waits for nothing the caller queued, and the host waits for
    its result only.
    """
    device = comm.device
    if device.type == "cpu":
        return run(device)
    if device.type != "cuda":
        return run(device).cpu()
    if memory.stream is None:
        memory.stream = torch.cuda.Stream(device=device)
    with torch.cuda.stream(memory.stream):
        out = run(device)
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        memory.stream.synchronize()
    return host


def exchange(comm: Any, words: list[int], memory: Kept, op: str = "broadcast_state_dict") -> list[list[int]]:
    """Every member's ``words`` (the same count on each), in group-rank order, on every member: one round.

    A failure is the communicator's error naming ``op``.
    """
    n = len(words)
    mine = torch.tensor(words, dtype=torch.int64)
    if not point_to_point(comm):

        def gather(device: torch.device) -> torch.Tensor:
            rows = torch.empty(comm.world_size, n, dtype=torch.int64, device=device)
            comm._run(op, lambda: comm.group.allgather([list(rows.unbind())], [mine.to(device)], AllgatherOptions()))
            return rows

        return on_device(comm, memory, gather).tolist()
    rows = torch.empty(comm.world_size, n, dtype=torch.int64)
    group, peers = comm.group, range(1, comm.world_size)
    memory.rounds += 1
    absent: list[int] = []
    try:
        if comm.rank == 0:
            rows[0] = mine
            absent = _collect(comm, op, [(peer, group.recv([rows[peer]], peer, HANDSHAKE_TAG)) for peer in peers])
            works = [] if absent else [group.send([rows], peer, HANDSHAKE_TAG) for peer in peers]
        else:
            works = [group.send([mine], 0, HANDSHAKE_TAG), group.recv([rows], 0, HANDSHAKE_TAG)]
        for work in works:
            await_work(comm, work, op)
    except CommError:  # the library's own: a loss the watch named
        raise
    except LAUNCH_ERRORS as err:
        # Member 0 may have found a member absent: gloo then closes every connection of the group (which is what woke
        # this one), so it names the absent members in the mode's store instead; a look there, bounded.
        gone = _noted(comm, memory.rounds) if comm.rank != 0 else None
        if gone is not None:
            raise _absent(comm, op, gone, None) from err
        close_gloo_group(comm.group)  # a member failed the round: no other may wait out the group's timeout for it
        raise comm._failure(op, err) from err
    if absent:
        raise _absent(comm, op, [comm.ranks[r] for r in absent], memory.rounds)
    return rows.tolist()


def _absent(comm: Any, op: str, gone: list[int], note: int | None) -> CommTimeoutError:
    """The error of a round some members did not join (on member 0, ``note``: the round, noted in the mode's store for
    the others first)."""
    if note is not None:
        with contextlib.suppress(Exception):  # the note is a courtesy: the others then fail at their own timeout
            store = mode_store(comm)
            if store is not None:
                store.set(f"{_NOTE}/{note}", json.dumps(gone))
    return CommTimeoutError(
        f"{op} on mode {comm.mode!r} timed out after {_timeout(comm):g} s (the group's timeout): the members at ranks "
        f"{gone} did not join it, while every other member called it; nothing was transferred"
    )


def _noted(comm: Any, round_: int) -> list[int] | None:
    """The absent members member 0 noted for ``round_``, looked for during at most :data:`_GRACE` seconds (on a helper
    thread given up then: a store whose host went dark does not answer); ``None``: none."""
    key = f"{_NOTE}/{round_}"

    def look() -> list[int] | None:
        store = mode_store(comm)
        deadline = time.monotonic() + _GRACE
        while store is not None and time.monotonic() < deadline:
            if store.check([key]):
                return json.loads(store.get(key))
            time.sleep(0.02)
        return None

    try:
        return unless_lost(look, lambda: False, _GRACE + 0.5, "the mode's store")
    except Exception:  # noqa: BLE001 - no store this group reaches, its host is gone or dark: no note
        return None


def _timeout(comm: Any) -> float:
    return comm.timeout or 1800.0


def _collect(comm: Any, op: str, recvs: list[tuple[int, Any]]) -> list[int]:
    """On member 0: wait for every peer's words within the group's timeout; the peers whose words did not come (a
    failure other than a timeout is raised)."""
    deadline = time.monotonic() + _timeout(comm)
    absent = []
    for peer, work in recvs:
        try:
            if comm._outside_world:  # a connected mode: given up once a loss is known, else at gloo's own timeout
                await_work(comm, work, op)
            else:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.05)))
        except CommError:  # the library's own (a lost member): as it is
            raise
        except LAUNCH_ERRORS as err:
            # Absent: its words did not come within the group's timeout (gloo then closes every connection, so the
            # peers after it fail at once); anything earlier is a failure of the round, raised as such.
            if not (_timed_out(err) and time.monotonic() > deadline - 0.1 * _timeout(comm)):
                close_gloo_group(comm.group)
                raise comm._failure(op, err) from err
            absent.append(peer)
    return absent


def _timed_out(err: BaseException) -> bool:
    """Whether a wait failed because its time ran out (gloo closes the pair then: "Application timeout caused pair
    closure"), not because the peer's connection broke."""
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def exchange_texts(comm: Any, text: str | None, memory: Kept, op: str = "broadcast_state_dict") -> list[str | None]:
    """Every member's ``text`` (``None``: none), in group-rank order: two rounds (the lengths, then the padded
    bytes)."""
    data = b"" if text is None else text.encode()
    lengths = [row[0] for row in exchange(comm, [len(data) if text is not None else -1], memory, op)]
    width = -(-max(max(lengths), 0) // 8)
    if width == 0:
        return ["" if n == 0 else None for n in lengths]
    rows = exchange(comm, list(struct.unpack(f"<{width}q", data.ljust(8 * width, b"\0"))), memory, op)
    return [None if n < 0 else struct.pack(f"<{width}q", *row)[:n].decode() for row, n in zip(rows, lengths)]


def raise_shared(comm: Any, problem: Problem, memory: Kept, op: str = "broadcast_state_dict") -> None:
    """Exchange every member's problem and raise the first one's type, naming every rank that has one (call on every
    member, after a round showed one): ``"<op>: nothing was transferred; rank 2: ..."``, or ``"ranks [0, 1]: ..."`` for
    a problem several members found."""
    texts = exchange_texts(comm, None if problem is None else f"{problem[0].__name__}\0{problem[1]}", memory, op)
    found = [(rank, *text.split("\0", 1)) for rank, text in zip(comm.ranks, texts) if text is not None]
    by_problem: dict[str, list[int]] = {}  # one problem found on several members is said once, naming them all
    for rank, _, msg in found:
        by_problem.setdefault(msg, []).append(rank)
    detail = "; ".join(
        f"rank {ranks[0]}: {msg}" if len(ranks) == 1 else f"ranks {ranks}: {msg}" for msg, ranks in by_problem.items()
    )
    raise ERRORS.get(found[0][1], RuntimeError)(f"{op}: nothing was transferred; {detail}")


def rounds(
    comm: Any, memory: Kept, op: str
) -> tuple[Callable[[list[int]], list[list[int]]], Callable[[str | None], list[str | None]]]:
    """The rounds a :class:`~._commit.Sync` verifies and commits through, on ``comm``: ``(words, text)``."""
    return (lambda words: exchange(comm, words, memory, op), lambda text: exchange_texts(comm, text, memory, op))
