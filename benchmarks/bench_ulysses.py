"""Ulysses on gloo: the seed's 4-argument ``all_to_all`` against the seed's list of chunks, and a compiled block.

Part 1 re-shards ``[batch, seq/P, heads, head_dim]`` to ``[batch, seq, heads/P, head_dim]``: "seed" is the seed's way
(``torch.distributed.all_to_all`` on a list of ``.contiguous()`` chunks, then ``torch.cat``), "ours" is
``rlightning_comm.sequence_parallel.all_to_all(x, 1, 2, group)`` (the seed's call, default lengths: one
``all_to_all_single``, no length exchange), with a ``ProcessGroup`` and with a mode name. Same processes, same input,
interleaved (the order alternates every iteration); each iteration's time is the slowest rank's; medians over many
iterations, and the ratio ours / seed.

Part 2 times a training step (forward and backward) of a two-layer Ulysses attention block (projections,
``ulysses_attention``, MLP), eager against ``torch.compile(..., backend="inductor", fullgraph=True)``: the median step
time of each, and the compile time (the first compiled step, minus a steady one).

    PYTHONPATH=. python benchmarks/bench_ulysses.py [--nprocs 2] [--no-block]
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

from rlightning_comm import CommContext
from rlightning_comm.sequence_parallel import _collectives as C
from rlightning_comm.sequence_parallel import all_to_all, ulysses_attention
from rlightning_comm.sequence_parallel._resolve import TracedGroup

SHAPES = [(1, 64, 8, 16), (1, 512, 16, 64), (1, 4096, 16, 64)]  # local [batch, seq/P, heads, head_dim], float32
SP = "SEQUENCE_PARALLEL"


def seed_all_to_all(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """The seed's forward: chunks along the heads, a list all_to_all, a cat along the sequence."""
    inputs = [t.contiguous() for t in x.chunk(world_size, dim=2)]
    outputs = [torch.empty_like(t) for t in inputs]
    dist.all_to_all(outputs, inputs)
    return torch.cat(outputs, dim=1)


def _iterations(nbytes: int) -> int:
    return 1500 if nbytes <= 64 << 10 else 100 if nbytes <= 4 << 20 else 30


def _slowest(times: dict[str, list[float]]) -> dict[str, float]:
    """Median over iterations of the slowest rank's time, per method, in ms."""
    table = torch.tensor(list(times.values()), dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return {m: statistics.median(row) * 1e3 for m, row in zip(times, table.tolist())}


def bench_all_to_all(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    traced = TracedGroup(group.group_name, world_size, rank)

    def functional(x: torch.Tensor) -> torch.Tensor:
        # The compiled path's primitives run eagerly: the same packing, the functional collective instead of the
        # communicator.
        h = x.shape[2] // world_size
        return C.all_to_all([x], 2, [[h] * world_size], 1, [[x.shape[1]] * world_size], traced)[0]

    methods = {
        "seed": lambda x: seed_all_to_all(x, world_size),
        "ours (ProcessGroup)": lambda x: all_to_all(x, 1, 2, group),
        "ours (mode)": lambda x: all_to_all(x, 1, 2, SP),
        "funcol eager": functional,
    }
    if rank == 0:
        print(
            f"\nPart 1: the seed's all_to_all(x, 1, 2, group) vs its list of chunks; world size {world_size}, float32, "
            "gloo"
        )
        head = " ".join(f"{m + ' ms':>22}" for m in methods)
        print(
            f"{'local shape':>20} {'bytes/rank':>11} {'iters':>5} {head} {'PG/seed':>8} {'mode/seed':>9} "
            f"{'funcol/PG':>9}"
        )
    for shape in SHAPES:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(rank))
        want = seed_all_to_all(x, world_size)
        for name, fn in methods.items():  # same result, and a warm-up
            if not torch.equal(fn(x), want):
                raise RuntimeError(f"{name} disagrees with the seed's all_to_all for {shape}")
        nbytes = x.numel() * 4
        iters = _iterations(nbytes)
        times: dict[str, list[float]] = {m: [] for m in methods}
        order = list(methods)
        for i in range(iters):
            for name in order if i % 2 == 0 else order[::-1]:
                dist.barrier()
                t0 = time.perf_counter()
                methods[name](x)
                times[name].append(time.perf_counter() - t0)
        med = _slowest(times)
        if rank == 0:
            cells = " ".join(f"{med[m]:22.4f}" for m in methods)
            pg, mode = med["ours (ProcessGroup)"] / med["seed"], med["ours (mode)"] / med["seed"]
            funcol = med["funcol eager"] / med["ours (ProcessGroup)"]
            print(f"{shape!s:>20} {nbytes:>11} {iters:>5} {cells} {pg:8.2f} {mode:9.2f} {funcol:9.2f}", flush=True)


class Block(torch.nn.Module):
    """Pre-norm attention (ulysses_attention) and MLP, on ``[batch, seq/P, dim]``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.o = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        x = x + self.o(ulysses_attention(q, k, v, mode=SP, is_causal=True).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


def bench_block(rank: int, world_size: int, seq: int, dim: int, heads: int, steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(dim, heads), Block(dim, heads))
    x = torch.randn(1, seq // world_size, dim, generator=torch.Generator().manual_seed(rank))

    def step(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn(x).square().mean().backward()
        return time.perf_counter() - t0

    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    first = step(compiled)
    for _ in range(3):
        step(model)
        step(compiled)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for i in range(steps):
        for name in ("eager", "compiled") if i % 2 == 0 else ("compiled", "eager"):
            times[name].append(step(model if name == "eager" else compiled))
    med = _slowest(times)
    first_t = torch.tensor([first], dtype=torch.float64)
    dist.all_reduce(first_t, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(
            f"\nPart 2: two-layer Ulysses block, forward+backward, seq {seq} (local {seq // world_size}), dim {dim}, "
            f"{heads} heads, float32"
        )
        print(f"{'eager ms':>10} {'compiled ms':>12} {'compiled/eager':>15} {'compile s':>10} {'steps':>6}")
        compile_s = first_t.item() - med["compiled"] / 1e3
        print(
            f"{med['eager']:10.3f} {med['compiled']:12.3f} {med['compiled'] / med['eager']:15.2f} {compile_s:10.1f} "
            f"{steps:>6}",
            flush=True,
        )


def main_worker(rank: int, world_size: int, url: str, block: bool) -> None:
    torch.set_num_threads(1)
    ctx = CommContext()
    ctx.init_distributed_env(world_size=world_size, rank=rank, backend="gloo", dist_url=url, timeout=600)
    ctx.init_group(list(range(world_size)), SP)
    bench_all_to_all(rank, world_size)
    if block:
        bench_block(rank, world_size, seq=512, dim=128, heads=8, steps=20)
    ctx.destroy()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--no-block", action="store_true", help="skip part 2 (the compiled block)")
    args = parser.parse_args()
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} cpu(s), "
        f"{time.strftime('%Y-%m-%d %H:%M')}, load {load[0]:.2f}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(main_worker, args=(args.nprocs, f"file://{tmp}/store", not args.no_block), nprocs=args.nprocs)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
