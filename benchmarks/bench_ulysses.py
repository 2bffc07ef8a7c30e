"""Time the Ulysses all-to-all on gloo: ``rlightning_comm.sequence_parallel.all_to_all`` against the seed's list of chunks.

The seed re-sharded ``[batch, seq/P, heads, head_dim]`` to ``[batch, seq, heads/P, head_dim]``
with ``torch.distributed.all_to_all`` on a list of ``.contiguous()`` chunks, then
``torch.cat``. Ours packs one contiguous buffer and makes one ``all_to_all_single``.
Both run in the same processes, interleaved (the order alternates every
iteration), on the same input; each iteration's time is the slowest rank's;
the table shows medians over many iterations and the ratio ours / seed.

    PYTHONPATH=. python benchmarks/bench_ulysses.py [--nprocs 2] [--batch 1]

"ours" passes ``gather_sizes`` (the steady state: the lengths are known);
"ours+exchange" lets the op exchange the lengths itself (one more small
collective), the default when they are not given.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlightning_comm.sequence_parallel import all_to_all

HEADS, HEAD_DIM = 16, 64
# Bytes of float32 input per rank: small (latency-bound) to tens of MB (bandwidth-bound).
SIZES = [4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20]


def seed_all_to_all(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """The seed's forward: chunks along the heads, a list all_to_all, a cat along the sequence."""
    inputs = [t.contiguous() for t in x.chunk(world_size, dim=2)]
    outputs = [torch.empty_like(t) for t in inputs]
    dist.all_to_all(outputs, inputs)
    return torch.cat(outputs, dim=1)


def _iterations(nbytes: int) -> int:
    return 1000 if nbytes <= 64 << 10 else 200 if nbytes <= 1 << 20 else 60


def bench(rank: int, world_size: int, url: str, batch: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size)
    group = dist.group.WORLD
    methods = {
        "seed": lambda x, lens: seed_all_to_all(x, world_size),
        "ours": lambda x, lens: all_to_all(x, 1, 2, group, gather_sizes=lens),
        "ours+exchange": lambda x, lens: all_to_all(x, 1, 2, group),
    }
    if rank == 0:
        print(f"world size {world_size}, batch {batch}, heads {HEADS}, head_dim {HEAD_DIM}, float32, gloo")
        print(
            f"{'bytes/rank':>11} {'local shape':>22} {'iters':>5} "
            + " ".join(f"{m + ' ms':>16}" for m in methods)
            + f" {'ours/seed':>10} {'ours+exch/seed':>15}"
        )
    for nbytes in SIZES:
        seq_local = max(1, nbytes // (4 * batch * HEADS * HEAD_DIM))
        lens = [seq_local] * world_size
        x = torch.randn(batch, seq_local, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(rank))
        want = seed_all_to_all(x, world_size)
        for name, fn in methods.items():  # same result, and a warm-up
            if not torch.equal(fn(x, lens), want):
                raise RuntimeError(f"{name} disagrees with the seed's all_to_all at {nbytes} bytes")
        iters = _iterations(nbytes)
        times: dict[str, list[float]] = {m: [] for m in methods}
        order = list(methods)
        for i in range(iters):
            for name in order if i % 2 == 0 else order[::-1]:
                dist.barrier()
                t0 = time.perf_counter()
                methods[name](x, lens)
                times[name].append(time.perf_counter() - t0)
        # The collective takes as long as its slowest rank.
        table = torch.tensor([times[m] for m in methods], dtype=torch.float64)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
        if rank == 0:
            med = {m: statistics.median(row) * 1e3 for m, row in zip(methods, table.tolist())}
            shape = str((batch, seq_local, HEADS, HEAD_DIM))
            cells = " ".join(f"{med[m]:16.3f}" for m in methods)
            print(f"{nbytes:>11} {shape:>22} {iters:>5} {cells} {med['ours'] / med['seed']:10.2f} {med['ours+exchange'] / med['seed']:15.2f}", flush=True)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} cpu(s), {time.strftime('%Y-%m-%d %H:%M')}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(bench, args=(args.nprocs, f"file://{tmp}/store", args.batch), nprocs=args.nprocs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
