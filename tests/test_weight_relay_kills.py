"""The last engine of a relay SIGKILLed mid-sync, round after round over a re-formed connected mode: the trainer's
``broadcast_state_dict`` raises :class:`PeerLostError` naming it, every time, within seconds; it never returns as if
every engine had the weights.

A connected mode of 5 members: the 4 ranks of a spawned world (rank 0 the trainer, member 0; ranks 1 to 3 engines that
survive, members 1 to 3) and a victim engine, member 4, a process of its own per round (all started up front, each
waiting for its round). The sync relays (the default over gloo): 0 -> 1 -> 2 -> 3 -> 4, so the victim is the end of the
chain, three hops from the trainer, which sends only to member 1. Each round the victim dies at its point (just after
its first unit's bytes arrived, or after its last one's, before its receipt of the whole transfer; in a delta round
once the delta's bytes all arrived, before it writes them), and the survivors
re-form the mode with the next victim. A last round re-forms the 4 survivors alone and syncs bit-exactly (the oracle:
the digests of the trainer's state from their definition, tests/digest_oracle.py).
"""

from __future__ import annotations

import os
import signal
import time

import torch
from conftest import _world
from digest_oracle import oracles
from victims import Rounds, victim_round
from world import init_world

# (how the survivors call, where the victim dies): each round a sync kind of its own.
ROUNDS = [("plain", "first"), ("async", "last"), ("plain", "last"), ("verify", "first"), ("delta", "apply")]
BOUND = 5.0  # seconds the trainer may take to raise (the group's timeout is 30 s: nobody may wait it out)
MODE = "RELAYKILL"
PREFIX = "relaykills"
VICTIM = 4
BUCKET = 4096


def _state(seed: int) -> dict[str, torch.Tensor]:
    """Pieces that travel in place (two 256 KiB tensors, no bucket receipt) and 16 small ones in buckets of 4 KiB."""
    g = torch.Generator().manual_seed(seed)
    state = {f"big{i}": torch.randn(65536, generator=g) for i in range(2)}
    state.update({f"small{i}": torch.randn(512, generator=g) for i in range(16)})
    return state


def _arm(point: str) -> None:
    """In the victim: die (SIGKILL) once its first unit's bytes have arrived, or its last one's, or (``apply``) once a
    delta's bytes have all arrived, before it writes them."""
    from rlightning_comm.weights.broadcast import _delta, _transport

    if point == "apply":
        _delta.DeltaTransfer._apply = lambda self: os.kill(os.getpid(), signal.SIGKILL)
        return

    original, seen = _transport.Transfer._received, []

    def received(self, unit: int) -> None:
        seen.append(unit)
        if point == "first" or len(seen) == len(self._plan.units):
            os.kill(os.getpid(), signal.SIGKILL)
        original(self, unit)

    _transport.Transfer._received = received


def _call(state, kind: str, source: bool = False):
    from rlightning_comm import broadcast_state_dict

    if kind == "delta":  # a full sync of version 1, then a delta of version 2 (the victim dies writing it)
        broadcast_state_dict(state, MODE, src=0, bucket_bytes=BUCKET, delta=True, version=1)
        if source:
            state["big0"][:64] += 1
        return broadcast_state_dict(state, MODE, src=0, bucket_bytes=BUCKET, delta=True, version=2)
    if kind == "async":
        return broadcast_state_dict(state, MODE, src=0, bucket_bytes=BUCKET, async_op=True).wait()
    return broadcast_state_dict(state, MODE, src=0, bucket_bytes=BUCKET, verify=kind == "verify")


def _victim(address: str, round_: int) -> None:
    """A victim engine: waits for its round, joins the mode as the last member, dies at the round's point."""
    from rlightning_comm import CommContext

    with victim_round(address, PREFIX, round_):
        ctx = CommContext()
        ctx.connect(MODE, rank=VICTIM, world_size=5, address=address, timeout=30)
        kind, point = ROUNDS[round_]
        _arm(point)
        try:
            _call({n: torch.zeros_like(t) for n, t in _state(0).items()}, kind)
        finally:
            ctx.destroy()


def _rounds(rank: int, size: int, url: str) -> dict:
    from rlightning_comm import PeerLostError

    ctx = init_world(rank, size, url)
    out: dict = {"rounds": []}
    with Rounds(ctx, rank, __name__, len(ROUNDS), PREFIX) as rounds:
        for k, (kind, _) in enumerate(ROUNDS):
            rounds.open(k)
            ctx.connect(MODE, rank=rank, world_size=5, address=rounds.address, timeout=30)
            state = _state(k + 1) if rank == 0 else {n: torch.zeros_like(t) for n, t in _state(0).items()}
            start = time.monotonic()
            try:
                report = _call(state, kind, source=rank == 0)
                result = {"type": None, "sent": dict(report.sent)}
            except PeerLostError as err:
                result = {"type": "PeerLostError", "member": err.member, "msg": str(err)}
            except Exception as err:  # noqa: BLE001 - each survivor's outcome goes back to the parent
                result = {"type": type(err).__name__, "msg": str(err)}
            result["elapsed"] = time.monotonic() - start
            out["rounds"].append(result)
            result["victim"] = rounds.close(k)
        # The survivors alone, re-formed once more: a healthy relay of three hops, bit-exact.
        ctx.connect(MODE, rank=rank, world_size=4, address=rounds.address, timeout=30)
        state = _state(99) if rank == 0 else {n: torch.zeros_like(t) for n, t in _state(0).items()}
        report = _call(state, "plain")
        out["final"] = {"digests": oracles(state), "sent": dict(report.sent), "received": dict(report.received)}
    return out


def test_the_trainer_raises_naming_a_dead_end_of_the_chain_in_every_round() -> None:
    results = _world(4).run(_rounds, timeout=400)
    total = sum(t.numel() * 4 for t in _state(0).values())
    for k, (kind, point) in enumerate(ROUNDS):
        source = results[0]["rounds"][k]
        assert source["victim"] == -signal.SIGKILL, (k, source)
        # The trainer never returns as if every engine had the weights: it names the dead member, within seconds.
        assert source["type"] == "PeerLostError" and source["member"] == VICTIM, (k, kind, point, source)
        assert source["elapsed"] < BOUND, (k, source)
        assert "broadcast_state_dict failed midway" in source["msg"] or "did not complete" in source["msg"], source
        for r in (1, 2, 3):
            engine = results[r]["rounds"][k]
            assert engine["type"] == "PeerLostError" and engine["member"] == VICTIM, (k, r, engine)
            assert engine["elapsed"] < BOUND, (k, r, engine)
    expected = oracles(_state(99))
    for r in (1, 2, 3):
        assert results[r]["final"]["digests"] == expected, r
    assert results[0]["final"]["sent"] == {1: total}  # the trainer sends one model's bytes; the engines relay it
    assert [results[r]["final"]["sent"] for r in (1, 2, 3)] == [{2: total}, {3: total}, {}]
