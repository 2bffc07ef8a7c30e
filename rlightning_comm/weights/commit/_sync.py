"""After a weight sync's data phase: verification, and the all-or-nothing commit through the mode's store.

:class:`Sync` is one sync on one member: the data phase (a :class:`~._transport.Transfer`), then, with ``verify`` or
``atomic``, one round of two words per member (a fingerprint of its digests) and, only when they differ, a second round
that names the tensors. With ``atomic`` the destinations received into staging; the source then records the decision in
the mode's store (a key set once with ``compare_set``, under the name of the mode's group, which a connected mode makes
unique to its generation: an old generation's members cannot touch a new one's decision). ``commit`` once every
destination staged and verified; a member that fails before it (a lost peer, a timeout) records ``abort`` instead, and
whichever comes first holds for everyone. A destination writes its live tensors (or calls ``load``) only after it read
``commit``; anything before that point leaves them as they were. After it, every surviving destination commits.

A transfer kind calls :class:`Sync` with its own data phase; nothing here knows how the bytes moved.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from rlightning_comm.errors import CommError, CommMismatchError, PeerLostError
from rlightning_comm.failures import LOSS_GRACE, close_gloo_group, mode_lost, unless_lost
from rlightning_comm.weights.commit._checks import SourceCheck
from rlightning_comm.weights.commit._report import WeightSyncReport
from rlightning_comm.weights.commit._versions import SyncOptions, commit, forget
from rlightning_comm.weights.core._memory import kept
from rlightning_comm.weights.core._wire import mode_store

COMMIT = "commit"
# A destination's looks at the store for the decision: often there already; then every few milliseconds, and at each
# look at the mode's liveness too.
_FIRST_PAUSE, _LAST_PAUSE = 0.0005, 0.01


def _lost(comm: Any) -> bool:
    """Whether ``comm``'s connected mode has lost a member (its group then refuses every call), or this process may
    have been left behind by the others (its watch did not run for most of the liveness bound: it was stopped);
    ``False`` elsewhere."""
    behind = getattr(comm, "_left_behind", None)
    return mode_lost(comm) or (behind is not None and behind())


def _peer_lost(comm: Any, op: str) -> PeerLostError | None:
    """The :class:`PeerLostError` of ``comm``'s lost generation (naming the lost member), or ``None``.

    A process that was stopped may look at it before its watch has read what the others said meanwhile: then the
    watch's word is waited for, briefly.
    """
    deadline = time.monotonic() + LOSS_GRACE
    while True:
        try:
            comm.group.size()
        except PeerLostError as err:
            return comm._failure(op, err)
        if not _lost(comm) or time.monotonic() > deadline:
            return None
        time.sleep(_LAST_PAUSE)


class Sync:
    """One weight sync on one member: its data phase, verification and commit; :meth:`finish` returns the report.

    Args:
        comm: The communicator.
        transfer: The data phase: ``start()``/``finish()``, raising :class:`CommError` with its account.
        options: The call's :class:`SyncOptions`, checked by every member.
        src: The source's rank in the mode.
        sent, received: The bytes of tensor data this member sends and receives, per peer rank.
        digests: ``None``, or the :class:`~._digest.Digests` the data phase feeds.
        live: On an atomic destination: ``(live tensors, staged tensors)`` in the plan's order, or ``(load callable,
            [(name, staged tensor)])``.
        plan_cached: Whether the plan of an earlier call was reused.
        exchange: ``exchange(words) -> rows`` and ``texts(text) -> texts``: the mode's small rounds.
        what: The call's name, for messages.
        applies: Whether this member has live weights to write and a version to record (default: every member but
            ``src``); a transfer kind whose members both send and receive says so.
        coordinator: The rank that records the decision (default ``src``; the same on every member).
        check: How the members' digests are compared (default: :class:`SourceCheck`, against ``src``'s).
        destinations: The ranks with live weights to write (default: every member but ``src``), for messages.
    """

    def __init__(
        self,
        comm: Any,
        transfer: Any,
        options: SyncOptions,
        src: int,
        sent: dict[int, int],
        received: dict[int, int],
        digests: Any,
        live: tuple[Any, list[Any]] | None,
        plan_cached: bool,
        exchange: tuple[Callable[[list[int]], list[list[int]]], Callable[[str | None], list[str | None]]],
        what: str,
        applies: bool | None = None,
        coordinator: int | None = None,
        check: Any = None,
        destinations: list[int] | None = None,
    ) -> None:
        self._comm = comm
        self._transfer = transfer
        self._options = options
        self._src = src
        self._check = SourceCheck(comm, src) if check is None else check
        self._destinations = [r for r in comm.ranks if r != src] if destinations is None else destinations
        me = comm._global_rank
        self._applies = src != me if applies is None else applies
        self._coordinates = (src if coordinator is None else coordinator) == me
        self._report = WeightSyncReport(
            sent=sent, received=received, version=options.version, digests={}, plan_cached=plan_cached
        )
        self._digests = digests
        self._live = live
        self._exchange, self._texts = exchange
        self._what = what
        self._done = False
        self._store = mode_store(comm) if options.atomic else None
        # A key of this sync alone (the source's random word, agreed in the handshake): a store that outlived an earlier
        # context on the same group name holds no decision under it.
        self._key = f"{options.key:x}"
        self.succeeded: Callable[[], None] | None = None  # called once the sync succeeded on this member

    @property
    def done(self) -> bool:
        """Whether :meth:`finish` has returned or raised."""
        return self._done

    def start(self) -> None:
        """Launch what the data phase launches without waiting."""
        try:
            self._transfer.start()
        except CommError as err:
            self._done, self._report = True, None
            if self._digests is not None:
                self._digests.close()
            raise self._no_delta_base(self._not_committed(err, None)) from err

    def finish(self) -> WeightSyncReport | None:
        """Complete the data phase, verify and commit; the report (a second call returns it again at once: ``None``
        after a failure, which the first call raised)."""
        if self._done:
            return self._report
        report, self._report = self._report, None  # kept only once the sync succeeded
        try:
            try:
                self._transfer.finish()
            except CommError as err:
                if self._digests is not None:
                    self._digests.close()
                raise self._not_committed(err, None) from err
            if self._digests is not None:
                report.digests = self._digests.result()
            if self._options.verify:
                self._settle(report.digests)
            elif self._applies:
                commit(self._options)
            self._report = report
            if self.succeeded is not None:
                self.succeeded()
            return report
        except CommError as err:
            if not self._options.delta:
                raise
            raise self._no_delta_base(err) from err.__cause__
        finally:
            self._done = True

    def _no_delta_base(self, err: CommError) -> CommError:
        """With ``delta=True``, a failed sync leaves no base behind on this member (a source's snapshot, a destination's
        note of what it holds): ``err`` with that said. Every member of a failed sync raises, so the next sync with
        ``delta=True`` is a full one on every member, whatever made this one fail."""
        if not self._options.delta:
            return err
        kept(self._comm).drop_delta()
        return type(err)(
            f"{err}\n{self._what}: delta=True: this member dropped what it kept for deltas, so the next sync with "
            "delta=True is a full one",
            *err.args[1:],
        )

    # ------------------------------------------------------------------ phases
    def _settle(self, mine: dict[str, int]) -> None:
        """Check every member's digests (``mine`` here) the call's way (``check``: against the source's, or against
        what the holders sent); with ``atomic``, decide and apply."""
        comm, options = self._comm, self._options
        failure: CommError | None = None
        mismatch: str | None = None
        bad: list[int] = []
        check = self._check
        try:
            rows = self._exchange(check.words(mine))
            bad = check.bad(rows)
            if bad:
                texts = dict(zip(comm.ranks, self._texts(check.text(mine, bad))))
                mismatch = check.mismatch(texts, bad)
        except CommError as err:
            if not options.atomic:
                if self._applies:
                    forget(options)  # whatever the bytes are, they were not verified
                raise type(err)(
                    f"{err}\n{self._what}: the verification did not complete; this member's weights are unverified",
                    *err.args[1:],
                ) from err
            failure = err
        if not options.atomic:
            if mismatch is None:
                if self._applies:
                    commit(options)
                return
            if self._applies:  # the destinations whose bytes are the source's do hold its version
                (forget if comm._global_rank in bad else commit)(options)
            raise CommMismatchError(
                f"{self._what}: {mismatch}. The sync was not atomic: the destinations' live tensors hold the bytes "
                "they received"
            )
        if failure is not None:
            verdict = self._decide(f"abort: {failure}")
        elif self._coordinates:
            verdict = self._decide(COMMIT if mismatch is None else f"abort: {mismatch}")
        else:
            verdict = self._await_decision()
        if verdict != COMMIT:
            if failure is None and mismatch is None:
                failure = _peer_lost(comm, self._what)  # the loss is the error, naming the lost member
            if failure is not None:
                raise self._not_committed(failure, verdict) from failure
            error = CommMismatchError if mismatch is not None or "digests differ" in verdict else CommError
            raise error(self._refusal(verdict.removeprefix("abort: ")))
        if self._applies:
            self._apply()
            commit(options)

    def _decide(self, verdict: str) -> str:
        """Record ``verdict`` as the decision unless one is recorded; the decision that holds (``"unknown: ..."`` when
        the store cannot be reached)."""
        if verdict == COMMIT and _lost(self._comm):
            # Every member voted, but a member was lost since, or this one was stopped: the others may have given up on
            # the sync already, and a commit now could be this member's alone.
            verdict = "abort: a member of the mode was lost, or this member was stopped, before the commit"
        try:
            return self._at_store(lambda: self._store.compare_set(self._key, "", verdict)).decode()
        except RuntimeError as err:  # the store's host is gone, or dark
            return f"unknown: the mode's store could not be reached ({err})"

    def _at_store(self, call: Callable[[], Any]) -> Any:
        """``call()`` on the mode's store, given up once the mode lost a member (its host may be dark: torch's store
        client waits for a reply without a bound) or after the group's timeout.

        Raises:
            RuntimeError: the store's error, or :class:`~rlightning_comm.failures.Abandoned`.
        """
        comm = self._comm
        return unless_lost(call, lambda: _lost(comm), comm.timeout or 1800.0, f"the store of mode {comm.mode!r}")

    def _await_decision(self) -> str:
        """On a destination: the decision, once recorded; ``abort`` recorded by this member when the mode lost a member
        or the group's timeout passed first."""
        timeout = self._comm.timeout or 1800.0
        deadline = time.monotonic() + timeout
        pause = _FIRST_PAUSE
        while True:
            try:
                # check(), not a wait with a short timeout: a TCPStore logs a warning for every wait that times out.
                if self._at_store(lambda: self._store.check([self._key])):
                    return self._at_store(lambda: self._store.get(self._key)).decode()
            except RuntimeError as err:  # the store's host is gone, or dark
                return f"unknown: the mode's store could not be reached ({err})"
            time.sleep(pause)
            pause = min(2 * pause, _LAST_PAUSE)
            if _lost(self._comm):
                return self._decide("abort: a member of the mode was lost before the commit")
            if time.monotonic() > deadline:
                return self._decide(f"abort: no decision within the group's timeout ({timeout:g} s)")

    def _apply(self) -> None:
        """On a destination, after ``commit``: write the live tensors from staging (or hand it to ``load``)."""
        target, staged = self._live
        if callable(target):
            target(staged)
            return
        writes = torch.inference_mode if any(t.is_inference() for t in target) else contextlib.nullcontext
        with writes():
            for live, new in zip(target, staged):
                live.copy_(new)

    # ---------------------------------------------------------------- messages
    def _left(self) -> str:
        options = self._options
        head = "the sync was not committed" if options.version is None else f"version {options.version} not committed"
        if self._applies:
            held = options.left(self._comm._global_rank)
            live = "unchanged" if options.version is None else f"{held}"
            return f"{head}; live weights are {live}"
        if options.version is None:
            return f"{head}; every destination's live weights are unchanged"
        held = ", ".join(f"rank {r}: {options.left(r)}" for r in self._destinations)
        return f"{head}; every destination's live weights are unchanged ({held})"

    def _refusal(self, why: str) -> str:
        return f"{self._what}: {self._left()}: {why}"

    def _not_committed(self, err: CommError, verdict: str | None) -> CommError:
        """The data phase's (or the vote's) ``err``, saying what it left: with ``atomic``, not committed."""
        options = self._options
        if not options.atomic:
            if self._applies:
                forget(options)  # partly written, or not: it holds no one version now
            return type(err)(str(err), *err.args[1:])
        if verdict is None:
            verdict = self._decide(f"abort: {type(err).__name__}")
            if verdict == COMMIT:  # unreachable: a commit needs this member's vote, which it never gave
                verdict = "abort"
        if self._comm.backend == "gloo":
            with contextlib.suppress(Exception):  # already broken: let the peers' pending calls fail now
                close_gloo_group(self._comm.group)
        return type(err)(f"{self._refusal(str(err))}", *err.args[1:])
