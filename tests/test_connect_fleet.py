"""A connected fleet that grows and shrinks: every member calls ``connect`` again with the new world size, in whatever
order, and the next versioned sync reaches every engine bit for bit; a real mismatch still fails every member at once.

The members are forked from a server that imported torch once (``test_connect_hardening``'s ``_Procs``) and driven by
the test through their pipes: it sends each command (listen, connect, seed, sync, barrier) when the case's order says,
and holds that order by what it observes: the arrivals counted in rank 0's store, and the newcomer's word that it was
judged against the generation formed without it (which it then waits out). Oracles: the trainer's own tensors (a SHA-256
of their bytes), the versions every engine recorded, the generation numbers, and one error message on every member.
"""

from __future__ import annotations

import hashlib
import time

import pytest
import torch
from test_connect_hardening import SLACK, _Procs, _store, _wait_arrivals

from rlightning_comm import CommContext, CommError, broadcast_state_dict, collective

MODE = "WEIGHT_SYNC"
TRAINER, A, B, C, NEWCOMER = "trainer", "engine-a", "engine-b", "engine-c", "newcomer"


def _model(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {"embed": torch.randn(64, 32, generator=gen).to(torch.bfloat16)}
    for i in range(4):
        state[f"layer{i}.w"] = torch.randn(96, 96, generator=gen)
        state[f"layer{i}.b"] = torch.randn(96, generator=gen)
    state["steps"] = torch.tensor([seed], dtype=torch.int64)
    return state


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------- a member
def _member(out, role: str) -> None:
    """A member of the fleet: runs the commands the test sends, one at a time, and sends back each outcome."""
    from rlightning_comm.connect import _connection

    judge = _connection.judge_late

    def judge_late(store, opening, verdict, info, *args):
        out.send(("judged", role, verdict["generation"]))  # a generation formed without this process
        return judge(store, opening, verdict, info, *args)

    _connection.judge_late = judge_late
    ctx = CommContext()
    model = {name: torch.zeros_like(t) for name, t in _model(0).items()}
    while True:
        command, *args = out.recv()
        if command == "listen":
            out.send(("address", role, ctx.listen("127.0.0.1:0")))
        elif command == "connect":
            mode, rank, world_size, address = args
            try:
                ctx.connect(mode, rank=rank, world_size=world_size, address=address, timeout=60, connect_timeout=30)
                outcome: tuple = ("formed", ctx.get_generation(mode))
            except CommError as err:
                outcome = (type(err).__name__, str(err))
            out.send(("connected", role, outcome, time.monotonic()))
        elif command == "sync":  # the trainer (the source, with new weights) or an engine
            src, version, seed = args
            if seed is not None:
                model = _model(seed)
            broadcast_state_dict(model, MODE, src=src, version=version)
            out.send(("synced", role, _digest(model), ctx.get_weight_version(MODE), ctx.get_generation(MODE)))
        elif command == "seed":  # docs/weight-sync.md, "Seeding a newcomer": a peer engine is member 0 of "SEED"
            member, address = args
            ctx.connect("SEED", rank=member, world_size=2, address=address, timeout=60)
            box = [ctx.get_weight_version(MODE) if member == 0 else None]
            collective.broadcast_object_list(box, "SEED", src=0)
            broadcast_state_dict(model, "SEED", src=0, version=box[0], record_as=MODE, atomic=True)
            out.send(("seeded", role, _digest(model), ctx.get_weight_version(MODE)))
        elif command == "barrier":
            try:
                ctx.get_communicator(MODE).barrier()
                outcome = ("ok",)
            except CommError as err:
                outcome = (type(err).__name__, str(err))
            out.send(("barrier", role, outcome))


# ---------------------------------------------------------------------- the driver
class _Fleet:
    """The members, by role, with the rank and the world size each holds now."""

    def __init__(self, procs: _Procs) -> None:
        self.procs = procs
        self.judged: dict[str, list[int]] = {}  # role -> generations it was judged against, formed without it
        self.address = ""

    def start(self, *roles: str) -> None:
        for role in roles:
            self.procs.start(role, _member, role)

    def send(self, role: str, *command) -> None:
        self.procs.pipes[role].send(command)

    def next(self, role: str, kind: str, timeout: float = 60) -> tuple:
        """The next message of ``kind`` from ``role`` (its reports of being judged late are set aside)."""
        pipe = self.procs.pipes[role]
        deadline = time.monotonic() + timeout
        while True:
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                pytest.fail(f"{role}: no {kind!r} message within {timeout} s")
            message = pipe.recv()
            if message[0] == "failed":
                pytest.fail(f"{role} failed:\n{message[2]}")
            if message[0] == "judged":
                self.judged.setdefault(role, []).append(message[2])
                continue
            assert message[0] == kind, (role, message)
            return message

    def wait_judged(self, role: str, timeout: float = 30) -> None:
        """Wait until ``role`` reported that it was judged against a generation formed without it."""
        pipe = self.procs.pipes[role]
        deadline = time.monotonic() + timeout
        while role not in self.judged:
            assert pipe.poll(max(0.0, deadline - time.monotonic())), f"{role} was not judged within {timeout} s"
            message = pipe.recv()
            if message[0] == "failed":
                pytest.fail(f"{role} failed:\n{message[2]}")
            assert message[0] == "judged", (role, message)
            self.judged.setdefault(role, []).append(message[2])

    def connect(self, members: dict[str, int], world_size: int) -> None:
        for role, rank in members.items():
            self.send(role, "connect", MODE, rank, world_size, self.address)

    def outcomes(self, roles) -> dict[str, tuple]:
        return {role: self.next(role, "connected")[2:] for role in roles}

    def sync(self, roles, version: int, seed: int) -> None:
        """A versioned sync from the trainer (rank 0): every engine ends with the trainer's bytes and the version."""
        for role in roles:
            self.send(role, "sync", 0, version, seed if role == TRAINER else None)
        got = {role: self.next(role, "synced")[2:] for role in roles}
        digest, _, generation = got[TRAINER]
        for role, (theirs, recorded, gen) in got.items():
            assert theirs == digest, f"{role} does not hold the trainer's tensors after version {version}"
            assert gen == generation and (role == TRAINER or recorded == version), (role, recorded, gen, got)

    def form(self, members: dict[str, int]) -> None:
        """Generation 0 of ``members`` (role -> rank; the trainer is rank 0 and hosts the store), and version 1."""
        self.start(*members)
        self.send(TRAINER, "listen")
        self.address = self.next(TRAINER, "address")[2]
        self.connect(members, len(members))
        assert all(o[0] == ("formed", 0) for o in self.outcomes(members).values())
        self.sync(members, version=1, seed=1)

    def seed_newcomer(self) -> None:
        """The newcomer gets engine A's weights and version over a mode of the two (the weight-sync guide's way)."""
        self.start(NEWCOMER)
        self.send(A, "listen")
        seed_address = self.next(A, "address")[2]
        self.send(A, "seed", 0, seed_address)
        self.send(NEWCOMER, "seed", 1, seed_address)
        (a_digest, a_version), (n_digest, n_version) = (self.next(r, "seeded")[2:] for r in (A, NEWCOMER))
        assert (n_digest, n_version) == (a_digest, a_version) and a_version is not None


@pytest.fixture
def fleet():
    procs = _Procs()
    yield _Fleet(procs)
    procs.close()


def _formed_together(outcomes: dict[str, tuple], sent: float, generation: int) -> None:
    """Every member formed ``generation``, within a bound of the last connect sent (nobody waited out a timeout)."""
    assert {role: o[0] for role, o in outcomes.items()} == dict.fromkeys(outcomes, ("formed", generation)), outcomes
    late = max(when for _, when in outcomes.values()) - sent
    assert late < SLACK, f"the last member formed {late:.1f} s after the last connect (connect_timeout 30 s)"


# ---------------------------------------------------------------------- growing
GROWN = {TRAINER: 0, A: 1, B: 2, NEWCOMER: 3}


@pytest.mark.parametrize("order", ["newcomer-first", "newcomer-middle", "newcomer-last", "at-once"])
def test_an_engine_added_to_a_healthy_fleet_joins_whatever_the_order(fleet, order):
    fleet.form({TRAINER: 0, A: 1, B: 2})
    fleet.seed_newcomer()
    store = _store(fleet.address)
    if order == "newcomer-first":  # judged against generation 0, it waits; meanwhile generation 0 goes on as before
        fleet.connect({NEWCOMER: 3}, 4)
        fleet.wait_judged(NEWCOMER)
        fleet.sync([TRAINER, A, B], version=2, seed=2)
        fleet.connect({A: 1, B: 2, TRAINER: 0}, 4)  # rank 0 last
    elif order == "newcomer-middle":  # after engine A left generation 0, before rank 0 opened the next one
        fleet.connect({A: 1}, 4)
        fleet.connect({NEWCOMER: 3}, 4)
        fleet.wait_judged(NEWCOMER)
        fleet.connect({TRAINER: 0}, 4)
        _wait_arrivals(store, 1, 3)  # rank 0, engine A, the newcomer
        fleet.connect({B: 2}, 4)
    elif order == "newcomer-last":  # rank 0 first: the newcomer finds the next generation forming
        fleet.connect({TRAINER: 0, A: 1, B: 2}, 4)
        _wait_arrivals(store, 1, 3)
        fleet.connect({NEWCOMER: 3}, 4)
    else:  # all at once, the newcomer's call sent first
        fleet.connect({NEWCOMER: 3, A: 1, B: 2, TRAINER: 0}, 4)
    sent = time.monotonic()
    _formed_together(fleet.outcomes(GROWN), sent, generation=1)
    if order in ("newcomer-first", "newcomer-middle"):
        assert fleet.judged == {NEWCOMER: [0]}, fleet.judged
    elif order == "newcomer-last":
        assert fleet.judged == {}, fleet.judged
    fleet.sync(GROWN, version=3, seed=3)


# ---------------------------------------------------------------------- shrinking
@pytest.mark.parametrize("rank0", ["first", "last"])
def test_a_fleet_shrinks_when_an_engine_stops_calling(fleet, rank0):
    fleet.form({TRAINER: 0, A: 1, B: 2, C: 3})
    stays = {TRAINER: 0, A: 1, B: 2} if rank0 == "first" else {A: 1, B: 2, TRAINER: 0}
    fleet.connect(stays, 3)  # engine C stops calling
    sent = time.monotonic()
    _formed_together(fleet.outcomes(stays), sent, generation=1)
    fleet.sync(stays, version=2, seed=2)
    fleet.send(C, "barrier")  # the generation it was in is over: its calls are refused
    outcome = fleet.next(C, "barrier")[2]
    assert outcome[0] == "PeerLostError" and "generation 0" in outcome[1], outcome


# ---------------------------------------------------------------------- real mismatches
@pytest.mark.parametrize("mistake", ["world_size", "duplicate-rank"])
def test_a_real_mismatch_in_the_grown_generation_fails_every_member_with_one_error(fleet, mistake):
    """Engine B was not told the fleet grows (it passes world_size 3), or the newcomer claims B's rank: the newcomer,
    judged against generation 0 first, waits for the next one, and there every member raises the same error at once."""
    fleet.form({TRAINER: 0, A: 1, B: 2})
    fleet.start(NEWCOMER)
    newcomer_rank = 2 if mistake == "duplicate-rank" else 3
    fleet.connect({NEWCOMER: newcomer_rank}, 4)
    fleet.wait_judged(NEWCOMER)
    fleet.connect({A: 1}, 4)
    fleet.connect({B: 2}, 3 if mistake == "world_size" else 4)
    fleet.connect({TRAINER: 0}, 4)
    sent = time.monotonic()
    outcomes = fleet.outcomes([TRAINER, A, B, NEWCOMER])
    messages = {o[0][1] for o in outcomes.values()}
    assert {o[0][0] for o in outcomes.values()} == {"CommMismatchError"} and len(messages) == 1, outcomes
    (message,) = messages
    if mistake == "world_size":
        assert "world_size differs: 4 on rank 0" in message and "3 on rank 2" in message, message
    else:
        assert "rank 2 is claimed 2 times" in message and "no process claimed ranks [3]" in message, message
    late = max(when for _, when in outcomes.values()) - sent
    assert late < SLACK, f"a member raised {late:.1f} s after the last connect"
