"""Declared rank order: on an unsorted group every order-dependent op follows the declaration.

The oracle is raw torch.distributed on the sorted group of the same ranks, with the lists and chunks permuted by hand
from declared to sorted order.
"""

from __future__ import annotations

import pytest
from world import init_world

# Declarations on 4 ranks: the whole world out of order, and three ranks out of order with rank 0 outside.
DECLARED = {"ALL": [2, 0, 3, 1], "THREE": [3, 1, 2]}


def _sizes(sender: int, receiver: int) -> int:
    """Rows that declared position ``sender`` sends to declared position ``receiver`` (uneven on purpose)."""
    return 1 + (sender + 2 * receiver) % 3


def _order_ops(rank: int, size: int, url: str) -> dict:
    import torch
    import torch.distributed as dist

    from rlightning_comm import collective

    ctx = init_world(rank, size, url)
    checked = {}
    for mode, declared in DECLARED.items():
        comm = ctx.init_group(declared, mode)
        raw = dist.new_group(sorted(declared))  # the oracle: torch's own numbering, by global rank
        if rank not in declared:
            assert (
                comm.is_member is False
                and ctx.get_group(mode) is None
                and collective.all_reduce(torch.ones(1), mode) is None
            )
            continue
        n, me, order = len(declared), declared.index(rank), sorted(declared)

        def to_sorted(items: list, declared: list = declared, order: list = order) -> list:
            # Entry i of a declared-order list belongs to global rank declared[i]; torch wants them by global rank.
            return [items[declared.index(g)] for g in order]

        assert ctx.get_ranks_in_group(mode) == declared and list(comm.ranks) == declared
        assert ctx.get_local_rank(mode) == comm.rank == me == dist.get_group_rank(ctx.get_group(mode), rank)

        # gather: gather_list[i] holds declared[i]'s tensor.
        dst = declared[-1]
        mine = torch.tensor([10.0 * rank, rank + 0.5])
        ours = [torch.full((2,), -1.0) for _ in range(n)] if rank == dst else None
        collective.gather(mine.clone(), mode, gather_list=ours, dst=dst)
        theirs = [torch.full((2,), -1.0) for _ in range(n)] if rank == dst else None
        dist.gather(mine.clone(), gather_list=theirs, dst=dst, group=raw)
        if rank == dst:
            assert [t.tolist() for t in ours] == [t.tolist() for t in [theirs[order.index(g)] for g in declared]]
            assert [t[0].item() for t in ours] == [10.0 * g for g in declared]

        # scatter: scatter_list[i] goes to declared[i].
        src = declared[0]
        pieces = [torch.tensor([100.0 + i, float(i)]) for i in range(n)]
        out, ref = torch.zeros(2), torch.zeros(2)
        collective.scatter(out, mode, scatter_list=pieces if rank == src else None, src=src)
        dist.scatter(ref, scatter_list=to_sorted(pieces) if rank == src else None, src=src, group=raw)
        assert out.tolist() == ref.tolist() == [100.0 + me, float(me)]

        # broadcast from a src that is not the lowest global rank.
        b, rb = torch.tensor([float(rank)] * 3), torch.tensor([float(rank)] * 3)
        collective.broadcast(b, mode, src=src)
        dist.broadcast(rb, src=src, group=raw)
        assert b.tolist() == rb.tolist() == [float(src)] * 3

        # all_gather: chunk i of the output is declared[i]'s input.
        inp = torch.arange(3, dtype=torch.float32) + 10 * rank
        gathered = torch.empty(3 * n)
        collective.all_gather(gathered, inp, mode)
        raw_chunks = [torch.empty(3) for _ in range(n)]
        dist.all_gather(raw_chunks, inp, group=raw)
        assert gathered.tolist() == torch.cat([raw_chunks[order.index(g)] for g in declared]).tolist()

        # reduce_scatter: this rank receives the reduction of chunk `me` (its declared position).
        chunks = [torch.tensor([float(rank * 7 + i), 1.0 + i]) for i in range(n)]
        red, rref = torch.empty(2), torch.empty(2)
        comm.reduce_scatter(red, torch.cat(chunks))
        dist.reduce_scatter(rref, to_sorted(chunks), group=raw)
        assert red.tolist() == rref.tolist() == [float(sum(g * 7 for g in declared) + n * me), float(n * (1 + me))]

        # all_to_all_single with uneven splits: input chunk j goes to declared[j], output chunk i comes from
        # declared[i].
        send = [torch.full((_sizes(me, j),), 1000.0 * rank + j) for j in range(n)]
        recv_sizes = [_sizes(i, me) for i in range(n)]
        got = torch.empty(sum(recv_sizes))
        comm.all_to_all_single(
            got, torch.cat(send), output_split_sizes=recv_sizes, input_split_sizes=[len(c) for c in send]
        )
        raw_send = to_sorted(send)
        raw_recv_sizes = to_sorted(recv_sizes)
        raw_got = torch.empty(sum(raw_recv_sizes))
        dist.all_to_all_single(raw_got, torch.cat(raw_send), raw_recv_sizes, [len(c) for c in raw_send], group=raw)
        raw_pieces = list(torch.split(raw_got, raw_recv_sizes))
        assert list(torch.split(got, recv_sizes)) and [p.tolist() for p in torch.split(got, recv_sizes)] == [
            raw_pieces[order.index(g)].tolist() for g in declared
        ]
        assert [p[0].item() for p in torch.split(got, recv_sizes)] == [1000.0 * g + me for g in declared]
        # Sequence-parallel chunks: chunk i of the sequence (length i + 1 here) is declared[i]'s; rank0_only scatters
        # from declared[0].
        from rlightning_comm import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region

        full = gather_from_sequence_parallel_region(
            torch.full((1, me + 1), float(rank)), False, mode=mode, seq_lens=[i + 1 for i in range(n)]
        )
        assert full.tolist() == [[float(g) for i, g in enumerate(declared) for _ in range(i + 1)]]
        seq = torch.arange(2.0 * n).reshape(1, 2 * n) + 100 * rank
        mine = scatter_to_sequence_parallel_region(seq, True, mode=mode)
        assert mine.tolist() == [[100.0 * declared[0] + 2 * me, 100.0 * declared[0] + 2 * me + 1]]
        checked[mode] = me
    return checked


def test_unsorted_declaration_is_group_rank_order_for_every_op(world4) -> None:
    results = world4.run(_order_ops)
    assert results == [{"ALL": 1}, {"ALL": 3, "THREE": 1}, {"ALL": 0, "THREE": 2}, {"ALL": 2, "THREE": 0}]


def _creation_paths(rank: int, size: int, url: str) -> list:
    import torch.distributed as dist

    from rlightning_comm import CommError
    from rlightning_comm.context import _groups

    ctx = init_world(rank, size, url)
    calls = []
    real = dist.new_group

    def spy(*args, **kwargs):
        calls.append(sorted(kwargs))
        return real(*args, **kwargs)

    dist.new_group = spy
    try:
        ctx.init_group([0, 1], "SORTED")
        ctx.init_group([1, 0], "UNSORTED")
        _groups._KEEPS_ORDER = False  # a torch whose new_group has no sort_ranks
        ctx.init_group([0, 1], "SORTED_OLD")  # a sorted declaration works on any torch
        with pytest.raises(
            CommError,
            match=(
                r"mode 'OLD': group \[1, 0\] is declared out of ascending order.*needs torch >= 2.12.*Declare the "
                r"group as \[0, 1\]"
            ),
        ):
            ctx.init_group([1, 0], "OLD")
    finally:
        dist.new_group = real
        _groups._KEEPS_ORDER = True
    assert "OLD" not in ctx.bound_modes()
    return calls


def test_sorted_declarations_take_torchs_default_path_and_an_old_torch_refuses_unsorted_ones(world2) -> None:
    # Only the unsorted declaration passes sort_ranks; the refused one never reaches new_group.
    default, keeps_order = ["backend", "ranks", "timeout"], ["backend", "ranks", "sort_ranks", "timeout"]
    assert world2.run(_creation_paths) == [[default, keeps_order, default]] * 2
