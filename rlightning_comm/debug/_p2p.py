"""Debug mode for point-to-point calls: each ``send`` is checked against the ``recv`` it pairs with, by those two ranks
only.

A fingerprint exchange over the whole group (what :mod:`rlightning_comm.debug` does for collectives) would make every
other rank wait for a call it takes no part in. A point-to-point fingerprint belongs to a pair instead: the ``k``-th
send of group rank ``s`` to group rank ``r`` pairs with ``r``'s ``k``-th receive from ``s`` (the order the backend pairs
them in, one tag), and only ``s`` and ``r`` exchange it, through the world's store. It holds the tensor's dtype and
number of elements, and each side's refusal if its local checks failed. Then, on both ranks of the pair:

* a refusal raises the refusing rank's error type, naming it;
* a different dtype or number of elements raises :class:`CommMismatchError`;
* a partner that does not arrive within the group's timeout raises :class:`CommTimeoutError` naming it (and a partner
  that arrives after that raises it too, so the pair stays in step).

A blocking call completes the check before anything is sent. An ``async_op`` call posts its fingerprint and launches at
once (so that two ranks that each post a receive before their send do not wait on each other), and completes the check
in ``wait()``, before waiting for the data: a mismatch there is reported after the transfer started, and the pair's next
calls may not work.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rlightning_comm import rendezvous
from rlightning_comm.errors import CommMismatchError, CommTimeoutError

if TYPE_CHECKING:
    from rlightning_comm.communicators.base import Communicator

OPS = ("send", "recv")
_GAVE_UP = 1 << 40  # added to a pair's arrival count by a rank that timed out


def fingerprint(tensor: Any) -> dict[str, Any]:
    """What a send and its recv must agree on: the dtype and the number of elements (shapes may differ)."""
    if not isinstance(tensor, torch.Tensor):
        return {"tensor": type(tensor).__name__}
    return {"tensor": f"{str(tensor.dtype).removeprefix('torch.')} x {tensor.numel()}"}


class PairChecker:
    """The store-side state of one communicator's point-to-point checks: a count of sends and receives per peer.

    Args:
        comm: The communicator (a member).
        timeout: How long to wait for the partner, in seconds.
        prefix: The store prefix of this generation and group.
        refusals: Error type name -> type, to raise a partner's refusal as its own type.
        refusal_type: The name under which a refusal travels.
    """

    def __init__(
        self,
        comm: Communicator,
        timeout: float,
        prefix: str,
        refusals: dict[str, type[Exception]],
        refusal_type: Callable[[BaseException], str],
    ) -> None:
        self.store = dist.PrefixStore(f"{prefix}/p2p", rendezvous.world_store())
        self.timeout = timeout
        self.mode = comm.mode
        self.ranks = comm.ranks
        self.me = comm.rank
        self.refusals = refusals
        self.refusal_type = refusal_type
        self.sent: Counter[int] = Counter()
        self.received: Counter[int] = Counter()

    def post(
        self, op: str, peer: int, fields: dict[str, Any], refusal: BaseException | None
    ) -> tuple[str, str, list[Any]]:
        """Count this call in and post its fingerprint; returns the pair's key, a description for messages and the
        fingerprint.

        Raises:
            CommTimeoutError: the partner gave this pair's call up before this rank came.
        """
        sender, receiver = (self.me, peer) if op == "send" else (peer, self.me)
        counts = self.sent if op == "send" else self.received
        k = counts[peer]
        counts[peer] += 1
        base = f"{sender}>{receiver}/{k}"
        what = (
            f"{op} #{k} between global rank {self.ranks[sender]} (sending) and global rank {self.ranks[receiver]} "
            f"(receiving) on mode {self.mode!r}"
        )
        if self.store.add(f"{base}/n", 1) >= _GAVE_UP:
            raise CommTimeoutError(
                f"debug check of {what}: global rank {self.ranks[peer]} gave this pair's call up after the group's "
                "timeout "
                f"({self.timeout:g} s) before this rank came. Nothing was sent; the pair's next calls are checked with "
                "each other"
            )
        mine = [fields, None if refusal is None else [self.refusal_type(refusal), str(refusal)]]
        self.store.set(f"{base}/{op}", json.dumps(mine))
        return base, what, mine

    def verify(self, base: str, what: str, op: str, mine: list[Any], refusal: BaseException | None) -> None:
        """Wait for the partner's fingerprint and raise, on this rank as on the partner, if either refused or they
        differ."""
        theirs_key = f"{base}/{'recv' if op == 'send' else 'send'}"
        try:
            self.store.wait([theirs_key], timedelta(seconds=self.timeout))
        except RuntimeError as err:
            if (
                self.store.add(f"{base}/n", _GAVE_UP) - _GAVE_UP < 2
            ):  # the partner never counted itself in: give the call up
                peer = base.split("/")[0].split(">")[1 if op == "send" else 0]
                raise CommTimeoutError(
                    f"debug check of {what}: global rank {self.ranks[int(peer)]} did not reach the matching "
                    f"{'recv' if op == 'send' else 'send'} within {self.timeout:g} s (the group's timeout). Nothing "
                    "was sent"
                ) from err
            self.store.wait(
                [theirs_key], timedelta(seconds=max(self.timeout, 30.0))
            )  # it counted in: its fingerprint is on the way
        theirs = json.loads(self.store.get(theirs_key))
        self.store.delete_key(theirs_key)  # read by this rank only (the partner keeps its own in memory)
        if self.store.add(f"{base}/done", 1) == 2:
            self.store.delete_key(f"{base}/n")
            self.store.delete_key(f"{base}/done")
        send, recv = (mine, theirs) if op == "send" else (theirs, mine)
        refused = [(side, c[1]) for side, c in (("sender", send), ("receiver", recv)) if c[1] is not None]
        if refused:
            side, (kind, message) = refused[0]
            raise self.refusals[kind](
                f"debug check of {what}: the {side} refused the call: {message}. Nothing was sent"
            ) from refusal
        if send[0] != recv[0]:
            raise CommMismatchError(
                f"debug check of {what}: the sender passes {send[0]['tensor']}, the receiver {recv[0]['tensor']}; "
                "a send and its recv need one dtype and number of elements. Nothing was sent"
            )


class _CheckedWork:
    """An async point-to-point call's handle: ``wait()`` completes the pair's check first, then waits for the data."""

    def __init__(self, work: Any, check: Callable[[], None]) -> None:
        self._work = work
        self._check: Callable[[], None] | None = check

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        check, self._check = self._check, None
        if check is not None:
            check()
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def checked(comm: Communicator, name: str, pairs: PairChecker) -> Callable[..., Any]:
    """``comm``'s ``send`` or ``recv``, checked against its partner's call as the module docstring says."""
    method = getattr(type(comm), name)
    local_checks = getattr(type(comm), f"_check_{name}")
    signature = inspect.signature(method)
    peer_name = "dst" if name == "send" else "src"

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(comm, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        with comm._exclusive(name):
            refusal = None
            try:
                local_checks(comm, *args, **kwargs)
            except Exception as err:  # noqa: BLE001 - the partner must learn of it before it waits
                refusal = err
            try:
                peer = comm.ranks.index(int(arguments[peer_name]))
            except (TypeError, ValueError):
                peer = comm.rank
            if (
                peer == comm.rank
            ):  # no other rank of the group to pair with (the local checks refused it): nobody to tell
                raise refusal  # type: ignore[misc]
            base, what, mine = pairs.post(name, peer, fingerprint(arguments["tensor"]), refusal)
            if not arguments["async_op"] or refusal is not None:
                pairs.verify(base, what, name, mine, refusal)
                return method(comm, *args, **kwargs)
            work = method(comm, *args, **kwargs)
            return _CheckedWork(work, lambda: pairs.verify(base, what, name, mine, None))

    return call
