"""Atomic syncs of a fleet whose engines are stopped and resumed, or killed, at any moment of the sync.

A connected mode of 4 members forked from a server that imported torch once: the trainer (member 0, the store's host)
and engines 1 to 3, relaying 0 -> 1 -> 2 -> 3. Each scenario first syncs version 1 to everyone, then syncs version 2
atomically while engine 3 stops itself (SIGSTOP) at a point of the sync and the test kills engine 2 (SIGKILL) and
resumes engine 3 (SIGCONT), or engine 2 kills itself at a point. Every survivor's call must end with ``PeerLostError``
naming a lost member within a bound of the kill (of the resume, for the stopped engine), far under the collectives'
timeout; all survivors must hold one version's bytes (SHA-256 of the tensors here, not the library's digests); and the
survivors then re-form the mode and sync version 3 exactly.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest
import torch
from test_connect_hardening import _error, _Procs

from rlightning_comm import CommContext, broadcast_state_dict

MODE = "ATOMIC_HANGS"
LIVENESS = 2.0  # a stopped member is lost 2 to 2.5 s after its last heartbeat
TIMEOUT = 20.0  # the collectives' timeout: a survivor that waits it out fails the bound
BOUND = 15.0  # seconds from the kill (the resume, for the stopped engine) by which every survivor's call has ended
# (tensors, elements, bucket bytes): 1 MiB in 4 buckets, or, where a member must be left in the middle of a message,
# 32 MiB in 4 buckets of 8 MiB, more than loopback sockets buffer for a stopped receiver.
SMALL, BIG = (4, 1 << 16, 1 << 18), (8, 1 << 20, 8 << 20)
SOURCE, RELAY, VICTIM, STOPPED = 0, 1, 2, 3


def _state(version: int, size: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    tensors, elements, _ = size
    g = torch.Generator().manual_seed(version)
    return {f"w{i}": torch.randn(elements, generator=g) for i in range(tensors)}


def _sha(state: dict[str, torch.Tensor]) -> str:
    """One SHA-256 over every tensor's bytes, in name order: the test's oracle of what a member holds."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _arm(point: str, act) -> None:
    """In a member: call ``act`` (stop or kill this process) at ``point`` of its next sync."""
    from rlightning_comm.weights.broadcast import _call as _broadcast
    from rlightning_comm.weights.broadcast import _pipeline
    from rlightning_comm.weights.commit import _sync as _commit

    def before(owner, name):
        original = getattr(owner, name)

        def hooked(*args, **kwargs):
            setattr(owner, name, original)
            act()
            return original(*args, **kwargs)

        setattr(owner, name, hooked)

    if point == "handshake":  # before any byte moves
        before(_broadcast, "agree")
    elif point == "data":  # a few buckets in
        original, seen = _pipeline.Pipeline._complete, []

        def complete(self, entry):
            seen.append(1)
            if len(seen) == 2:
                act()
            return original(self, entry)

        _pipeline.Pipeline._complete = complete
    elif point == "vote":  # staged and verified, before its digests' round
        before(_commit.Sync, "_settle")
    elif point == "decision":  # voted, waiting for the source's decision
        before(_commit.Sync, "_await_decision")
    elif point == "apply":  # read commit, before writing its live tensors
        before(_commit.Sync, "_apply")
    elif point == "commit":  # on the source: every destination voted, the decision not yet recorded
        before(_commit.Sync, "_decide")
    else:
        raise ValueError(point)


def _stop() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _sync(ctx: CommContext, state: dict[str, torch.Tensor], version: int, bucket: int) -> dict:
    """One atomic sync of ``version``; what it raised (if anything), when, and what this member holds then."""
    t0 = time.monotonic()
    try:
        broadcast_state_dict(state, MODE, src=0, bucket_bytes=bucket, version=version, atomic=True)
        outcome = None
    except Exception as err:  # noqa: BLE001 - every outcome goes back to the test
        outcome = _error(err)
    return {
        "error": outcome,
        "took": time.monotonic() - t0,
        "ended": time.monotonic(),
        "version": ctx.get_weight_version(MODE),
        "sha": _sha(state),
    }


def _member(out, rank: int, address: str, role: str, point: str, size: tuple[int, int, int]) -> None:
    """A member: syncs version 1, then version 2 (``role`` ``"stop"``/``"die"``: stopping or dying at ``point``),
    reports, then re-forms with the rank and size the test sends and syncs version 3."""
    ctx = CommContext()
    if rank == 0:
        address = ctx.listen("127.0.0.1:0")
        out.send(("address", address))
    ctx.connect(MODE, rank=rank, world_size=4, address=address, timeout=TIMEOUT, liveness_timeout=LIVENESS)
    live, bucket = _state(0, size), size[2]
    state = (lambda v: _state(v, size)) if rank == 0 else (lambda v: live)
    first = _sync(ctx, state(1), 1, bucket)
    out.send(("synced", rank, first))
    out.recv()  # go
    if role == "stop":
        _arm(point, _stop)
    elif role == "die":
        _arm(point, _die)
    out.send(("outcome", rank, _sync(ctx, state(2), 2, bucket)))
    new_rank, members = out.recv()
    ctx.connect(MODE, rank=new_rank, world_size=members, address=address, timeout=TIMEOUT, liveness_timeout=LIVENESS)
    out.send(("resynced", rank, _sync(ctx, state(3), 3, bucket)))
    time.sleep(60)


@pytest.fixture
def procs():
    p = _Procs()
    yield p
    p.close()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _wait_stopped(procs: _Procs, name: str, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    while not _stopped(procs.procs[name].pid):
        assert time.monotonic() < deadline, f"{name} did not stop within {timeout} s"
        time.sleep(0.005)
    return time.monotonic()


# Engine 3 stops at a point, engine 2 is lost (SIGKILL, or SIGSTOP: a host gone dark) after 0.3 s, engine 3 resumes
# after the given seconds. Stopped in the data phase, engine 3 holds part of a bucket engine 2 forwards (what its socket
# buffers took), so once resumed it waits in the middle of that message.
STOP_LOSE_RESUME = [
    pytest.param("data", signal.SIGKILL, 1.0, BIG, id="mid-message-killed"),  # resumed before it was found silent
    pytest.param("data", signal.SIGSTOP, 1.0, BIG, id="mid-message-gone-dark"),
    pytest.param("vote", signal.SIGKILL, 3.5, SMALL, id="before-the-vote-resumed-late"),  # the others gave up on it
    pytest.param("decision", signal.SIGKILL, 1.0, SMALL, id="at-the-commit-point"),
]
DIE_AT = ["handshake", "data", "decision"]


def _run(procs: _Procs, roles: dict[int, tuple[str, str]], size: tuple[int, int, int] = SMALL) -> None:
    procs.start("m0", _member, 0, "", *roles.get(0, ("", "")), size)
    _, address = procs.next("m0", "address")
    for r in (1, 2, 3):
        procs.start(f"m{r}", _member, r, address, *roles.get(r, ("", "")), size)
    for r in range(4):
        assert procs.next(f"m{r}", "synced", timeout=60)[2]["error"] is None
    for r in range(4):
        procs.pipes[f"m{r}"].send(("go",))


def _check(
    procs: _Procs, survivors: list[int], events: dict[int, float], lost: set[int], size: tuple[int, int, int] = SMALL
) -> None:
    """Every survivor's call ended within BOUND of its event, with PeerLostError naming a lost member (or with the new
    version, committed everywhere); every engine holds one version's bytes; the survivors re-form and sync version 3."""
    outcomes = {}
    for r in survivors:
        _, _, outcome = procs.next(f"m{r}", "outcome", timeout=BOUND + TIMEOUT + 10)
        outcomes[r] = outcome
    engines = {r: outcomes[r] for r in survivors if r != SOURCE}
    shas = {o["sha"] for o in engines.values()}
    old, new = _sha(_state(1, size)), _sha(_state(2, size))
    assert len(shas) == 1 and shas <= {old, new}, f"the survivors hold different bytes: {outcomes}"
    held = 1 if shas == {old} else 2
    assert all(o["version"] == held for o in engines.values()), (held, outcomes)
    for r, o in outcomes.items():
        assert o["ended"] - events[r] < BOUND, f"member {r} ended {o['ended'] - events[r]:.1f} s after its event: {o}"
        if o["error"] is None:  # the sync's commit point had passed: every survivor holds the new version
            assert held == 2, (r, outcomes)
            continue
        assert o["error"][0] == "PeerLostError", (r, o)
        assert o["error"][2] in lost, f"member {r} named member {o['error'][2]}, expected one of {sorted(lost)}: {o}"
    for new_rank, r in enumerate(survivors):
        procs.pipes[f"m{r}"].send((new_rank, len(survivors)))
    for r in survivors:
        _, _, again = procs.next(f"m{r}", "resynced", timeout=60)
        assert again["error"] is None and again["sha"] == _sha(_state(3, size)) and (r == 0 or again["version"] == 3), (
            again
        )


@pytest.mark.parametrize(("point", "loss", "resume_after", "size"), STOP_LOSE_RESUME)
def test_an_engine_stopped_then_another_lost_then_the_first_resumed(procs, point, loss, resume_after, size):
    """Engine 3 stops at ``point``, engine 2 is killed or goes dark, engine 3 resumes: the trainer and engine 1 end
    within the bound of the loss, engine 3 within the bound of its resume, never on a version of its own."""
    _run(procs, {STOPPED: ("stop", point)}, size)
    stopped = _wait_stopped(procs, f"m{STOPPED}")
    time.sleep(0.3)
    lost = procs.signal(f"m{VICTIM}", loss)
    time.sleep(max(0.0, stopped + resume_after - time.monotonic()))
    resumed = procs.signal(f"m{STOPPED}", signal.SIGCONT)
    _check(procs, [SOURCE, RELAY, STOPPED], {SOURCE: lost, RELAY: lost, STOPPED: resumed}, {VICTIM, STOPPED}, size)


@pytest.mark.parametrize("point", DIE_AT)
def test_an_engine_killed_at_any_point_of_an_atomic_sync(procs, point):
    """Engine 2, a relay, kills itself at ``point``: before any byte moves, a bucket into the data, after its vote."""
    _run(procs, {VICTIM: ("die", point)})
    procs.procs[f"m{VICTIM}"].join(30)
    killed = time.monotonic()
    _check(procs, [SOURCE, RELAY, STOPPED], dict.fromkeys([SOURCE, RELAY, STOPPED], killed), {VICTIM})


def test_the_source_stopped_at_its_commit_decision_then_resumed(procs):
    """The trainer, whose process hosts the mode's store, stops once every engine voted: the engines wait on a store
    that does not answer. Resumed after they gave up on it, it must not commit alone."""
    _run(procs, {SOURCE: ("stop", "commit")})
    stopped = _wait_stopped(procs, f"m{SOURCE}")
    time.sleep(1.25 * LIVENESS + 1.5)
    resumed = procs.signal(f"m{SOURCE}", signal.SIGCONT)
    _check(
        procs,
        [SOURCE, RELAY, VICTIM, STOPPED],
        {SOURCE: resumed, RELAY: stopped, VICTIM: stopped, STOPPED: stopped},
        {SOURCE},
    )
