"""Run every collective of rlightning_comm on 4 ranks and print what each rank got.

From the repository root, with the package installed (``pip install .``). No launcher needed: ``run`` spawns 4 local
gloo processes::

    python examples/quickstart.py

or, under torchrun, each process is one rank::

    torchrun --nproc-per-node 4 examples/quickstart.py
"""

from __future__ import annotations

import torch

from rlightning_comm import CommContext, CommMode, ParallelMode, collective, run


def main() -> None:
    ctx = CommContext()
    rank, world = ctx.get_global_rank(), ctx.get_world_size()
    # Data parallel pairs: [[0, 1], [2, 3]] on 4 ranks.
    ctx.init_group([list(range(i, min(i + 2, world))) for i in range(0, world, 2)], ParallelMode.DATA_PARALLEL)
    lines = []

    t = torch.tensor([float(rank + 1)])
    collective.all_reduce(t, CommMode.GLOBAL)
    lines.append(f"all_reduce(SUM) of rank+1        -> {t.item():g}")

    t = torch.tensor([float(rank + 1)])
    collective.all_reduce(t, ParallelMode.DATA_PARALLEL)
    lines.append(
        f"all_reduce on my DATA_PARALLEL pair {ctx.get_ranks_in_group(ParallelMode.DATA_PARALLEL)} -> {t.item():g}"
    )

    out = torch.empty(world, dtype=torch.int64)
    collective.all_gather(out, torch.tensor([rank * 10]), CommMode.GLOBAL)
    lines.append(f"all_gather of rank*10            -> {out.tolist()}")

    t = torch.tensor([float(rank)])
    collective.broadcast(t, "GLOBAL", src=world - 1)
    lines.append(f"broadcast from rank {world - 1}            -> {t.item():g}")

    gather_list = [torch.zeros(1) for _ in range(world)] if rank == 0 else None
    collective.gather(torch.tensor([rank**2.0]), CommMode.GLOBAL, gather_list=gather_list, dst=0)
    if gather_list is not None:
        lines.append(f"gather of rank**2 on rank 0      -> {[g.item() for g in gather_list]}")

    t = torch.zeros(1)
    collective.scatter(
        t, CommMode.GLOBAL, scatter_list=[torch.tensor([100.0 + i]) for i in range(world)] if rank == 0 else None, src=0
    )
    lines.append(f"scatter from rank 0              -> {t.item():g}")

    objs = [{"config": "from rank 0", "lr": 3e-4}] if rank == 0 else [None]
    collective.broadcast_object_list(objs, CommMode.GLOBAL, src=0)
    lines.append(f"broadcast_object_list            -> {objs[0]}")

    metrics = collective.all_reduce_dict(
        {"loss": 0.5 * rank, "tokens": 128, "grad_norm": torch.tensor([rank, 1.0])}, CommMode.GLOBAL
    )
    lines.append(
        f"all_reduce_dict (one collective) -> loss={metrics['loss']:g} tokens={metrics['tokens']:g} "
        f"grad_norm={metrics['grad_norm'].tolist()}"
    )

    for r in range(world):  # print in rank order
        if r == rank:
            print("\n".join(f"[rank {rank}] {line}" for line in lines), flush=True)
        collective.barrier(CommMode.GLOBAL)


if __name__ == "__main__":
    run(main, 4)
