"""Cut-through in a relay: every unit larger than the cut travels as runs of its bytes, each forwarded by a relay as
soon as it has arrived. With a tiny, odd cut (so every unit, in place or a bucket, is cut, and no run is aligned), every
destination of a 4-member chain ends bit-identical to the source, plain, verified, atomic and as a delta; the oracle is
raw ``torch.distributed.broadcast`` of the source's bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from world import init_world

MODE = "CUT"
CUT = 4096 + 24


def _state(gen: torch.Generator) -> dict[str, torch.Tensor]:
    emb = torch.randn(300, 100, generator=gen).to(torch.bfloat16)
    return {
        "emb": emb,
        "head": emb,
        "w": torch.randn(200, 150, generator=gen).t(),  # strided on the source: staged
        "big": torch.randn(70_001, generator=gen),
        **{f"b{i}": torch.randn(33 + i, generator=gen) for i in range(20)},
    }


def _run(rank: int, size: int, url: str, options: dict) -> dict:
    from rlightning_comm import broadcast_state_dict
    from rlightning_comm.weights.broadcast import _transport

    cut = _transport.CUT_BYTES
    _transport.CUT_BYTES = CUT
    cuts = []
    chunks = _transport.Transfer._chunks

    def counted(self, data):
        out = chunks(self, data)
        cuts.append(len(out))
        return out

    _transport.Transfer._chunks = counted
    try:
        ctx = init_world(rank, size, url)
        ctx.init_group([0, 1, 2, 3], MODE)
        gen = torch.Generator().manual_seed(21)
        source = _state(gen)
        mine = source if rank == 0 else {n: torch.zeros_like(t) for n, t in source.items()}
        wrong = []
        for version in (1, 2):
            if rank == 0:
                with torch.no_grad():
                    source["big"][::7] += 1.0
                    source["emb"][3] += 1
            report = broadcast_state_dict(mine, MODE, src=0, bucket_bytes=64 << 10, version=version, **options)
            for name in sorted(mine):
                theirs = mine[name].detach().contiguous().reshape(-1).view(torch.uint8).clone()
                dist.broadcast(theirs, src=0)
                if rank and not torch.equal(mine[name].detach().contiguous().reshape(-1).view(torch.uint8), theirs):
                    wrong.append((version, name))
        return {"wrong": wrong, "most": max(cuts), "sent": dict(report.sent)}
    finally:
        _transport.CUT_BYTES = cut
        _transport.Transfer._chunks = chunks


@pytest.mark.parametrize("options", [{}, {"verify": True}, {"atomic": True}, {"delta": True}], ids=str)
def test_every_destination_of_a_cut_through_relay_is_bit_identical(world4, options) -> None:
    results = world4.run(_run, options, timeout=120)
    for rank, out in enumerate(results):
        assert out["wrong"] == [], (rank, out["wrong"])
        assert out["most"] > 10, (rank, out["most"])  # units really travelled as many runs
    assert set(results[0]["sent"]) == {1}  # a relay: the source sends to the first destination only
