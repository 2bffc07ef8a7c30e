"""Every facade of rlightning_comm.collective against raw torch.distributed on the same inputs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from counting import backend_calls
from torch.distributed import ReduceOp
from world import init_world

from rlightning_comm import CommContext, CommMode, ParallelMode, collective

# (op, dtypes) that gloo implements, the oracle being raw torch.distributed.
GLOO_REDUCTIONS = [
    (ReduceOp.SUM, [torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.complex64]),
    (ReduceOp.AVG, [torch.float32, torch.float16, torch.complex64]),
    (ReduceOp.PRODUCT, [torch.float32, torch.int32]),
    (ReduceOp.MIN, [torch.float32, torch.int64]),
    (ReduceOp.MAX, [torch.float64, torch.uint8]),
    (ReduceOp.BAND, [torch.int64, torch.bool]),
    (ReduceOp.BOR, [torch.int32, torch.bool]),
    (ReduceOp.BXOR, [torch.int64]),
]


def _data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    return torch.randint(1, 7, shape, generator=g).to(dtype)


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def _every_op_matches_raw(rank: int, size: int, url: str, async_op: bool) -> int:
    init_world(rank, size, url)
    world = dist.group.WORLD
    checked = 0

    def finish(handle: object) -> None:
        if async_op:
            assert handle is not None and handle.wait()
        else:
            assert handle is None

    for mode in (CommMode.GLOBAL, "GLOBAL"):
        for op, dtypes in GLOO_REDUCTIONS:
            for dtype in dtypes:
                ours, raw = _data(rank, (3, 5), dtype, salt=checked), _data(rank, (3, 5), dtype, salt=checked)
                finish(collective.all_reduce(ours, mode, op=op, async_op=async_op))
                dist.all_reduce(raw, op=op, group=world)
                _same(ours, raw, f"all_reduce {op} {dtype}")
                checked += 1

        x = _data(rank, (2, 3), torch.float32, salt=1)
        out = torch.empty(2 * size, 3)
        finish(collective.all_gather(out, x, mode, async_op=async_op))
        raw_list = [torch.empty(2, 3) for _ in range(size)]
        dist.all_gather(raw_list, x, group=world)
        _same(out, torch.cat(raw_list), "all_gather concatenated along dim 0")
        stacked = torch.empty(size, 2, 3)
        finish(collective.all_gather(stacked, x, mode, async_op=async_op))
        _same(stacked, torch.stack(raw_list), "all_gather into (world, *shape)")
        scalar_out = torch.empty(size, dtype=torch.int64)
        finish(collective.all_gather(scalar_out, torch.tensor(rank * 7), mode, async_op=async_op))
        _same(scalar_out, torch.arange(size) * 7, "all_gather of 0-d tensors")

        for src in range(size):
            ours, raw = _data(rank, (4,), torch.float64, salt=src), _data(rank, (4,), torch.float64, salt=src)
            finish(collective.broadcast(ours, mode, src=src, async_op=async_op))
            dist.broadcast(raw, src=src, group=world)
            _same(ours, raw, f"broadcast src={src}")

            x = _data(rank, (2, 2), torch.int64, salt=src)
            ours_list = [torch.zeros(2, 2, dtype=torch.int64) for _ in range(size)] if rank == src else None
            raw_list = [torch.zeros(2, 2, dtype=torch.int64) for _ in range(size)] if rank == src else None
            finish(collective.gather(x, mode, gather_list=ours_list, dst=src, async_op=async_op))
            dist.gather(x, raw_list, dst=src, group=world)
            if rank == src:
                for i in range(size):
                    _same(ours_list[i], raw_list[i], f"gather dst={src} slot {i}")

            chunks = [_data(src, (3,), torch.float32, salt=i) for i in range(size)]
            ours, raw = torch.full((3,), -1.0), torch.full((3,), -1.0)
            finish(
                collective.scatter(ours, mode, scatter_list=chunks if rank == src else None, src=src, async_op=async_op)
            )
            dist.scatter(raw, chunks if rank == src else None, src=src, group=world)
            _same(ours, raw, f"scatter src={src}")

            # Complex tensors move as real pairs: gloo's own gather refuses them, so its oracle gathers the real view.
            c = _data(rank, (3,), torch.complex64, salt=src)
            ours_c = [torch.zeros(3, dtype=torch.complex64) for _ in range(size)] if rank == src else None
            raw_c = [torch.zeros(3, 2) for _ in range(size)] if rank == src else None
            finish(collective.gather(c, mode, gather_list=ours_c, dst=src, async_op=async_op))
            dist.gather(torch.view_as_real(c), raw_c, dst=src, group=world)
            if rank == src:
                for i in range(size):
                    _same(torch.view_as_real(ours_c[i]), raw_c[i], f"complex gather dst={src} slot {i}")
            chunks_c = [_data(src, (3,), torch.complex128, salt=i) for i in range(size)]
            ours, raw = torch.zeros(3, dtype=torch.complex128), torch.zeros(3, dtype=torch.complex128)
            finish(
                collective.scatter(
                    ours, mode, scatter_list=chunks_c if rank == src else None, src=src, async_op=async_op
                )
            )
            dist.scatter(raw, chunks_c if rank == src else None, src=src, group=world)
            _same(ours, raw, f"complex scatter src={src}")

            objs = [{"from": rank, "n": [rank] * 3}, f"rank{rank}"]
            raw_objs = list(objs)
            assert collective.broadcast_object_list(objs, mode, src=src) is None
            dist.broadcast_object_list(raw_objs, src=src, group=world)
            assert objs == raw_objs, (objs, raw_objs)
            checked += 5
        comm = CommContext().get_communicator(mode)
        for op in (ReduceOp.SUM, ReduceOp.MAX):
            x = _data(rank, (2 * size, 3), torch.float32, salt=7)
            ours, raw = torch.full((2, 3), -1.0), torch.full((2, 3), -1.0)
            finish(comm.reduce_scatter(ours, x, op=op, async_op=async_op))
            dist.reduce_scatter_tensor(raw, x, op=op, group=world)
            _same(ours, raw, f"reduce_scatter {op}")
        for dtype in (torch.float32, torch.complex64):
            x = _data(rank, (size, 2), dtype, salt=9)
            ours, raw = torch.zeros(size, 2, dtype=dtype), torch.zeros(size, 2, dtype=dtype)
            finish(comm.all_to_all_single(ours, x, async_op=async_op))
            dist.all_to_all_single(raw, x, group=world)
            _same(ours, raw, f"all_to_all_single even {dtype}")
        # Uneven: rank r sends r + 1 rows to every peer, so it receives (p + 1) rows from each peer p.
        x = _data(rank, ((rank + 1) * size, 2), torch.float64, salt=11)
        recv = [p + 1 for p in range(size)]
        ours, raw = torch.zeros(sum(recv), 2, dtype=torch.float64), torch.zeros(sum(recv), 2, dtype=torch.float64)
        finish(comm.all_to_all_single(ours, x, recv, [rank + 1] * size, async_op=async_op))
        dist.all_to_all_single(raw, x, recv, [rank + 1] * size, group=world)
        _same(ours, raw, "all_to_all_single uneven")
        collective.barrier(mode)
    return checked


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("async_op", [False, True])
def test_every_op_matches_raw_torch_distributed(world, async_op):
    counts = world.run(_every_op_matches_raw, async_op)
    assert len(set(counts)) == 1 and counts[0] > 0


def _dict_reduction(rank: int, size: int, url: str) -> None:
    init_world(rank, size, url)
    weights = torch.full((2, 3), float(rank + 1))
    mixed = {
        "loss": 0.5 * (rank + 1),
        "steps": rank + 1,
        "flag": True,
        "scalar_t": torch.tensor(float(rank)),
        "weights": weights,
        "ints": torch.arange(3) * rank,
    }
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in mixed.items()}
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG):
        got = collective.all_reduce_dict(mixed, CommMode.GLOBAL, op=op)
        assert set(got) == set(mixed) and got is not mixed
        for key, value in mixed.items():
            # Oracle: one raw all_reduce per key, in float32.
            raw = torch.as_tensor(value, dtype=torch.float32).clone()
            dist.all_reduce(raw, op=op)
            if isinstance(value, torch.Tensor):
                assert isinstance(got[key], torch.Tensor) and got[key].shape == value.shape, (key, got[key])
                _same(got[key], raw, f"all_reduce_dict {op} {key}")
            else:
                assert type(got[key]) is float and got[key] == raw.item(), (key, got[key], raw)
    for key, value in before.items():  # the input is not modified
        if isinstance(value, torch.Tensor):
            _same(mixed[key], value, f"input {key} untouched")
        else:
            assert mixed[key] == value
    in64 = collective.all_reduce_dict({"a": 1, "b": torch.ones(2)}, "GLOBAL", dtype=torch.float64)
    assert in64["a"] == float(size) and in64["b"].dtype == torch.float64
    assert collective.all_reduce_dict({}, CommMode.GLOBAL) == {}


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_all_reduce_dict_matches_per_key_reduction(world):
    world.run(_dict_reduction)


def _dict_uses_one_collective(rank: int, size: int, url: str) -> dict[str, int]:
    init_world(rank, size, url)
    with backend_calls() as calls:
        out = collective.all_reduce_dict(
            {f"k{i}": (torch.ones(i % 3 + 1) if i % 5 == 0 else i) for i in range(300)}, CommMode.GLOBAL
        )
    assert out["k7"] == 7.0 * size and torch.equal(out["k5"], torch.full((3,), float(size)))
    return dict(calls)


def test_all_reduce_dict_is_one_collective_whatever_the_key_count(world2):
    assert world2.run(_dict_uses_one_collective) == [{"all_reduce": 1}] * 2


def _subgroup_and_non_members(rank: int, size: int, url: str) -> None:
    ctx = init_world(rank, size, url)
    ours = ctx.init_group([0, 2], "evens")
    raw_group = dist.new_group([0, 2])
    t = torch.tensor([rank + 1.0, 10.0 * rank])
    got = collective.all_reduce(t, "evens")
    assert got is None
    if rank in (0, 2):
        raw = torch.tensor([rank + 1.0, 10.0 * rank])
        dist.all_reduce(raw, group=raw_group)
        _same(t, raw, "subgroup all_reduce")
        assert ctx.get_local_rank("evens") == [0, 2].index(rank)
        assert ours.is_member and ctx.get_group("evens") is ours.group
        b = torch.tensor([float(rank)])
        collective.broadcast(b, "evens", src=2)
        _same(b, torch.tensor([2.0]), "subgroup broadcast from global rank 2")
        with pytest.raises(ValueError, match=r"src=1 is not a global rank of mode 'evens'; expected one of \[0, 2\]"):
            collective.broadcast(b, "evens", src=1)
    else:
        _same(t, torch.tensor([rank + 1.0, 10.0 * rank]), "non-member tensor unchanged")
        assert not ours.is_member and ctx.get_group("evens") is None
        for call in (
            lambda: collective.all_gather(torch.empty(4), torch.ones(2), "evens"),
            lambda: collective.broadcast(t, "evens", src=5),
            lambda: collective.gather(t, "evens", dst=0),
            lambda: collective.scatter(t, "evens", src=0),
            lambda: collective.broadcast_object_list([None], "evens"),
            lambda: collective.all_reduce_dict({"a": 1.0}, "evens"),
            lambda: collective.barrier("evens"),
            lambda: collective.all_reduce(t, "evens", async_op=True),
        ):
            assert call() is None
        with pytest.raises(RuntimeError, match="not a member of mode 'evens'"):
            ctx.get_local_rank("evens")
    assert ctx.get_world_size("evens") == 2 and ctx.get_ranks_in_group("evens") == [0, 2]

    # A partition: every rank is bound to the group that holds it.
    ctx.init_group([[0, 1], [2, 3]], ParallelMode.DATA_PARALLEL)
    raw_pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for mode in (ParallelMode.DATA_PARALLEL, CommMode.DATA_PARALLEL, "DATA_PARALLEL"):
        t = torch.tensor([float(rank * rank)])
        collective.all_reduce(t, mode)
        raw = torch.tensor([float(rank * rank)])
        dist.all_reduce(raw, group=raw_pairs[rank // 2])
        _same(t, raw, f"partition all_reduce via {mode!r}")
    pair = [0, 1] if rank < 2 else [2, 3]
    assert ctx.get_ranks_in_group("DATA_PARALLEL") == pair and ctx.get_local_rank(CommMode.DATA_PARALLEL) == rank % 2
    out = torch.empty(2, dtype=torch.int64)
    collective.all_gather(out, torch.tensor([rank]), "DATA_PARALLEL")
    _same(out, torch.tensor(pair), "partition all_gather")

    # A partition that leaves rank 3 out.
    ctx.init_group([[0], [1, 2]], "partial")
    if rank == 3:
        assert ctx.get_communicator("partial").is_member is False and collective.all_reduce(t, "partial") is None
    else:
        t = torch.tensor([1.0])
        collective.all_reduce(t, "partial")
        assert t.item() == (1.0 if rank == 0 else 2.0)
    assert ctx.get_global_rank() == rank and ctx.is_initialized()


def test_subgroups_partitions_and_non_members(world4):
    world4.run(_subgroup_and_non_members)


def _gather_scatter_in_subgroup(rank: int, size: int, url: str) -> None:
    ctx = init_world(rank, size, url)
    ctx.init_group([3, 1], "odds")  # group ranks follow the declared order: global 3 is group rank 0
    assert ctx.get_ranks_in_group("odds") == [3, 1]
    if rank in (1, 3):
        gl = [torch.zeros(1) for _ in range(2)] if rank == 3 else None
        collective.gather(torch.tensor([float(rank)]), "odds", gather_list=gl, dst=3)
        if rank == 3:
            assert [g.item() for g in gl] == [3.0, 1.0], gl
        out = torch.zeros(1)
        collective.scatter(
            out, "odds", scatter_list=[torch.tensor([30.0]), torch.tensor([10.0])] if rank == 3 else None, src=3
        )
        assert out.item() == rank * 10.0
        assert ctx.get_local_rank("odds") == {3: 0, 1: 1}[rank]


def test_group_rank_order_is_the_declared_order(world4):
    world4.run(_gather_scatter_in_subgroup)


def _destroy_and_reinit(rank: int, size: int, url: str) -> None:
    ctx = init_world(rank, size, url)
    ctx.init_group([[r] for r in range(size)], "solo")
    ctx.destroy()
    assert not ctx.is_initialized() and not dist.is_initialized()
    with pytest.raises(RuntimeError, match="No communicator bound for mode 'GLOBAL'"):
        collective.all_reduce(torch.ones(1), CommMode.GLOBAL)
    ctx.init_distributed_env(world_size=size, rank=rank, backend="gloo", dist_url=url + "-again")
    ctx.init_group([list(range(size))], "all")
    t = torch.ones(2)
    collective.all_reduce(t, "all")
    _same(t, torch.full((2,), float(size)), "all_reduce after destroy and re-init")


def test_destroy_then_init_again(world2):
    world2.run(_destroy_and_reinit)
