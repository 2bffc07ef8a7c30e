"""init_parallel_groups and init_node_groups on real gloo worlds, checked against the oracle and raw torch."""

from __future__ import annotations

import os

import pytest
from layout_oracle import all_layouts, expected_groups, group_of
from world import init_world


def _every_layout(rank: int, size: int, url: str, layouts: list[tuple[int, int, int, str]]) -> list[dict]:
    import torch
    import torch.distributed as dist

    from rlightning_comm import CommContext, ParallelConfig

    # Own the world here, so the context adopts it and destroy() between layouts keeps it.
    dist.init_process_group("gloo", init_method=url, world_size=size, rank=rank)
    ctx = CommContext()
    records = []
    for i, (tp, sp, dp, order) in enumerate(layouts):
        ctx.init_distributed_env(world_size=size, rank=rank, backend="gloo", dist_url=url)
        config = ParallelConfig(
            tensor_parallel_size=tp,
            sequence_parallel_size=sp,
            data_parallel_size=dp if i % 2 else None,
            order=order,
            bind_train_data_parallel=True,
        )
        comms = ctx.init_parallel_groups(config)
        record = {}
        for mode, comm in comms.items():
            # Raw torch on the bound group: who is really in it, in group-rank order.
            gathered = [torch.empty(1, dtype=torch.long) for _ in range(comm.world_size)]
            dist.all_gather(gathered, torch.tensor([rank]), group=ctx.get_group(mode))
            record[mode] = (ctx.get_ranks_in_group(mode), ctx.get_local_rank(mode), [t.item() for t in gathered])
        records.append(record)
        ctx.destroy()
    return records


@pytest.mark.parametrize("world", [1, 2, 4, 8], indirect=True)
def test_every_layout_binds_the_expected_groups(world) -> None:
    layouts = all_layouts(world.size)
    results = world.run(_every_layout, layouts, timeout=90)
    for i, (tp, sp, dp, order) in enumerate(layouts):
        expected = expected_groups(world.size, tp, sp, dp, order)
        for rank, records in enumerate(results):
            record = records[i]
            assert set(record) == set(expected)
            for mode, (ranks, local_rank, gathered) in record.items():
                group = group_of(expected[mode], rank)
                assert ranks == group, (tp, sp, dp, order, mode, rank)
                assert gathered == group, (tp, sp, dp, order, mode, rank)
                assert local_rank == group.index(rank)


def _invalid_layouts(rank: int, size: int, url: str) -> dict:
    import torch.distributed as dist

    from rlightning_comm import CommError, ParallelConfig
    from rlightning_comm.modes import CommMode

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1], CommMode.TENSOR_PARALLEL)
    calls = []
    originals = {
        name: getattr(dist, name) for name in ("new_group", "all_gather_object", "broadcast", "all_reduce", "barrier")
    }

    def recorder(name):
        def call(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, recorder(name))
    errors = {}
    attempts = {
        "tp3": lambda: ctx.init_parallel_groups(ParallelConfig(tensor_parallel_size=3)),
        "tp2sp2": lambda: ctx.init_parallel_groups(ParallelConfig(tensor_parallel_size=2, sequence_parallel_size=2)),
        "dp3": lambda: ctx.init_parallel_groups(ParallelConfig(data_parallel_size=3)),
        "not_a_config": lambda: ctx.init_parallel_groups({"tensor_parallel_size": 2}),
        "conflict": lambda: ctx.init_parallel_groups(ParallelConfig(data_parallel_size=2)),
        "wt_self": lambda: ctx.init_weight_transfer_group(src=0, dst_ranks=[0, 1]),
        "wt_range": lambda: ctx.init_weight_transfer_group(src=0, dst_ranks=[2]),
    }
    for key, attempt in attempts.items():
        try:
            attempt()
            errors[key] = None
        except (ValueError, TypeError, CommError) as err:
            errors[key] = (type(err).__name__, str(err))
    for name, fn in originals.items():
        setattr(dist, name, fn)
    bound_after_errors = ctx.bound_modes()
    # A valid layout that agrees with the existing binding is accepted, and declaring it again is a no-op.
    first = ctx.init_parallel_groups(ParallelConfig(tensor_parallel_size=2))
    again = ctx.init_parallel_groups(ParallelConfig(tensor_parallel_size=2))
    same = all(first[m] is again[m] for m in first)
    return {
        "errors": errors,
        "calls": calls,
        "bound": bound_after_errors,
        "same": same,
        "bound_after": ctx.bound_modes(),
    }


def test_invalid_layouts_are_rejected_before_any_group_or_collective(world2) -> None:
    results = world2.run(_invalid_layouts)
    assert results[0] == results[1]
    out = results[0]
    assert out["calls"] == []
    assert out["bound"] == ["GLOBAL", "TENSOR_PARALLEL"]
    assert out["same"] and out["bound_after"] == ["DATA_PARALLEL", "GLOBAL", "SEQUENCE_PARALLEL", "TENSOR_PARALLEL"]
    errors = out["errors"]
    assert (
        errors["tp3"][0] == "ValueError"
        and "world size 2" in errors["tp3"][1]
        and "tensor_parallel_size=3" in errors["tp3"][1]
    )
    assert errors["tp2sp2"][0] == "ValueError" and "2 x 2 = 4" in errors["tp2sp2"][1]
    assert errors["dp3"][0] == "ValueError" and "1 x 1 x 3 = 3 must equal the world size 2" in errors["dp3"][1]
    assert errors["not_a_config"][0] == "TypeError"
    # TENSOR_PARALLEL is bound to [0, 1]; tp 1 needs [[0], [1]]: refused before DATA_PARALLEL is created.
    assert errors["conflict"][0] == "CommError" and "TENSOR_PARALLEL" in errors["conflict"][1]
    assert errors["wt_self"][0] == "ValueError" and "src=0 must not be one of dst_ranks" in errors["wt_self"][1]
    assert errors["wt_range"][0] == "ValueError" and "out of range for world size 2" in errors["wt_range"][1]


def _node_groups(rank: int, size: int, url: str, scheme: str) -> dict:
    import torch
    import torch.distributed as dist

    from rlightning_comm import CommContext

    node, local = (rank // 2, rank % 2) if scheme == "contiguous" else (rank % 2, rank // 2)
    ctx = init_world(rank, size, url)
    if scheme == "explicit":
        comms = ctx.init_node_groups(node_rank=node, local_rank=local, local_world_size=2)
    else:
        # What a launcher sets; NODE_RANK is the fallback when GROUP_RANK is absent.
        os.environ.update(
            {
                "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK" if scheme == "contiguous" else "NODE_RANK": str(node),
            }
        )
        comms = ctx.init_node_groups()
    out = {}
    for mode, comm in comms.items():
        gathered = [torch.empty(1, dtype=torch.long) for _ in range(comm.world_size)]
        dist.all_gather(gathered, torch.tensor([rank]), group=comm.group)
        out[mode] = (CommContext().get_ranks_in_group(mode), [t.item() for t in gathered])
    return {"node": node, "local": local, "groups": out}


@pytest.mark.parametrize("scheme", ["contiguous", "interleaved", "explicit"])
def test_node_groups_on_two_simulated_nodes(world4, scheme: str) -> None:
    results = world4.run(_node_groups, scheme)
    place = {rank: (r["node"], r["local"]) for rank, r in enumerate(results)}
    for rank, r in enumerate(results):
        node, local = place[rank]
        intra = sorted((p for p in place if place[p][0] == node), key=lambda p: place[p][1])
        inter = sorted((p for p in place if place[p][1] == local), key=lambda p: place[p][0])
        assert r["groups"]["INTRA_NODE"] == (intra, intra)
        assert r["groups"]["INTER_NODE"] == (inter, inter)
        assert len(intra) == 2 and len(inter) == 2


def _bad_nodes(rank: int, size: int, url: str, scheme: str) -> dict:
    import torch

    ctx = init_world(rank, size, url)
    if scheme == "uneven":  # three ranks on node 0, one on node 1
        env = (
            {"GROUP_RANK": "0", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "3"}
            if rank < 3
            else {"GROUP_RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        )
    else:  # rank 2 was not started by a launcher
        env = {} if rank == 2 else {"GROUP_RANK": str(rank // 2), "LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2"}
    for name in ("GROUP_RANK", "NODE_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    os.environ.update(env)
    try:
        ctx.init_node_groups()
        error = None
    except ValueError as err:
        error = str(err)
    # No rank is left inside a collective: the world still works.
    t = torch.ones(1)
    ctx.get_communicator().all_reduce(t)
    return {"error": error, "bound": ctx.bound_modes(), "sum": t.item()}


@pytest.mark.parametrize(
    ("scheme", "match"),
    [
        ("uneven", "uneven nodes: every rank must report the same LOCAL_WORLD_SIZE"),
        ("missing", "rank 2: node_rank was not given and GROUP_RANK / NODE_RANK is not set"),
    ],
)
def test_bad_node_placement_raises_on_every_rank(world4, scheme: str, match: str) -> None:
    results = world4.run(_bad_nodes, scheme)
    for r in results:
        assert r["error"] is not None and match in r["error"]
        assert r["bound"] == ["GLOBAL"]
        assert r["sum"] == 4.0
