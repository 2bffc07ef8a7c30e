"""RLightning's call sequence, replayed on 4 gloo ranks on 2 simulated nodes, with only its imports changed.

Layout: node 0 runs ranks 0 and 1, node 1 ranks 2 and 3; the trainers are ranks 1
and 3 (not the lowest rank of their weight-transfer group), each sends to the rollout worker on its node. What
RLightning does with raw torch.distributed on ``get_group`` is the oracle for what it gets.
"""

from __future__ import annotations

import pytest
from world import free_port, init_world

NODES = [[0, 1], [2, 3]]
TRANSFER = [[1, 0], [3, 2]]  # [sender] + receivers, per node
TRAINERS = [1, 3]
PPO_SAMPLES = {1: {"loss": [1.0, 2.0], "kl": [0.125, 0.375]}, 3: {"loss": [3.0, 4.0], "kl": [0.5, 0.5]}}


def _trainer_state(node: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(100 + node)
    return {
        "actor": {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(7, generator=gen).to(torch.bfloat16)},
        "critic": {"v": torch.randn(4, generator=gen), "h": torch.randn(2, 3, generator=gen).to(torch.float16)},
    }


def _by_dtype(state: dict) -> tuple[dict, dict]:
    # RLightning's _group_params_by_dtype: parameters and (module, name, shape, numel) grouped by dtype.
    params, meta = {}, {}
    for module, tensors in state.items():
        for name, t in tensors.items():
            params.setdefault(t.dtype, []).append(t)
            meta.setdefault(t.dtype, []).append((module, name, t.shape, t.numel()))
    return params, meta


def _unflatten(flat: dict, meta: dict) -> dict:
    out: dict = {}
    for dtype, entries in meta.items():
        offset = 0
        for module, name, shape, numel in entries:
            out.setdefault(module, {})[name] = flat[dtype].narrow(0, offset, numel).view(shape)
            offset += numel
    return out


def _bits(state: dict) -> dict:
    """Every tensor as its dtype and raw bytes: equal means bit-identical."""
    import torch

    return {
        f"{m}.{n}": (str(t.dtype), t.contiguous().view(-1).view(torch.uint8).tolist())
        for m, ts in state.items()
        for n, t in ts.items()
    }


def _replay(rank: int, size: int, url: str, port: int) -> dict:
    import os

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    from rlightning_comm import CommContext, ParallelMode, collective, initialize_distributed_env

    node = rank // 2
    # DistributedMixin.init_distributed_env: the actor sets its own environment, then initialises with env://.
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK=str(rank % 2),
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    initialize_distributed_env(rank, size, "gloo", "env://", 60)
    ctx = CommContext()
    facts = {"main": ctx.is_main_rank(), "in_node": ctx.get_in_node_rank(), "local_world": ctx.get_local_world_size()}

    def dist_barrier(mode=None):
        # DistributedMixin.dist_barrier, as written in RLightning.
        group = None
        if mode is not None:
            group = ctx.get_group(mode)
            if group is None:
                return "skipped"
        dist.barrier(group=group)
        return "waited"

    # PolicyGroup.init_comm_group: one group per call, every call on every rank.
    for ranks in NODES:
        ctx.init_group(ranks, ParallelMode.INTRA_NODE, "gloo")
    dist_barrier()
    for ranks in TRANSFER:
        ctx.init_group(ranks, ParallelMode.WEIGHT_TRANSFER, "gloo")
    dist_barrier()
    ctx.init_group(TRAINERS, ParallelMode.TRAIN_DATA_PARALLEL, "gloo")
    facts["tdp_barrier"] = dist_barrier(ParallelMode.TRAIN_DATA_PARALLEL)
    facts["intra"] = (ctx.get_ranks_in_group(ParallelMode.INTRA_NODE), ctx.get_local_rank(ParallelMode.INTRA_NODE))
    facts["intra_pg_is_group"] = (
        ctx.get_intra_node_process_group() is ctx.get_group(ParallelMode.INTRA_NODE) is not None
    )
    facts["transfer"] = ctx.get_ranks_in_group(ParallelMode.WEIGHT_TRANSFER)
    facts["declared"] = [list(p) for p in ctx.get_group_config(ParallelMode.WEIGHT_TRANSFER).partition]

    group = ctx.get_group(ParallelMode.WEIGHT_TRANSFER)
    sender = ctx.get_ranks_in_group(ParallelMode.WEIGHT_TRANSFER)[0]
    is_sender = rank == sender
    expected = _trainer_state(node)
    zeros = {m: {n: torch.zeros_like(t) for n, t in ts.items()} for m, ts in expected.items()}
    received = {}

    # 1. Layer by layer: one broadcast per tensor.
    state = expected if is_sender else {m: {n: t.clone() for n, t in ts.items()} for m, ts in zeros.items()}
    for tensors in state.values():
        for param in tensors.values():
            dist.broadcast(param.data, src=sender, group=group)
    received["layer"] = _bits(state)

    # 2. Full: one flat vector per dtype (sorted by name), async broadcasts waited at the end.
    params, meta = _by_dtype(expected if is_sender else zeros)
    flats, works = {}, []
    for dtype in sorted(params, key=str):
        if is_sender:
            flats[dtype] = torch.nn.utils.parameters_to_vector(params[dtype]).contiguous()
        else:
            flats[dtype] = torch.empty(sum(m[3] for m in meta[dtype]), dtype=dtype)
        works.append(dist.broadcast(flats[dtype], src=sender, group=group, async_op=True))
    for work in works:
        work.wait()
    received["full"] = _bits(_unflatten(flats, meta))

    # 3. Sharded: pad to a multiple of the receivers, scatter [dummy] + shards; raw torch, then our facade.
    receivers = ctx.get_world_size(ParallelMode.WEIGHT_TRANSFER) - 1
    for way in ("raw", "facade"):
        shards = {}
        for dtype in sorted(params, key=str):
            numel = sum(m[3] for m in meta[dtype])
            padded = numel + (-numel) % receivers
            scatter_list = None
            if is_sender:
                flat = torch.nn.utils.parameters_to_vector(params[dtype])
                flat = torch.cat([flat, torch.zeros(padded - numel, dtype=dtype)])
                pieces = list(flat.chunk(receivers))
                scatter_list = [torch.empty_like(pieces[0])] + pieces
            out = torch.empty(padded // receivers, dtype=dtype)
            if way == "raw":
                dist.scatter(tensor=out, scatter_list=scatter_list, src=sender, group=group, async_op=False)
            else:
                collective.scatter(out, ParallelMode.WEIGHT_TRANSFER, scatter_list=scatter_list, src=sender)
            shards[dtype] = out[:numel]  # one receiver per group: its shard is the whole vector
        if not is_sender:
            received[f"sharded_{way}"] = _bits(_unflatten(shards, meta))

    # PPO metrics over the trainers: numpy float64 means, averaged.
    if rank in TRAINERS:
        metrics = {k: np.mean(v) for k, v in PPO_SAMPLES[rank].items()}
        facts["metrics"] = collective.all_reduce_dict(
            metrics, comm_mode=ParallelMode.TRAIN_DATA_PARALLEL, op=ReduceOp.AVG
        )
        facts["metric_types"] = sorted({type(v).__name__ for v in facts["metrics"].values()})
    else:
        facts["metrics"] = collective.all_reduce_dict(
            {"loss": np.float64(9.0)}, comm_mode=ParallelMode.TRAIN_DATA_PARALLEL, op=ReduceOp.AVG
        )
    facts["received"] = received
    facts["expected"] = _bits(expected)
    return facts


def test_rlightning_call_sequence_runs_unchanged(world4) -> None:
    results = world4.run(_replay, free_port())
    for rank, r in enumerate(results):
        node = rank // 2
        assert (r["main"], r["in_node"], r["local_world"]) == (rank == 0, rank % 2, 2)
        assert r["intra"] == (NODES[node], rank % 2) and r["intra_pg_is_group"]
        # The sender is get_ranks_in_group(...)[0] as declared, though it is the higher rank of its group.
        assert r["transfer"] == TRANSFER[node] and r["declared"] == TRANSFER
        assert r["tdp_barrier"] == ("waited" if rank in TRAINERS else "skipped")
        if rank in TRAINERS:
            assert r["metrics"] == {"kl": 0.375, "loss": 2.5} and r["metric_types"] == ["float"]
            assert r["received"].keys() == {"layer", "full"}
            assert (
                r["received"]["layer"] == r["received"]["full"] == r["expected"]
            )  # the sender's tensors are only read
        else:
            assert r["metrics"] is None
            assert r["received"].keys() == {"layer", "full", "sharded_raw", "sharded_facade"}
            sender = results[TRANSFER[node][0]]
            for strategy, got in r["received"].items():
                assert got == sender["expected"], strategy  # bit-identical to the trainer of this node
    assert results[0]["expected"] != results[2]["expected"]  # the two trainers really send different weights


def _binding_rules(rank: int, size: int, url: str) -> dict:
    import torch
    import torch.distributed as dist

    from rlightning_comm import CommError, collective

    ctx = init_world(rank, size, url)
    created = []
    real = dist.new_group

    def spy(*args, **kwargs):
        created.append(kwargs["ranks"])
        return real(*args, **kwargs)

    dist.new_group = spy
    try:
        first = ctx.init_group([0, 1], "M")
        if rank >= 2:  # not declared yet: a non-member that still reports the mode's only group
            assert (
                ctx.get_group("M") is None
                and ctx.get_ranks_in_group("M") == [0, 1]
                and collective.all_reduce(torch.ones(1), "M") is None
            )
        second = ctx.init_group([3, 2], "M")
        assert (second is first) == (rank < 2)  # a group without this rank leaves its binding alone
        assert (
            ctx.init_group([3, 2], "M") is second and ctx.init_group([[0, 1], [3, 2]], "M") is second
        )  # repeats: no-ops
        assert created == [[0, 1], [3, 2]]
        for conflict in ([2, 1], [1, 0]):  # overlapping, and the same ranks in another order
            with pytest.raises(CommError, match=r"mode 'M': rank \d is declared in two different groups"):
                ctx.init_group(conflict, "M")
        with pytest.raises(
            CommError,
            match=r"mode 'M' is already bound to ranks \[\[0, 1\], \[3, 2\]\].*got backend 'gloo', timeout 5.0s",
        ):
            ctx.init_group([[0], [1]], "M", timeout=5)
        assert created == [[0, 1], [3, 2]] and ctx.get_group_config("M").partition == ((0, 1), (3, 2))
        ctx.init_group([0], "N")
        ctx.init_group([2], "N")
        ctx.init_node_groups(node_rank=rank // 2, local_rank=rank % 2, local_world_size=2)
        intra = ctx.get_communicator("INTRA_NODE")
        ctx.init_group([0, 1], "INTRA_NODE")  # the seed's per-call form after the layout: a no-op
        assert ctx.get_communicator("INTRA_NODE") is intra and ctx.get_inter_node_process_group() is ctx.get_group(
            "INTER_NODE"
        )
        ctx.init_weight_transfer_group(src=1, dst_ranks=[0])
        ctx.init_weight_transfer_group(src=3, dst_ranks=[2])
    finally:
        dist.new_group = real
    t = torch.tensor([float(rank + 1)])
    collective.all_reduce(t, "M")
    facts = {
        "M": (ctx.get_ranks_in_group("M"), ctx.get_local_rank("M"), t.item()),
        "N_member": ctx.get_communicator("N").is_member,
        "N_ranks": ctx.get_ranks_in_group("N"),
        "source": ctx.get_transfer_source(),
        "inter": ctx.get_ranks_in_group("INTER_NODE"),
    }
    if not facts["N_member"]:
        assert ctx.get_group("N") is None and collective.all_reduce(t, "N") is None
        with pytest.raises(CommError, match="not a member of mode 'N'"):
            ctx.get_local_rank("N")
    return facts


def test_per_call_binding_rules(world4) -> None:
    results = world4.run(_binding_rules)
    assert [r["M"] for r in results] == [([0, 1], 0, 3.0), ([0, 1], 1, 3.0), ([3, 2], 1, 7.0), ([3, 2], 0, 7.0)]
    assert [r["N_member"] for r in results] == [True, False, True, False]
    assert [r["N_ranks"] for r in results] == [
        [0],
        [],
        [2],
        [],
    ]  # a non-member of a mode with several groups has no ranks
    assert [r["source"] for r in results] == [1, 1, 3, 3]
    assert [r["inter"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
