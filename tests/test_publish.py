"""Publish and step on: ``async_op=True`` on both weight-sync calls returns once the source's bytes are captured; the
source changes its tensors at once, publishes the next version while the last one drains (they queue), and every
destination ends each version bit-identical to what the source held when it published it. Errors come from ``wait()``
on every member, as from the blocking call.

The oracle: each version's bytes as the source held them at its publish, kept by the test, broadcast raw with
``torch.distributed.broadcast`` after the sync and compared byte for byte on every destination.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from world import init_world

MODE = "PUBLISH"
VERSIONS = 4


def _model(gen: torch.Generator) -> dict[str, torch.Tensor]:
    emb = torch.randn(256, 64, generator=gen).to(torch.bfloat16)
    return {"emb": emb, "head": emb, "w": torch.randn(128, 96, generator=gen).t(), "b": torch.randn(96, generator=gen)}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(mine: dict[str, torch.Tensor], expected: dict[str, torch.Tensor] | None, rank: int) -> list[str]:
    """The names whose bytes differ from the source's ``expected`` (raw broadcast from rank 0)."""
    wrong = []
    for name in sorted(mine):
        theirs = (_bytes(expected[name]) if rank == 0 else _bytes(mine[name])).clone()
        dist.broadcast(theirs, src=0)
        if rank and not torch.equal(_bytes(mine[name]), theirs):
            wrong.append(name)
    return wrong


def _versions_check(rank: int, size: int, url: str, options: dict) -> list[list[str]]:
    """The same publishes, each version checked on the destinations against the bytes captured at its publish."""
    from rlightning_comm import broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], MODE)
    gen = torch.Generator().manual_seed(5)
    state = _model(gen)
    mine = state if rank == 0 else {n: torch.zeros_like(t) for n, t in state.items()}
    wrong = []
    handles = []
    captured = []
    for version in range(1, VERSIONS + 1):
        if rank == 0:
            handles.append(broadcast_state_dict(mine, MODE, src=0, version=version, async_op=True, **options))
            captured.append({n: t.clone() for n, t in mine.items()})
            with torch.no_grad():
                for t in {id(t): t for t in mine.values()}.values():
                    t.mul_(-1).add_(1)
        else:
            broadcast_state_dict(mine, MODE, src=0, version=version, **options)
        if rank == 0:
            handles[-1].wait()
        wrong.append(_same(mine, captured[-1] if rank == 0 else None, rank))
    return wrong


@pytest.mark.parametrize(
    "options", [{}, {"atomic": True}, {"delta": True}, {"fanout": "star", "verify": True}], ids=str
)
def test_a_broadcast_publish_sends_the_bytes_captured_at_its_call(world4, options) -> None:
    results = world4.run(_versions_check, options, timeout=120)
    for rank, wrong in enumerate(results):
        assert wrong == [[]] * VERSIONS, (rank, wrong)


def _reshard(rank: int, size: int, url: str, options: dict) -> list[dict]:
    from rlightning_comm import TensorSlice, reshard_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], MODE)
    gen = torch.Generator().manual_seed(7)
    full = {"w": torch.randn(32, 24, generator=gen), "v": torch.randn(24, 32, generator=gen).to(torch.float16)}
    out = []
    handles = []
    if rank < 2:  # trainers: row halves
        held = {
            n: TensorSlice(t[16 * rank : 16 * rank + 16].clone(), (16 * rank, 0), tuple(t.shape))
            for n, t in full.items()
        }
    else:  # engines: column halves, in tensors of their own
        e = rank - 2
        wanted = {
            "w": TensorSlice(torch.zeros(32, 12), (0, 12 * e), (32, 24)),
            "v": TensorSlice(torch.zeros(24, 16, dtype=torch.float16), (0, 16 * e), (24, 32)),
        }
    truth = {n: t.clone() for n, t in full.items()}
    for version in range(1, VERSIONS + 1):
        if rank < 2:
            handles.append(reshard_state_dict(held=held, comm_mode=MODE, version=version, async_op=True, **options))
            with torch.no_grad():  # the next version, at once: the publish must send the captured bytes
                for s in held.values():
                    s.tensor.add_(float(version))
        else:
            report = reshard_state_dict(wanted=wanted, comm_mode=MODE, version=version, **options)
            out.append({"kinds": dict(report.kinds), "version": ctx.get_weight_version(MODE)})
        if rank < 2:
            handles[-1].wait()
        # The oracle: the full tensors of this version, built by every rank the same way the trainers changed them.
        if rank >= 2:
            e = rank - 2
            ok = torch.equal(wanted["w"].tensor, truth["w"][:, 12 * e : 12 * e + 12]) and torch.equal(
                wanted["v"].tensor, truth["v"][:, 16 * e : 16 * e + 16]
            )
            out[-1]["exact"] = ok
        for t in truth.values():
            t.add_(float(version))
    return out


@pytest.mark.parametrize("options", [{}, {"atomic": True}, {"delta": True}], ids=str)
def test_a_reshard_publish_sends_the_blocks_captured_at_its_call(world4, options) -> None:
    results = world4.run(_reshard, options, timeout=120)
    for rank in (2, 3):
        for version, row in enumerate(results[rank], start=1):
            assert row["exact"], (rank, version, row)
            assert row["version"] == version, (rank, version, row)


def _queued(rank: int, size: int, url: str) -> dict:
    """Three publishes made back to back, before any destination called: they queue and drain in order; a stale one
    raises from its ``wait()`` on the source as from the blocking call on every destination."""
    from rlightning_comm import CommMismatchError, broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], MODE)
    gen = torch.Generator().manual_seed(9)
    mine = _model(gen) if rank == 0 else {n: torch.zeros_like(t) for n, t in _model(gen).items()}
    out: dict = {}
    if rank == 0:
        captured, handles = [], []
        for version in (1, 2, 3):
            handles.append(broadcast_state_dict(mine, MODE, src=0, version=version, async_op=True))
            captured.append({n: t.clone() for n, t in mine.items()})
            with torch.no_grad():
                mine["b"].add_(1.0)
        reports = [h.wait() for h in handles]
        out["versions"] = [r.version for r in reports]
        stale = broadcast_state_dict(mine, MODE, src=0, version=2, async_op=True)
        try:
            stale.wait()
            out["stale"] = None
        except CommMismatchError as err:
            out["stale"] = str(err)
        out["wrong"] = _same(mine, captured[-1], rank)
    else:
        for version in (1, 2, 3):
            broadcast_state_dict(mine, MODE, src=0, version=version)
        try:
            broadcast_state_dict(mine, MODE, src=0, version=2)
            out["stale"] = None
        except CommMismatchError as err:
            out["stale"] = str(err)
        out["wrong"] = _same(mine, None, rank)
        out["version"] = ctx.get_weight_version(MODE)
    return out


def test_publishes_queue_in_order_and_a_stale_one_raises_from_wait_on_every_member(world4) -> None:
    results = world4.run(_queued, timeout=120)
    assert results[0]["versions"] == [1, 2, 3]
    for rank, out in enumerate(results):
        assert out["stale"] is not None and "version 2" in out["stale"], (rank, out)
        assert out["wrong"] == [], (rank, out)
    assert [r["version"] for r in results[1:]] == [3, 3, 3]


def _any_version(rank: int, size: int, url: str) -> dict:
    """Engines that receive before they know the trainer's version pass ``version="any"``: they take the version the
    trainer names (a publish), record it, and still refuse a stale one; a source may not pass it."""
    from rlightning_comm import CommMismatchError, TensorSlice, reshard_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], MODE)
    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    out: dict = {"versions": [], "exact": []}
    for version in (5, 9):
        if rank < 2:
            held = {"w": TensorSlice(full[32 * rank : 32 * rank + 32] + version, (32 * rank, 0), (64, 8))}
            reshard_state_dict(held=held, comm_mode=MODE, version=version, async_op=True, delta=True).wait()
        else:
            wanted = {"w": TensorSlice(torch.zeros(64, 4), (0, 4 * (rank - 2)), (64, 8))}
            report = reshard_state_dict(wanted=wanted, comm_mode=MODE, version="any", delta=True)
            out["versions"].append((report.version, ctx.get_weight_version(MODE)))
            out["exact"].append(torch.equal(wanted["w"].tensor, (full + version)[:, 4 * (rank - 2) : 4 * (rank - 1)]))
    stale = 7 if rank < 2 else "any"
    held = {"w": TensorSlice(full[32 * rank : 32 * rank + 32], (32 * rank, 0), (64, 8))} if rank < 2 else None
    wanted = {"w": TensorSlice(torch.zeros(64, 4), (0, 4 * (rank - 2)), (64, 8))} if rank >= 2 else None
    try:
        reshard_state_dict(held=held, wanted=wanted, comm_mode=MODE, version=stale)
        out["stale"] = None
    except CommMismatchError as err:
        out["stale"] = str(err)
    try:  # a source passing "any" is refused on every member
        reshard_state_dict(held=held, wanted=wanted, comm_mode=MODE, version="any")
        out["source any"] = None
    except ValueError as err:
        out["source any"] = str(err)
    return out


def test_a_destination_may_take_whichever_version_the_sources_name(world4) -> None:
    results = world4.run(_any_version, timeout=120)
    for rank in (2, 3):
        assert results[rank]["versions"] == [(5, 5), (9, 9)], results[rank]
        assert results[rank]["exact"] == [True, True], results[rank]
    for rank, out in enumerate(results):
        assert out["stale"] is not None and "version 7 refused" in out["stale"], (rank, out["stale"])
        assert out["source any"] is not None and "a source names the version it sends" in out["source any"], out
