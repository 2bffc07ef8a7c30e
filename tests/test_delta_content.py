"""A delta applies only onto bytes proven, by content, to be its base: whatever touched a destination between two syncs,
the sync that returns leaves it bit-identical to its source, on both calls, with and without ``atomic``.

Each of 8 versions is preceded by a disturbance of the destinations that no address, layout or torch version counter
reveals: a raw ``torch.distributed.broadcast`` into a weight (gloo receives move no version counter), the library's own
plain sync and ``collective.broadcast`` on another mode, an in-place op under ``torch.inference_mode`` on inference
tensors (which keep no version counter), fresh tensors each update (the allocator may hand back the same address), a
write through ``.data`` and one through numpy (neither counted by torch). The oracle is raw torch.distributed: after
each sync the source broadcasts its bytes and every destination compares. A failed delta leaves no sticky base: a
corrupted write makes the verified sync raise on every member, saying that the next one is full, and the next one is
exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from world import init_world

MODE = "DCONTENT"
OTHER = "DOTHER"
NAMES = ("w0", "w1", "b", "emb")
# The disturbance before each version (version 1 is the first sync; the last one disturbs nothing).
DISTURBANCES = ("none", "raw broadcast", "plain sync", "collective", "inference mode", "fresh tensors", "data", "numpy")
LAST = "after a quiet step"


def _source(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "w0": torch.randn(96, 64, generator=gen),
        "w1": torch.randn(64, 96, generator=gen),
        "b": torch.randn(96, generator=gen),
        "emb": torch.randn(128, 32, generator=gen).to(torch.bfloat16),
    }


def _zeros(like: dict[str, torch.Tensor], inference: bool) -> dict[str, torch.Tensor]:
    if inference:
        with torch.inference_mode():
            return {n: torch.zeros_like(t) for n, t in like.items()}
    return {n: torch.zeros_like(t) for n, t in like.items()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _wrong(mine: dict[str, torch.Tensor], rank: int) -> list[str]:
    """The names whose bytes differ from the source's, by raw ``torch.distributed.broadcast`` of the source's bytes."""
    wrong = []
    for name in NAMES:
        theirs = _bytes(mine[name]).clone()
        dist.broadcast(theirs, src=0)
        if rank and not torch.equal(_bytes(mine[name]), theirs):
            wrong.append(name)
    return wrong


def _disturb(kind: str, rank: int, mine: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Apply ``kind`` to the destinations' tensors (every rank takes part in the collectives); the tensors to sync."""
    from rlightning_comm import broadcast_state_dict, collective

    noise = {n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in mine.items()}
    if kind == "raw broadcast":  # gloo receives move no version counter
        target = noise["w0"] if rank == 0 else mine["w0"]
        dist.broadcast(target, src=0)
    elif kind == "plain sync":  # the library's own full sync on another mode, into the same tensors
        broadcast_state_dict(noise if rank == 0 else mine, OTHER, src=0)
    elif kind == "collective":
        collective.broadcast(noise["w1"] if rank == 0 else mine["w1"], OTHER, src=0)
    elif kind == "inference mode" and rank:
        with torch.inference_mode():  # rank 3's tensors are inference tensors: no version counter at all
            mine["w0"].mul_(2)
            mine["b"].add_(1)
    elif kind == "fresh tensors" and rank:
        like = {n: t.clone() for n, t in mine.items()}
        inference = mine["w0"].is_inference()
        mine = None  # freed first: the allocator may hand the same addresses back
        mine = _zeros(like, inference)
    elif kind == "data" and rank:
        mine["w1"].data.add_(1)  # a tensor of its own version counter: the write is not counted on w1
    elif kind == "numpy" and rank:
        mine["emb"].view(torch.int16).numpy()[:3] ^= 1  # numpy's writes are not torch's
    return mine


def _sync(call: str, rank: int, mine: dict[str, torch.Tensor], version: int, **options):
    from rlightning_comm import broadcast_state_dict, reshard_state_dict

    if call == "broadcast":
        return broadcast_state_dict(mine, MODE, src=0, delta=True, version=version, **options)
    if rank == 0:
        return reshard_state_dict(held=mine, comm_mode=MODE, delta=True, version=version, **options)
    return reshard_state_dict(wanted=mine, comm_mode=MODE, delta=True, version=version, **options)


def _versions(rank: int, size: int, url: str, call: str, atomic: bool) -> list[dict]:
    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], MODE)
    ctx.init_group([0, 1, 2, 3], OTHER)
    gen = torch.Generator().manual_seed(11)
    source = _source(gen)
    mine = source if rank == 0 else _zeros(source, inference=rank == 3)
    noise = torch.Generator().manual_seed(100 + rank)
    out = []
    for version, kind in enumerate((*DISTURBANCES, LAST), start=1):
        if rank == 0:  # 2% of the elements change each version
            for t in source.values():
                flat = t.view(-1)
                flat[torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 50)]] += 1
        if kind not in ("none", LAST) and version > 1:
            mine = _disturb(kind, rank, mine, noise)
        try:
            report = _sync(call, rank, mine, version, atomic=atomic)
            row = {"error": None, "kinds": dict(report.kinds), "delivered": dict(report.delivered)}
        except Exception as err:  # noqa: BLE001 - every member's outcome goes back to the parent
            row = {"error": f"{type(err).__name__}: {err}"}
        row.update(kind=kind, wrong=_wrong(mine, rank), version=ctx.get_weight_version(MODE))
        out.append(row)
    return out


@pytest.mark.parametrize("atomic", [False, True], ids=["plain", "atomic"])
@pytest.mark.parametrize("call", ["broadcast", "reshard"])
def test_every_sync_that_returns_is_bit_identical_whatever_touched_the_destinations(world4, call, atomic) -> None:
    results = world4.run(_versions, call, atomic, timeout=120)
    full_bytes = sum(t.numel() * t.element_size() for t in _source(torch.Generator().manual_seed(11)).values())
    for step, kind in enumerate((*DISTURBANCES, LAST)):
        rows = [r[step] for r in results]
        for rank, row in enumerate(rows):
            assert row["error"] is None, (kind, rank, row["error"])  # no call raises: nothing failed
            assert row["wrong"] == [], (kind, rank, row["wrong"])
            assert row["version"] == (None if rank == 0 else step + 1), (kind, rank)
        kinds = rows[0]["kinds"]
        assert all(r["kinds"] == kinds for r in rows), kind  # one decision, known on every member
        if kind in ("none", LAST) and step:  # nothing touched the destinations: a delta, a fraction of the bytes
            assert set(kinds.values()) == {"delta"}, (kind, kinds)
            assert max(rows[0]["delivered"].values()) < full_bytes / 4, (kind, rows[0]["delivered"])
        else:  # the first sync, and every disturbed one: the destinations' bytes are no base
            assert set(kinds.values()) == {"full"}, (kind, kinds)


def _corrupted(rank: int, size: int, url: str, call: str, atomic: bool) -> list[dict]:
    from rlightning_comm.weights.delta import _writes

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], MODE)
    gen = torch.Generator().manual_seed(5)
    source = _source(gen)
    mine = source if rank == 0 else _zeros(source, inference=False)
    apply = _writes.apply
    out = []
    for version, label in enumerate(("first", "corrupted", "next", "then"), start=1):
        if rank == 0:
            source["w0"][version] += 1
        if label == "corrupted" and rank == 2:

            def corrupt(views, sizes, change):  # writes the delta, then flips one bit of what it wrote
                apply(views, sizes, change)
                views[0][0].view(torch.uint8)[0] ^= 1

            _writes.apply = corrupt
        try:
            report = _sync(call, rank, mine, version, verify=True, atomic=atomic)
            row = {"error": None, "kinds": dict(report.kinds)}
        except Exception as err:  # noqa: BLE001
            row = {"error": type(err).__name__, "msg": str(err)}
        finally:
            _writes.apply = apply
        row.update(label=label, wrong=_wrong(mine, rank), version=ctx.get_weight_version(MODE))
        out.append(row)
    return out


@pytest.mark.parametrize("atomic", [False, True], ids=["plain", "atomic"])
@pytest.mark.parametrize("call", ["broadcast", "reshard"])
def test_a_failed_delta_leaves_no_sticky_base_and_says_the_next_sync_is_full(world4, call, atomic) -> None:
    results = world4.run(_corrupted, call, atomic, timeout=120)
    failed = [r[1] for r in results]
    for rank, row in enumerate(failed):
        assert row["error"] == "CommMismatchError", (rank, row)
        assert "the next sync with delta=True is a full one" in row["msg"], (rank, row["msg"])
    if atomic:  # nothing committed: every destination kept version 1's bytes and version
        assert [r[1]["version"] for r in results[1:]] == [1, 1, 1]
    for step in (2, 3):  # the next sync is full on every member and exact; the one after it a delta again
        rows = [r[step] for r in results]
        for rank, row in enumerate(rows):
            assert row["error"] is None and row["wrong"] == [], (step, rank, row)
        assert set(rows[0]["kinds"].values()) == {"full" if step == 2 else "delta"}, (step, rows[0]["kinds"])
