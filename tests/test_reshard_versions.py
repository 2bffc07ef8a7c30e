"""Versioned, verified, all-or-nothing reshard_state_dict.

One spawned world of 4 ranks runs the cases: ranks 0 and 1 hold every tensor (data-parallel replicas: each wanted slice
is assembled from pieces of both), rank 1 also wants ``norm`` (a copy within it), ranks 2 and 3 want a half of the rows
of each ``w*`` and the whole ``norm``. Then a connected mode of 5 members with a victim process of its own per round,
SIGKILLed at several points of an atomic reshard. The oracles are the test's own: each slice cut by hand from the full
tensors and its digest computed from the definition (tests/digest_oracle.py).
"""

from __future__ import annotations

import os
import signal
import time

import torch
from conftest import _world
from digest_oracle import oracle
from victims import Rounds, victim_round
from world import init_world

NAMES = [f"w{i}" for i in range(4)]
ROWS, COLS = 12, 8
MODE = "RV"


def _full(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + version)
    out = {n: torch.randn(ROWS, COLS, generator=g) for n in NAMES}
    out["norm"] = torch.randn(COLS, generator=g).to(torch.bfloat16)
    return out


def _rows(part: int, parts: int) -> slice:
    step = ROWS // parts
    return slice(part * step, (part + 1) * step)


def _expected(version: int, part: int, parts: int, names: list[str]) -> dict[str, int]:
    """The digest of each wanted slice of ``version`` (the full tensor zeroed outside it: zeros add nothing)."""
    out = {}
    for n, t in _full(version).items():
        if n not in names:
            continue
        z = torch.zeros_like(t)
        sl = slice(None) if n == "norm" else _rows(part, parts)
        z[sl] = t[sl]
        out[n] = oracle(z)
    return out


def _outcome(run) -> dict:
    start = time.monotonic()
    try:
        report = run()
    except Exception as err:  # noqa: BLE001 - every member's outcome goes back to the parent
        return {"type": type(err).__name__, "msg": str(err), "elapsed": time.monotonic() - start}
    return {
        "type": None,
        "version": report.version,
        "digests": dict(report.digests),
        "sent": dict(report.sent),
        "elapsed": time.monotonic() - start,
    }


def _corrupt_once(name: str) -> None:
    """On this rank: flip a byte of ``name`` in its bucket before it is unpacked."""
    from rlightning_comm.weights.reshard._mover import Mover

    original = Mover._pack

    def pack(self, bucket, buffer, pack):
        if not pack:
            for p in bucket.pieces:
                if p.name == name:
                    buffer[p.at : p.at + 1].bitwise_xor_(0x40)
                    Mover._pack = original
                    break
        original(self, bucket, buffer, pack)

    Mover._pack = pack


def _cases(rank: int, size: int, url: str) -> dict:
    from rlightning_comm import reshard_state_dict
    from rlightning_comm.weights import TensorSlice

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], MODE, timeout=20)
    live = {n: torch.full((ROWS // 2, COLS), -1.0) for n in NAMES}
    live["norm"] = torch.zeros(COLS, dtype=torch.bfloat16)
    wants = {2: NAMES + ["norm"], 3: NAMES + ["norm"], 1: ["norm"]}.get(rank, [])
    wanted = {}
    for n in wants:
        if n == "norm":
            wanted[n] = TensorSlice(tensor=live[n], offsets=(0,), global_shape=(COLS,))
        else:
            wanted[n] = TensorSlice(tensor=live[n], offsets=(_rows(rank - 2, 2).start, 0), global_shape=(ROWS, COLS))
    part = max(rank - 2, 0)

    def sync(version: int, **kw):
        held = _full(version) if rank < 2 else None
        return reshard_state_dict(held=held, wanted=wanted or None, comm_mode=MODE, version=version, **kw)

    def held() -> dict[str, int]:
        out = {}
        for n in wants:
            z = torch.zeros((ROWS, COLS)) if n != "norm" else torch.zeros(COLS, dtype=torch.bfloat16)
            if n == "norm":
                z[:] = live[n]
            else:
                z[_rows(part, 2)] = live[n]
            out[n] = oracle(z)
        return out

    out: dict = {"expected": {v: _expected(v, part, 2, wants) for v in (1, 2, 3, 4)}}
    out["v1"] = _outcome(lambda: sync(1, verify=True))
    out["v1_held"], out["v1_version"] = held(), ctx.get_weight_version(MODE)
    out["stale"] = _outcome(lambda: sync(1))
    out["stale_held"] = held()
    if rank == 3:
        _corrupt_once("w1")
    out["v2"] = _outcome(lambda: sync(2, verify=True))
    out["v2_version"] = ctx.get_weight_version(MODE)
    out["v3"] = _outcome(lambda: sync(3, atomic=True))
    out["v3_held"], out["v3_version"] = held(), ctx.get_weight_version(MODE)
    if rank == 2:
        _corrupt_once("w2")
    out["v4"] = _outcome(lambda: sync(4, atomic=True))
    out["v4_held"], out["v4_version"] = held(), ctx.get_weight_version(MODE)
    return out


def test_reshard_versions_verify_and_atomic_on_every_member() -> None:
    cases = _world(4).run(_cases, timeout=200)
    # Version 1, verified: every destination holds the oracle's slices, reports their digests and records version 1.
    for rank, c in enumerate(cases):
        assert c["v1"]["type"] is None, (rank, c["v1"])
        assert c["v1"]["version"] == 1
        assert c["v1"]["digests"] == c["v1_held"] == c["expected"][1], rank
    assert [c["v1_version"] for c in cases] == [None, 1, 1, 1]
    assert cases[2]["v1"]["digests"]["norm"] == cases[3]["v1"]["digests"]["norm"] == cases[1]["v1"]["digests"]["norm"]
    assert cases[2]["v1"]["digests"]["w0"] != cases[3]["v1"]["digests"]["w0"]  # different halves
    assert cases[0]["v1"]["sent"] and cases[1]["v1"]["sent"]  # both replicas send: slices assembled from both
    # A stale version: refused on every member before any byte moves, destinations untouched.
    for rank, c in enumerate(cases):
        msg = c["stale"]["msg"]
        assert c["stale"]["type"] == "CommMismatchError", (rank, c["stale"])
        assert "version 1 refused" in msg and all(f"rank {r} has committed version 1" in msg for r in (1, 2, 3)), msg
        assert "not committed" not in msg, msg  # a refusal says why, not that a sync failed
        assert c["stale_held"] == c["v1_held"], rank
    # Verified, not atomic, a byte corrupted on rank 3: every member names the tensor; rank 3 forgets its version.
    for rank, c in enumerate(cases):
        assert c["v2"]["type"] == "CommMismatchError", (rank, c["v2"])
        assert "rank 3: 1 tensors differ ('w1')" in c["v2"]["msg"], c["v2"]["msg"]
    assert [c["v2_version"] for c in cases] == [None, 2, 2, None]
    # Atomic, clean: every destination on version 3, by digest.
    for rank, c in enumerate(cases):
        assert c["v3"]["type"] is None, (rank, c["v3"])
        assert c["v3_held"] == c["expected"][3] == c["v3"]["digests"], rank
    assert [c["v3_version"] for c in cases] == [None, 3, 3, 3]
    # Atomic, a byte corrupted on rank 2: committed nowhere, every live slice bit-identical to version 3.
    for rank, c in enumerate(cases):
        assert c["v4"]["type"] == "CommMismatchError", (rank, c["v4"])
        assert "rank 2: 1 tensors differ ('w2')" in c["v4"]["msg"], c["v4"]["msg"]
        assert c["v4_held"] == c["expected"][3] and c["v4_version"] == c["v3_version"], rank
    for c in cases[1:]:
        assert "version 4 not committed; live weights are version 3" in c["v4"]["msg"], c["v4"]["msg"]


# ----------------------------------------------------------------------------------- kills
POINTS = ["handshake", "data", "staged", "voted", "decided"]
ABORTED = {"handshake", "data", "staged"}  # before the commit point: the previous version everywhere
COMMITTED = {"decided"}  # after it: the new version on every survivor
KILL_MODE = "RVKILL"
VICTIM = 2
MEMBER = [0, 1, 3, 4]  # the world's ranks' members of the mode; member 2 is the victim
WANTERS = 3  # members 2, 3, 4 want a third of the rows each
BOUND = 10.0


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str) -> None:
    from rlightning_comm.weights.commit import _sync as _commit
    from rlightning_comm.weights.reshard import _call as _reshard
    from rlightning_comm.weights.reshard import _mover

    if point == "handshake":
        _reshard._agree = lambda *a, **k: _die()
    elif point == "data":
        original, seen = _mover.Mover._pack, []

        def pack(self, bucket, buffer, pack):
            if not pack:
                seen.append(1)
                if len(seen) == 2:
                    _die()
            return original(self, bucket, buffer, pack)

        _mover.Mover._pack = pack
    elif point == "staged":
        _commit.Sync._settle = lambda self, *args: _die()
    elif point == "voted":
        _commit.Sync._await_decision = lambda self: _die()
    elif point == "decided":
        _commit.Sync._apply = lambda self: _die()


def _kill_wanted(member: int, live: dict[str, torch.Tensor]) -> dict:
    from rlightning_comm.weights import TensorSlice

    rows = _rows(member - 2, WANTERS)
    return {n: TensorSlice(tensor=live[n], offsets=(rows.start, 0), global_shape=(ROWS, COLS)) for n in NAMES}


def _kill_sync(member: int, version: int, live: dict | None) -> object:
    from rlightning_comm import reshard_state_dict

    held = {n: t for n, t in _full(version).items() if n != "norm"} if member < 2 else None
    wanted = _kill_wanted(member, live) if live is not None else None
    return reshard_state_dict(
        held=held, wanted=wanted, comm_mode=KILL_MODE, version=version, atomic=True, bucket_bytes=256
    )


def _victim(address: str, round_: int) -> None:
    from rlightning_comm import CommContext

    with victim_round(address, "rvkills", round_):
        ctx = CommContext()
        ctx.connect(KILL_MODE, rank=VICTIM, world_size=5, address=address, timeout=30)
        _arm(POINTS[round_])
        live = {n: torch.zeros(ROWS // WANTERS, COLS) for n in NAMES}
        try:
            _kill_sync(VICTIM, round_ + 1, live)
        finally:
            ctx.destroy()


def _kill_rounds(rank: int, size: int, url: str) -> list[dict]:
    ctx = init_world(rank, size, url)
    member = MEMBER[rank]
    live = {n: torch.zeros(ROWS // WANTERS, COLS) for n in NAMES} if member >= 2 else None
    out = []
    with Rounds(ctx, rank, __name__, len(POINTS), "rvkills") as rounds:
        for k in range(len(POINTS)):
            rounds.open(k)
            ctx.connect(KILL_MODE, rank=member, world_size=5, address=rounds.address, timeout=30)
            start = time.monotonic()
            try:
                _kill_sync(member, k + 1, live)
                result = {"type": None}
            except Exception as err:  # noqa: BLE001 - each survivor's outcome goes back to the parent
                result = {"type": type(err).__name__, "msg": str(err)}
            held = {n: oracle(t) for n, t in live.items()} if live is not None else None
            result.update(elapsed=time.monotonic() - start, held=held, version=ctx.get_weight_version(KILL_MODE))
            out.append(result)
            result["victim"] = rounds.close(k)
    return out


def test_an_atomic_reshard_with_a_member_killed_leaves_survivors_on_one_version() -> None:
    results = _world(4).run(_kill_rounds, timeout=400)

    def slice_digests(version: int, member: int) -> dict[str, int]:
        rows = _rows(member - 2, WANTERS)
        return {n: oracle(t[rows].clone()) for n, t in _full(version).items() if n != "norm"}

    committed = {m: {n: oracle(torch.zeros(ROWS // WANTERS, COLS)) for n in NAMES} for m in (3, 4)}
    version = None
    for k, point in enumerate(POINTS):
        engines = {m: results[r][k] for r, m in ((2, 3), (3, 4))}
        assert results[0][k]["victim"] == -signal.SIGKILL, (point, results[0][k])
        for r in range(4):
            assert results[r][k]["elapsed"] < BOUND, (point, results[r][k])
        new = {m: slice_digests(k + 1, m) for m in engines}
        if all(e["held"] == new[m] for m, e in engines.items()):
            assert point not in ABORTED, point
            assert all(e["type"] is None and e["version"] == k + 1 for e in engines.values()), (point, engines)
            committed, version = new, k + 1
        else:
            assert point not in COMMITTED, (point, engines)
            before = "no committed version" if version is None else f"version {version}"
            for m, e in engines.items():
                assert e["held"] == committed[m], (point, m)  # bit-identical to the previous version: never a mix
                assert e["version"] == version and e["type"] is not None, (point, e)
                assert f"version {k + 1} not committed; live weights are {before}" in e["msg"], (point, e["msg"])
            for r in (0, 1):
                assert results[r][k]["type"] is not None and f"version {k + 1} not committed" in results[r][k]["msg"]
