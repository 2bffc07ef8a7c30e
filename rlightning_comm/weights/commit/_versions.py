"""Weight versions: what a sync carries, what each destination committed, and the refusal of a stale sync.

A weight-sync call takes its options (:class:`SyncOptions`) through one round a transfer already makes:
:meth:`SyncOptions.words` are appended to this member's words of the transfer's handshake, and :meth:`SyncOptions.check`
reads every member's words back, identically on every member, and raises the same error on each before any byte moves. A
transfer kind calls these two and :func:`commit` on its destinations; nothing here sends anything.

The record of committed versions is the context's (:meth:`CommContext.get_weight_version`), per mode name: it outlives a
connected mode's generations and goes with :meth:`CommContext.destroy`.
"""

from __future__ import annotations

import secrets
from typing import Any

import torch

from rlightning_comm.context import CommContext
from rlightning_comm.errors import CommError, CommMismatchError
from rlightning_comm.modes import mode_name

Problem = tuple[type[Exception], str] | None
# requested version, committed version, verify, atomic, a random key for this sync's decision, delta, and for a delta
# the version this member's snapshot holds (a sender), the one its tensors hold (a receiver) and the bytes of a sender's
# delta; -1 for none
WORDS = 9
ANY_VERSION = "any"
"""A destination's ``version=``: take whichever version the sources send (newer than the one it committed, as always);
the report and the record then hold it."""
_ANY = -2  # its word


class SyncOptions:
    """A weight-sync call's version, verification and commit options, checked on this member.

    Args:
        version: The version the sync carries, or ``None``; on a destination :data:`ANY_VERSION` takes the sources'.
        verify: Whether destinations check per-tensor digests against the source's.
        atomic: Whether destinations stage, verify and commit all or nothing (implies ``verify``).
        staging_device: Where an atomic sync's destinations stage (``None``: each tensor's own device).
        record_as: The mode whose version record a destination updates (``None``: the sync's own mode).
        mode: The sync's own mode.
        delta: Whether only the elements that changed since the last sync move (``delta=True``).
    """

    def __init__(
        self,
        version: Any,
        verify: Any,
        atomic: Any,
        staging_device: Any,
        record_as: Any,
        mode: str,
        delta: Any = False,
    ) -> None:
        self.any_version = version == ANY_VERSION  # a destination taking whichever version its source sends
        if self.any_version:
            version = None
        self.version = version
        self.verify = verify
        self.atomic = atomic
        self.delta = delta
        self.base = -1  # a sender's: the version its snapshot holds (set by the transfer kind before words())
        self.held = -1  # a receiver's: the version its tensors are known to hold
        self.offer = -1  # a sender's: the bytes of its delta
        self.bases: dict[int, int] = {}  # every member's base, held and offer, after check()
        self.helds: dict[int, int] = {}
        self.offers: dict[int, int] = {}
        self.staging_device: torch.device | None = None
        self.problem: Problem = None
        self.committed: dict[int, int | None] = {}  # every member's committed version, after check()
        self.key = 0  # the source's random word, after check(): names this sync's decision in the mode's store
        wrong: list[tuple[type[Exception], str]] = []
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            wrong.append((TypeError, f"version must be an int or None; got {type(version).__name__} {version!r}"))
        elif version is not None and not 0 <= version < 2**62:
            wrong.append((ValueError, f"version must be in 0..2**62-1; got {version}"))
        for label, value in (("verify", verify), ("atomic", atomic), ("delta", delta)):
            if not isinstance(value, bool):
                wrong.append((TypeError, f"{label} must be a bool; got {type(value).__name__} {value!r}"))
        if delta is True and version is None and not self.any_version:
            wrong.append(
                (
                    ValueError,
                    "delta=True needs a version: a delta applies to the version a destination committed, so each sync "
                    "carries one (version=...); got version=None",
                )
            )
        if staging_device is not None:
            try:
                self.staging_device = torch.device(staging_device)
            except (RuntimeError, TypeError) as err:
                wrong.append((ValueError, f"staging_device={staging_device!r} is not a device: {err}"))
        try:
            self.record_as = mode if record_as is None else mode_name(record_as)
        except (TypeError, ValueError) as err:
            self.record_as = mode
            wrong.append((type(err), f"record_as: {err}"))
        if wrong:
            self.problem = (wrong[0][0], "; ".join(msg for _, msg in wrong))
        self.verify = bool(verify is True or atomic is True)
        self.delta = delta is True

    @property
    def settles(self) -> bool:
        """Whether the sync has a phase after the data (verification, commit)."""
        return self.verify or self.atomic is True

    def words(self) -> list[int]:
        """This member's words for the handshake: the version it asks for, the one it committed, its flags."""
        committed = CommContext().get_weight_version(self.record_as)
        ok = self.problem is None
        return [
            _ANY if ok and self.any_version else self.version if ok and self.version is not None else -1,
            -1 if committed is None else committed,
            int(ok and self.verify),
            int(ok and self.atomic is True),
            secrets.randbits(62),
            int(ok and self.delta is True),
            self.base if ok and self.delta is True else -1,
            self.held if ok and self.delta is True else -1,
            self.offer if ok and self.delta is True else -1,
        ]

    def check(
        self,
        ranks: tuple[int, ...],
        rows: list[list[int]],
        src: int,
        what: str,
        destinations: set[int] | None = None,
        sources: set[int] | None = None,
    ) -> None:
        """Raise the same error on every member when the members' words (``rows``, in ``ranks``' order) refuse the
        sync.

        ``src``'s random word names the sync's decision. The destinations (default: every member but ``src``) must not
        have committed this version or a later one; the sources (default: ``src``), unless also destinations, must hold
        this version or none.

        Raises:
            ValueError: the members ask for different versions or flags.
            CommMismatchError: a destination has committed a version at or past this one, or the source holds another.
        """
        self.committed = {rank: (None if row[1] < 0 else row[1]) for rank, row in zip(ranks, rows)}
        self.key = rows[ranks.index(src)][4]
        if destinations is None:
            destinations = {r for r in ranks if r != src}
        if sources is None:
            sources = {src}
        takers = [r for r, row in zip(ranks, rows) if row[0] == _ANY]
        if any(r in sources for r in takers):
            raise ValueError(
                f"{what}: nothing was transferred; version={ANY_VERSION!r} is a destination's (it takes the version "
                f"its sources send), but sending members pass it (ranks {[r for r in takers if r in sources]}): a "
                "source names the version it sends"
            )
        if takers:  # they take the version the others name (the same on every member), or none
            named = {row[0] for row in rows if row[0] != _ANY}
            agreed = named.pop() if len(named) == 1 else -1
            rows = [[agreed if i == 0 and row[0] == _ANY else w for i, w in enumerate(row)] for row in rows]
            if self.any_version:
                self.version = None if agreed < 0 else agreed
        self.bases = {rank: row[6] for rank, row in zip(ranks, rows)}
        self.helds = {rank: row[7] for rank, row in zip(ranks, rows)}
        self.offers = {rank: row[8] for rank, row in zip(ranks, rows)}
        for index, label in ((0, "version"), (2, "verify"), (3, "atomic"), (5, "delta")):
            if len({row[index] for row in rows}) > 1:

                def shown(v: int, index: int = index) -> str:
                    return ("None" if v < 0 else str(v)) if index == 0 else str(bool(v))

                named = ", ".join(f"rank {rank}: {shown(row[index])}" for rank, row in zip(ranks, rows))
                raise ValueError(
                    f"{what}: nothing was transferred; the members pass different {label}s ({named}); expected one "
                    f"{label} on every member"
                )
        if self.version is None:
            return
        stale = [(r, v) for r, v in self.committed.items() if r in destinations and v is not None and v >= self.version]
        other = [
            (r, v)
            for r, v in self.committed.items()
            if r in sources and r not in destinations and v is not None and v != self.version
        ]
        if stale or other:
            detail = [f"rank {r} has committed version {v}" for r, v in stale]
            for r, v in other:
                who = "the source" if sources == {src} else "a holder"
                detail.append(f"{who} (rank {r}) holds version {v}, not {self.version}")
            raise CommMismatchError(
                f"{what}: version {self.version} refused (versions of mode {self.record_as!r}), nothing was "
                f"transferred: {'; '.join(detail)}. A destination only moves forward; a source sends the version it "
                "holds"
            )

    def not_committed(self, op: str, err: CommError) -> CommError | None:
        """For a versioned or atomic sync, ``err`` (a member lost or absent before any byte moved) restated to say the
        version was not committed and which one the live weights are; ``None`` for a plain sync or a refusal (raise
        ``err``: a :class:`CommMismatchError` of the handshake already says nothing was transferred, and why)."""
        if (self.version is None and not self.atomic) or isinstance(err, CommMismatchError):
            return None
        held = CommContext().get_weight_version(self.record_as)
        left = "no committed version" if held is None else f"version {held}"
        return type(err)(
            f"{op}: version {self.version} not committed; live weights are {left} (nothing was transferred): {err}",
            *err.args[1:],
        )

    def left(self, rank: int) -> str:
        """What a destination at ``rank`` still holds: its committed version, in words."""
        v = self.committed.get(rank)
        return "no committed version" if v is None else f"version {v}"


def commit(options: SyncOptions) -> None:
    """On a destination whose live weights now hold the sync's bytes: record the version (``None`` clears it)."""
    CommContext()._record_weight_version(options.record_as, options.version)


def forget(options: SyncOptions) -> None:
    """On a destination whose live weights were partly written: it holds no committed version any more."""
    CommContext()._record_weight_version(options.record_as, None)
