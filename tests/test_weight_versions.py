"""Versioned, verified, all-or-nothing weight syncs on one spawned world of 4 ranks (one task, many cases).

Rank 0 is the trainer (the source), ranks 1 to 3 engines: rank 1 and 2 in place, rank 3 through a ``load`` callable. The
oracles are the test's own: each tensor's digest computed from its definition (tests/digest_oracle.py) on the values
each rank holds, and the bytes counted from the tensors' sizes.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from conftest import _world
from digest_oracle import oracles
from world import init_world

BUCKET = 16 * 2**10  # "big" (75 KiB) goes in pieces, the small ones in buckets


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    emb = torch.randn(50, 16, generator=g)
    return {
        "emb": emb,
        "big": torch.randn(300, 64, generator=g),
        "half": torch.randn(33, generator=g).to(torch.bfloat16),
        "count": torch.randint(0, 1000, (7,), generator=g),
        "empty": torch.zeros(0, 4),
        "tied": emb,  # the same tensor as "emb": travels once
    }


def _zeros() -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    out["tied"] = out["emb"]
    return out


def _oracle(state: dict[str, torch.Tensor]) -> dict[str, int]:
    return oracles(state)


def _total() -> int:
    return sum(v.numel() * v.element_size() for k, v in _state(0).items() if k != "tied")


def _outcome(run) -> dict:
    start = time.monotonic()
    try:
        out = run()
    except Exception as err:  # noqa: BLE001 - every member's outcome goes back to the parent
        return {"type": type(err).__name__, "msg": str(err), "elapsed": time.monotonic() - start}
    report = dataclasses.asdict(out) if dataclasses.is_dataclass(out) else out
    return {"type": None, "report": report, "elapsed": time.monotonic() - start}


def _corrupt_once(name: str) -> None:
    """On this rank: flip the first byte of ``name`` as it arrives in a bucket (before it is hashed and unpacked)."""
    from rlightning_comm.weights.broadcast._pipeline import Pipeline

    original = Pipeline._feed

    def feed(self, unit, staged):
        for piece in unit.pieces:
            if self._plan.names[piece.index] == name and staged is not None and not self._is_source:
                staged[piece.at : piece.at + 1].bitwise_xor_(0xFF)
                Pipeline._feed = original  # once
        original(self, unit, staged)

    Pipeline._feed = feed


def _cases(rank: int, size: int, url: str) -> dict:
    from rlightning_comm import broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], "SYNC", timeout=20)
    ctx.init_group([1, 2], "SEED", timeout=20)
    loaded: dict[str, torch.Tensor] = {}

    def load(named) -> None:
        for name, t in named:
            loaded[name] = t.clone()

    live = _state(1) if rank == 0 else _zeros()
    arg = load if rank == 3 else live
    out: dict = {}

    def held() -> dict[str, str]:
        return _oracle(loaded if rank == 3 else live)

    def sync(**kw):
        return broadcast_state_dict(arg, "SYNC", src=0, bucket_bytes=BUCKET, **kw)

    out["plain"] = _outcome(lambda: sync(fanout="star"))
    out["chain"] = _outcome(lambda: sync())  # the default over gloo: a relay through ranks 1 and 2 (rank 3 loads)
    out["chain_held"] = held()
    out["v1"] = _outcome(lambda: sync(version=1, verify=True))
    out["v1_held"], out["v1_version"] = held(), ctx.get_weight_version("SYNC")
    if rank == 0:
        live["big"][3, 5] += 1.0  # one element changed: the next sync's "big" digest changes everywhere
    out["stale"] = _outcome(lambda: sync(version=1, verify=True))
    out["stale_held"] = held()
    out["bad_version"] = _outcome(lambda: sync(version="2" if rank == 1 else 2))
    out["bad_fanout"] = _outcome(lambda: sync(version=2, fanout="ring" if rank == 2 else None))
    out["v2"] = _outcome(lambda: sync(version=2, verify=True))
    out["v2_held"] = held()
    # The same values in other buckets: the same digests.
    out["v3"] = _outcome(lambda: broadcast_state_dict(arg, "SYNC", src=0, bucket_bytes=1024, version=3, verify=True))
    # Atomic, a byte corrupted on its way into rank 2: refused everywhere, every live tensor still version 3.
    if rank == 0:
        live["emb"].mul_(2.0)
    if rank == 2:
        _corrupt_once("emb")
    out["v4_corrupt"] = _outcome(lambda: sync(version=4, atomic=True))
    out["v4_held"], out["v4_version"] = held(), ctx.get_weight_version("SYNC")
    # Atomic, asynchronous: wait() returns the report, and the live tensors are version 4 only then.
    handle = sync(version=4, atomic=True, async_op=True)
    out["v4"] = _outcome(handle.wait)
    out["v4_after"], out["v4_after_version"] = held(), ctx.get_weight_version("SYNC")
    # Verified but not atomic, corrupted on rank 2: refused everywhere, rank 2's record is gone (its bytes are wrong).
    if rank == 0:
        live["half"].add_(1.0)
    if rank == 2:
        _corrupt_once("half")
    out["v5_corrupt"] = _outcome(lambda: sync(version=5, verify=True))
    out["v5_version"] = ctx.get_weight_version("SYNC")
    # Rank 2 seeded from rank 1 (an engine at version 5) over a mode of the two: the trainer is not in it.
    if rank in (1, 2):
        out["seed"] = _outcome(
            lambda: broadcast_state_dict(live, "SEED", src=1, version=5, record_as="SYNC", atomic=True)
        )
        out["seed_held"], out["seed_version"] = held(), ctx.get_weight_version("SYNC")
    # The trainer's next sync brings every engine to version 6.
    if rank == 0:
        live["count"].add_(3)
    out["v6"] = _outcome(lambda: sync(version=6, atomic=True, staging_device="cpu"))
    out["v6_held"], out["v6_version"] = held(), ctx.get_weight_version("SYNC")
    out["source"] = _oracle(live) if rank == 0 else None
    return out


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return _world(4).run(_cases, timeout=120)


def test_every_member_gets_a_report_with_the_bytes_it_moved(cases) -> None:
    total = _total()
    reports = [c["plain"]["report"] for c in cases]
    assert reports[0]["sent"] == {1: total, 2: total, 3: total} and reports[0]["received"] == {}, reports[0]
    for r in reports[1:]:
        assert r["received"] == {0: total} and r["sent"] == {} and r["version"] is None and r["digests"] == {}, r
    assert not reports[0]["plan_cached"] and cases[0]["v1"]["report"]["plan_cached"]


def test_a_relay_sends_each_byte_once_from_the_trainer_and_arrives_bit_identical(cases) -> None:
    total = _total()
    sent = [c["chain"]["report"]["sent"] for c in cases]
    received = [c["chain"]["report"]["received"] for c in cases]
    # Rank 3 passes a load callable (it cannot forward): the source sends to it and to the head of the chain, 1 -> 2.
    assert sent == [{1: total, 3: total}, {2: total}, {}, {}], sent
    assert received == [{}, {0: total}, {1: total}, {0: total}], received
    assert all(c["chain_held"] == cases[0]["chain_held"] for c in cases)
    # Atomic syncs relay through every engine (a load callable's staging forwards too): one model's bytes from rank 0.
    atomic = [c["v4"]["report"] for c in cases]
    assert [a["sent"] for a in atomic] == [{1: total}, {2: total}, {3: total}, {}], atomic


def test_digests_match_an_oracle_and_follow_a_changed_element(cases) -> None:
    for c in cases:
        assert c["v1"]["type"] is None, c["v1"]
        assert c["v1"]["report"]["digests"] == c["v1_held"] == cases[0]["v1_held"]  # the fleet's equal the oracle's
        assert c["v1"]["report"]["version"] == 1
    assert [c["v1_version"] for c in cases] == [None, 1, 1, 1]
    for c in cases:
        before, after = c["v1"]["report"]["digests"], c["v2"]["report"]["digests"]
        assert {k for k in before if before[k] != after[k]} == {"big"}, (before, after)
        assert c["v3"]["report"]["digests"] == after  # other buckets, the same digests


def test_a_stale_version_is_refused_on_every_member_before_anything_moves(cases) -> None:
    for rank, c in enumerate(cases):
        assert c["stale"]["type"] == "CommMismatchError", c["stale"]
        assert "version 1 refused" in c["stale"]["msg"] and all(
            f"rank {r} has committed version 1" in c["stale"]["msg"] for r in (1, 2, 3)
        ), c["stale"]["msg"]
        assert "not committed" not in c["stale"]["msg"], c["stale"]["msg"]  # a refusal says why, not that a sync failed
        if rank:
            assert c["stale_held"] == c["v1_held"]  # untouched, though the source changed
        assert c["bad_version"]["type"] == "TypeError" and "rank 1: version must be an int" in c["bad_version"]["msg"]
        bad = c["bad_fanout"]
        assert bad["type"] == "ValueError" and "rank 2: fanout must be 'star', 'chain' or None" in bad["msg"], bad


def test_an_atomic_sync_with_a_corrupted_byte_commits_nowhere(cases) -> None:
    for c in cases:
        r = c["v4_corrupt"]
        assert r["type"] == "CommMismatchError", r
        assert "rank 2: 2 tensors differ ('emb', 'tied')" in r["msg"], r["msg"]
    for c in cases[1:]:
        assert "version 4 not committed; live weights are version 3" in c["v4_corrupt"]["msg"]
        assert c["v4_held"] == c["v3"]["report"]["digests"] and c["v4_version"] == 3
        assert c["v4"]["type"] is None and c["v4_after"] == cases[0]["v4_after"] and c["v4_after_version"] == 4
    assert "every destination's live weights are unchanged" in cases[0]["v4_corrupt"]["msg"]


def test_a_verified_sync_names_the_tensors_that_differ_and_forgets_the_version(cases) -> None:
    for c in cases:
        assert c["v5_corrupt"]["type"] == "CommMismatchError" and "('half')" in c["v5_corrupt"]["msg"], c["v5_corrupt"]
    assert [c["v5_version"] for c in cases] == [None, 5, None, 5]


def test_a_newcomer_is_seeded_from_a_peer_and_the_next_sync_includes_it(cases) -> None:
    peer, newcomer = cases[1], cases[2]
    total = _total()
    assert peer["seed"]["report"]["sent"] == {2: total} and newcomer["seed"]["report"]["received"] == {1: total}
    assert newcomer["seed_held"] == peer["seed_held"] and newcomer["seed_version"] == 5
    assert "seed" not in cases[0]  # the trainer took no part: it sent nothing
    for c in cases:
        assert c["v6"]["type"] is None, c["v6"]
        assert c["v6_held"] == cases[0]["source"]
    assert [c["v6_version"] for c in cases] == [None, 6, 6, 6]
