"""Build the full parallel layout, print it, and check every collective on every mode.

From the repository root, with the package installed (``pip install .``). Under a launcher (one or several nodes)::

    torchrun --nproc-per-node 4 examples/parallel_layout.py --tp 2

Without one, it starts the ranks itself with ``rlightning_comm.run`` (gloo on loopback, a file store), each
simulated node's ranks with that node's ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``::

    python examples/parallel_layout.py --nproc 4 --simulated-nodes 2 --tp 2

Every rank binds GLOBAL, TENSOR/SEQUENCE/DATA/TRAIN_DATA_PARALLEL (from ``--tp``/``--sp``/``--order``),
INTRA_NODE/INTER_NODE (from the launcher's LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK) and WEIGHT_TRANSFER (rank 0 to the
others), runs every collective of every mode against values computed from the group's ranks, checks that all members of
each group agree on it, and sends a small mixed-dtype model over WEIGHT_TRANSFER. Rank 0 prints the layout, one
all_reduce per mode, and a ``LAYOUT_JSON`` line. The exit code is non-zero on every rank if any check failed on any
rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn

from rlightning_comm import (
    CommContext,
    CommMode,
    ParallelConfig,
    broadcast_state_dict,
    collective,
    describe_layout,
    format_layout,
    launch,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel size")
    parser.add_argument("--sp", type=int, default=1, help="sequence parallel size")
    parser.add_argument("--order", default="tp-sp-dp", help="rank order, fastest-varying axis first")
    parser.add_argument("--backend", default="gloo", help="communicator backend (gloo, nccl)")
    parser.add_argument("--nproc", type=int, default=4, help="ranks to spawn without a launcher")
    parser.add_argument("--simulated-nodes", type=int, default=2, help="nodes to simulate without a launcher")
    parser.add_argument(
        "--timeout", type=float, default=120, help="seconds before a collective (or the spawned job) fails"
    )
    return parser.parse_args(argv)


def _check_mode(ctx: CommContext, mode: str, failures: list[str]) -> None:
    """Run every collective on ``mode`` and record each result that differs from what its ranks imply."""
    c = ctx.get_communicator(mode)
    if not c.is_member:
        return
    ranks, n, i, me = list(c.ranks), c.world_size, c.rank, ctx.get_global_rank()
    dev = c.device

    def expect(name: str, got: object, want: object) -> None:
        if got != want:
            failures.append(f"rank {me} {mode} {name}: got {got}, expected {want}")

    t = torch.tensor([float(me)], device=dev)
    c.all_reduce(t)
    expect("all_reduce SUM", t.item(), float(sum(ranks)))
    t = torch.tensor([me], device=dev)
    c.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    expect("all_reduce MAX", t.item(), max(ranks))
    out = torch.empty(n, dtype=torch.long, device=dev)
    c.all_gather(out, torch.tensor([me], device=dev))
    expect("all_gather", out.tolist(), ranks)
    t = torch.tensor([me], device=dev)
    c.broadcast(t, src=ranks[-1])
    expect("broadcast", t.item(), ranks[-1])
    gathered = [torch.empty(1, dtype=torch.long, device=dev) for _ in ranks] if me == ranks[0] else None
    c.gather(torch.tensor([me], device=dev), gathered, dst=ranks[0])
    if gathered is not None:
        expect("gather", [g.item() for g in gathered], ranks)
    t = torch.empty(1, dtype=torch.long, device=dev)
    pieces = [torch.tensor([100 * me + j], device=dev) for j in range(n)] if me == ranks[0] else None
    c.scatter(t, pieces, src=ranks[0])
    expect("scatter", t.item(), 100 * ranks[0] + i)
    t = torch.empty(1, dtype=torch.long, device=dev)
    c.reduce_scatter(t, torch.arange(n, device=dev) + me)
    expect("reduce_scatter", t.item(), sum(ranks) + n * i)
    out = torch.empty(n, dtype=torch.long, device=dev)
    c.all_to_all_single(out, torch.arange(n, device=dev) + 1000 * me)
    expect("all_to_all_single", out.tolist(), [1000 * r + i for r in ranks])
    objs = [{"from": me}]
    c.broadcast_object_list(objs, src=ranks[0])
    expect("broadcast_object_list", objs[0], {"from": ranks[0]})
    reduced = c.all_reduce_dict({"rank": me, "ones": torch.ones(2, device=dev)})
    expect("all_reduce_dict", (reduced["rank"], reduced["ones"].tolist()), (float(sum(ranks)), [float(n)] * 2))
    c.barrier()


class _Mixed(nn.Module):
    """float32 and bfloat16 parameters, int64 and bool buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)
        self.head = nn.Linear(4, 2).to(torch.bfloat16)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("mask", torch.zeros(5, dtype=torch.bool))


def _gather_objects(ctx: CommContext, obj: object) -> list[object]:
    """Every rank's ``obj`` on every rank, through the library's broadcast_object_list (which, unlike torch's, needs no
    numpy)."""
    out = []
    for r in range(ctx.get_world_size()):
        box = [obj if r == ctx.get_global_rank() else None]
        collective.broadcast_object_list(box, CommMode.GLOBAL, src=r)
        out.append(box[0])
    return out


def _raw_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    buf = bytearray(flat.numel())
    if buf:
        torch.frombuffer(buf, dtype=torch.uint8).copy_(flat)
    return bytes(buf)


def _check_weight_transfer(ctx: CommContext, failures: list[str]) -> str:
    me = ctx.get_global_rank()
    torch.manual_seed(me)
    model = _Mixed()
    model.steps.random_(0, 1 << 40)
    model.mask.bernoulli_(0.5)
    broadcast_state_dict(model, bucket_bytes=64)
    # Compare raw bytes with the source's, gathered over GLOBAL: identical means bit-identical.
    blob = b"".join(_raw_bytes(t) for t in model.state_dict().values())
    blobs = _gather_objects(ctx, blob)
    src = ctx.get_transfer_source()
    dsts = [r for r in ctx.get_ranks_in_group(CommMode.WEIGHT_TRANSFER) if r != src]
    bad = [r for r in dsts if blobs[r] != blobs[src]]
    if bad:
        failures.append(f"rank {me} WEIGHT_TRANSFER broadcast_state_dict: ranks {bad} differ from source {src}")
    return (
        f"broadcast_state_dict from rank {src} to {dsts}: {'bit-identical' if not bad else 'MISMATCH'} ({len(blob)} "
        "bytes)"
    )


def run(
    args: argparse.Namespace, dist_url: str = "env://", world_size: int | None = None, rank: int | None = None
) -> int:
    """Build the layout on this rank, check it, print the report on rank 0; return the job-wide exit code."""
    ctx = CommContext()
    ctx.init_distributed_env(
        world_size=world_size, rank=rank, backend=args.backend, dist_url=dist_url, timeout=args.timeout
    )
    world, me = ctx.get_world_size(), ctx.get_global_rank()
    config = ParallelConfig(
        tensor_parallel_size=args.tp, sequence_parallel_size=args.sp, order=args.order, bind_train_data_parallel=True
    )
    ctx.init_parallel_groups(config)
    ctx.init_node_groups()
    failures: list[str] = []
    transfer = "WEIGHT_TRANSFER: skipped (a world of one rank)"
    if world > 1:
        ctx.init_weight_transfer_group(src=0, dst_ranks=list(range(1, world)))
    layout = describe_layout(ctx)
    for mode in layout:
        _check_mode(ctx, mode, failures)
    if world > 1:
        transfer = _check_weight_transfer(ctx, failures)
    # One facade collective per mode, for the report.
    sums = {}
    for mode in layout:
        t = torch.tensor([float(me)], device=ctx.get_communicator(mode).device)
        collective.all_reduce(t, mode)
        sums[mode] = int(t.item())
    views = _gather_objects(ctx, ({m: list(v.ranks) for m, v in layout.items()}, sums, failures))
    groups = {m: sorted({tuple(view[0][m]) for view in views}) for m in layout}
    for m in layout:  # every member of a group must report that same group
        for r, view in enumerate(views):
            if tuple(view[0][m]) not in groups[m] or r not in view[0][m]:
                failures.append(f"rank {r} {m}: reports group {view[0][m]}")
        covered = sorted(r for g in groups[m] for r in g)
        if covered != list(range(world)):
            failures.append(f"{m}: groups {groups[m]} do not partition the world")
    all_failures = failures + [f for view in views for f in view[2]]
    if me == 0:
        sizes = config.sizes(world)
        print(
            f"world {world}, tp {sizes['tp']}, sp {sizes['sp']}, dp {sizes['dp']}, order {config.order}, backend "
            f"{args.backend}"
        )
        width = max(map(len, layout))
        print("\nmode".ljust(width + 3) + "groups (global ranks)")
        for m in layout:
            print(m.ljust(width + 2) + " ".join(str(list(g)) for g in groups[m]))
        print(f"\nrank 0's view:\n{format_layout(layout)}")
        print("\nall_reduce(SUM of global rank) per mode, by rank:")
        print("mode".ljust(width + 2) + " ".join(f"r{r}".rjust(4) for r in range(world)))
        for m in layout:
            print(m.ljust(width + 2) + " ".join(str(view[1][m]).rjust(4) for view in views))
        print(f"\n{transfer}")
        print(f"checks: {'all passed' if not all_failures else f'{len(all_failures)} FAILED'}")
        for f in all_failures:
            print(f"  {f}")
        print(
            "LAYOUT_JSON "
            + json.dumps(
                {
                    "world_size": world,
                    "groups": {m: [list(g) for g in groups[m]] for m in layout},
                    "failures": len(all_failures),
                }
            )
        )
        sys.stdout.flush()
    ctx.destroy()
    return 1 if all_failures else 0


def _local_rank(args: argparse.Namespace, per_node: int) -> None:
    """One rank started by ``launch.run``: its simulated node's placement, then the checks; exit 1 if any failed."""
    rank = CommContext().get_global_rank()
    os.environ.update(
        {"LOCAL_RANK": str(rank % per_node), "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node)}
    )
    if run(args) != 0:
        raise SystemExit(1)


def spawn_local(args: argparse.Namespace) -> int:
    """Run ``args.nproc`` ranks on this machine, ``args.simulated_nodes`` nodes' worth."""
    if args.nproc < 1 or args.simulated_nodes < 1 or args.nproc % args.simulated_nodes:
        raise SystemExit(
            f"--nproc {args.nproc} must be a positive multiple of --simulated-nodes {args.simulated_nodes}"
        )
    try:
        launch.run(
            _local_rank,
            args.nproc,
            args,
            args.nproc // args.simulated_nodes,
            backend=args.backend,
            timeout=args.timeout,
        )
    except RuntimeError as err:  # a rank failed a check (exit code 1) or died
        print(err, file=sys.stderr)
        return 1
    return 0


def main() -> int:
    args = parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return run(args)
    return spawn_local(args)


if __name__ == "__main__":
    sys.exit(main())
