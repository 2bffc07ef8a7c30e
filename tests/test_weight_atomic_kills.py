"""An atomic sync whose destination is SIGKILLed at six points: every survivor ends on one version, never a mix.

A connected mode of 5 members: the 4 ranks of a spawned world (rank 0 the trainer, member 0; ranks 1 to 3 engines that
survive, members 1, 3 and 4) and a victim engine, member 2, a process of its own per round (started up front, each
waiting for its round). The sync relays (the default over gloo): 0 -> 1 -> 2 -> 3 -> 4, so the victim is a relay with
two engines downstream of it. Round ``k`` syncs version ``k + 1`` atomically and the victim dies at its point; the
survivors re-form the mode with the next victim. The oracle is the test's: the digest of each tensor of the state the
trainer sent, from its definition (tests/digest_oracle.py).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import torch
from conftest import _world
from digest_oracle import oracles
from victims import Rounds, victim_round
from world import init_world

POINTS = ["none", "handshake", "data", "staged", "voted", "decided", "applying"]
ABORTED = {"handshake", "data", "staged"}  # before the commit point: the previous version everywhere
COMMITTED = {"none", "decided", "applying"}  # after it: the new version on every survivor
TENSORS, ELEMENTS, BUCKET = 24, 512, 4096
BOUND = 10.0  # seconds any member's call may take on this loaded 2-core machine (the group's timeout is 30 s)
MODE = "ATOMIC"
VICTIM = 2
MEMBER = [0, 1, 3, 4]  # the world's ranks' members of the mode


def _state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {f"w{i}": torch.randn(ELEMENTS, generator=g) for i in range(TENSORS)}


def _oracle(state: dict[str, torch.Tensor]) -> dict[str, int]:
    return oracles(state)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str) -> None:
    """In the victim: die at ``point`` of its next sync."""
    from rlightning_comm.weights.broadcast import _call as _broadcast
    from rlightning_comm.weights.broadcast import _pipeline
    from rlightning_comm.weights.commit import _sync as _commit

    if point == "handshake":
        _broadcast.agree = lambda *a, **k: _die()
    elif point == "data":
        original, seen = _pipeline.Pipeline._complete, []

        def complete(self, entry):
            seen.append(1)
            if len(seen) == 3:
                _die()
            return original(self, entry)

        _pipeline.Pipeline._complete = complete
    elif point == "staged":
        _commit.Sync._settle = lambda self, *args: _die()
    elif point == "voted":
        _commit.Sync._await_decision = lambda self: _die()
    elif point == "decided":
        _commit.Sync._apply = lambda self: _die()
    elif point == "applying":

        def apply(self):
            live, staged = self._live
            for t, new in list(zip(live, staged))[: len(live) // 2]:
                t.copy_(new)
            _die()

        _commit.Sync._apply = apply


def _victim(address: str, round_: int) -> None:
    """A victim engine: waits for its round, joins the mode as member 2, dies at the round's point."""
    from rlightning_comm import CommContext, broadcast_state_dict

    with victim_round(address, "kills", round_):
        ctx = CommContext()
        ctx.connect(MODE, rank=VICTIM, world_size=5, address=address, timeout=30)
        _arm(POINTS[round_])
        try:
            broadcast_state_dict(_state(0), MODE, src=0, bucket_bytes=BUCKET, version=round_ + 1, atomic=True)
        finally:
            ctx.destroy()


def _rounds(rank: int, size: int, url: str) -> list[dict]:
    from rlightning_comm import broadcast_state_dict

    ctx = init_world(rank, size, url)
    out = []
    with Rounds(ctx, rank, __name__, len(POINTS), "kills") as rounds:
        live = _state(0)
        for k in range(len(POINTS)):
            rounds.open(k)
            ctx.connect(MODE, rank=MEMBER[rank], world_size=5, address=rounds.address, timeout=30)
            state = _state(k + 1) if rank == 0 else live
            start = time.monotonic()
            try:
                report = broadcast_state_dict(state, MODE, src=0, bucket_bytes=BUCKET, version=k + 1, atomic=True)
                result = {"type": None}
            except Exception as err:  # noqa: BLE001 - each survivor's outcome goes back to the parent
                result = {"type": type(err).__name__, "msg": str(err)}
            result.update(elapsed=time.monotonic() - start, held=_oracle(live), version=ctx.get_weight_version(MODE))
            if result["type"] is None:
                result["report"] = dataclasses.asdict(report)
            out.append(result)
            result["victim"] = rounds.close(k)  # every survivor is done with round k before its victim may go
    return out


def test_a_destination_killed_at_any_point_leaves_every_survivor_on_one_version() -> None:
    results = _world(4).run(_rounds, timeout=400)
    committed = _oracle(_state(0))  # the engines start on the zeroth state, never committed (no version)
    version = None
    for k, point in enumerate(POINTS):
        engines = [results[r][k] for r in (1, 2, 3)]
        source = results[0][k]
        expected = -signal.SIGKILL if point != "none" else 0
        assert source["victim"] == expected, (point, source)
        for r in [source, *engines]:
            assert r["elapsed"] < BOUND, (point, r)
        helds = {tuple(sorted(e["held"].items())) for e in engines}
        assert len(helds) == 1, f"{point}: the survivors hold different weights"  # never a mix
        held = engines[0]["held"]
        new = _oracle(_state(k + 1))
        if held == new:
            assert point not in ABORTED, point
            assert all(e["type"] is None and e["version"] == k + 1 for e in engines), (point, engines)
            committed, version = new, k + 1
        else:
            assert point not in COMMITTED, (point, engines)
            assert held == committed, point  # bit-identical to the previous version
            before = "no committed version" if version is None else f"version {version}"
            for e in [*engines]:
                assert e["version"] == version and e["type"] is not None, (point, e)
                assert f"version {k + 1} not committed; live weights are {before}" in e["msg"], (point, e["msg"])
            assert source["type"] is not None and f"version {k + 1} not committed" in source["msg"], source
    total = TENSORS * ELEMENTS * 4
    assert results[0][0]["report"]["sent"] == {1: total}  # the trainer sends one model's bytes; the engines relay
    assert [results[r][0]["report"]["sent"] for r in (1, 2, 3)] == [{2: total}, {4: total}, {}]
