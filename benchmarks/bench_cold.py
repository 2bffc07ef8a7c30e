"""Cold per-call cost: every tensor collective through the library against raw torch.distributed, as a training loop
calls them.

Between two collectives a training loop waits on the backend, so every call starts cold. Here each call runs alone right
after a barrier (not timed), and the library's call (``collective.<op>(..., mode)``: mode lookup, checks, launch) and
the raw call (``torch.distributed.<op>(..., group=group)``) alternate on the same buffers, swapping which goes first
every round, so both see the same machine. Per op and size: the median of each side over ``--rounds`` calls on every
rank, and library / raw of the slowest rank's medians, in wall time and in the calling thread's CPU time (which a loaded
machine does not inflate).

The barrier is the process group's own (``pg.barrier().wait()``, C++ only) by default, so it warms neither side's
Python. ``--sync dist`` uses ``torch.distributed.barrier`` instead, as the first version of this benchmark
did: its Python shares helpers with the raw side (the exception-logging
wrapper, ``_rank_not_in_group``, the default-group lookup), so it runs them just before each raw call and the raw side
starts warmer.

    python benchmarks/bench_cold.py [--ranks 2,4] [--rounds 300] [--sizes 4,8192,1048576] [--sync pg|dist]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _common import machine, run_ranks

OPS = ("all_reduce", "all_gather", "broadcast", "gather", "scatter", "reduce_scatter", "all_to_all_single", "barrier")


def _cases(op: str, nbytes: int, rank: int, n: int):
    """(library call, raw call) on shared buffers; sizes are bytes per rank's chunk (float32)."""
    import torch
    import torch.distributed as dist

    from rlightning_comm import CommContext, collective
    from rlightning_comm._compat import all_gather_single, reduce_scatter_single

    group = CommContext().get_group("GLOBAL")
    m = max(1, nbytes // 4)
    chunk = torch.full((m,), float(rank + 1))
    many = torch.empty(n * m)
    spread = torch.full((n * m,), float(rank))
    chunks = [torch.empty(m) for _ in range(n)] if rank == 0 else None
    comm = CommContext().get_communicator("GLOBAL")
    return {
        "all_reduce": (lambda: collective.all_reduce(chunk, "GLOBAL"), lambda: dist.all_reduce(chunk, group=group)),
        "all_gather": (
            lambda: collective.all_gather(many, chunk, "GLOBAL"),
            lambda: all_gather_single(many, chunk, group=group),
        ),
        "broadcast": (lambda: collective.broadcast(chunk, "GLOBAL", 0), lambda: dist.broadcast(chunk, 0, group=group)),
        "gather": (
            lambda: collective.gather(chunk, "GLOBAL", chunks, 0),
            lambda: dist.gather(chunk, chunks, 0, group=group),
        ),
        "scatter": (
            lambda: collective.scatter(chunk, "GLOBAL", chunks, 0),
            lambda: dist.scatter(chunk, chunks, 0, group=group),
        ),
        "reduce_scatter": (
            lambda: comm.reduce_scatter(chunk, many),
            lambda: reduce_scatter_single(chunk, many, group=group),
        ),
        "all_to_all_single": (
            lambda: comm.all_to_all_single(many, spread),
            lambda: dist.all_to_all_single(many, spread, group=group),
        ),
        "barrier": (lambda: collective.barrier("GLOBAL"), lambda: dist.barrier(group=group)),
    }[op], group


def _task(
    rank: int, n: int, ops: tuple[str, ...], sizes: tuple[int, ...], rounds: int, warmup: int, sync_with: str
) -> dict[tuple[str, int], tuple[float, ...]]:
    import torch.distributed as dist

    out = {}
    for op in ops:
        for nbytes in sizes if op != "barrier" else sizes[:1]:
            (lib, raw), group = _cases(op, nbytes, rank, n)
            sync = (
                (lambda g=group: g.barrier().wait()) if sync_with == "pg" else (lambda g=group: dist.barrier(group=g))
            )
            wall: dict[str, list[float]] = {"lib": [], "raw": []}
            cpu: dict[str, list[float]] = {"lib": [], "raw": []}
            for i in range(warmup + rounds):
                for side, fn in (("lib", lib), ("raw", raw)) if i & 1 else (("raw", raw), ("lib", lib)):
                    sync()
                    c0, t0 = time.thread_time(), time.perf_counter()
                    fn()
                    t1, c1 = time.perf_counter(), time.thread_time()
                    if i >= warmup:
                        wall[side].append(t1 - t0)
                        cpu[side].append(c1 - c0)
            out[(op, nbytes)] = tuple(statistics.median(d[side]) for d in (wall, cpu) for side in ("lib", "raw"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,4", help="world sizes to run, comma-separated (default 2,4)")
    p.add_argument("--rounds", type=int, default=300, help="timed calls per side, op and size (default 300)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--sizes", default="4,8192,1048576", help="bytes per rank's chunk (default 4 B, 8 KiB, 1 MiB)")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument(
        "--sync",
        choices=("pg", "dist"),
        default="pg",
        help="barrier between calls: the process group's own (default) or torch.distributed's",
    )
    args = p.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    ops = tuple(args.ops.split(","))
    load = os.getloadavg()
    print(f"# cold per-call cost, library / raw torch.distributed, gloo; {machine()}")
    barrier = "pg.barrier().wait()" if args.sync == "pg" else "torch.distributed.barrier"
    print(
        f"# each call alone after a barrier ({barrier}), sides interleaved on the same buffers; medians of "
        f"{args.rounds} calls; slowest rank's medians"
    )
    print(f"# load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(
        "# wall: perf_counter around the call; cpu: the calling thread's CPU time in the call (what the load does not "
        "inflate)"
    )
    print(
        f"{'ranks':>5} {'op':<18} {'bytes':>8} {'library us':>11} {'raw us':>9} {'lib/raw':>8} {'lib-raw us':>11} "
        f"{'cpu lib us':>11} {'cpu raw us':>11} {'cpu lib/raw':>11}"
    )
    for n in (int(r) for r in args.ranks.split(",")):
        res = run_ranks(_task, n, ops, sizes, args.rounds, args.warmup, args.sync)
        for key in res[0]:
            lib, raw, cpu_lib, cpu_raw = (max(r[key][j] for r in res) for j in range(4))
            op, nbytes = key
            print(
                f"{n:>5} {op:<18} {nbytes if op != 'barrier' else '-':>8} {lib * 1e6:>11.1f} {raw * 1e6:>9.1f} "
                f"{lib / raw:>8.3f} {(lib - raw) * 1e6:>11.1f} "
                f"{cpu_lib * 1e6:>11.1f} {cpu_raw * 1e6:>11.1f} {cpu_lib / cpu_raw:>11.3f}",
                flush=True,
            )
    load = os.getloadavg()
    print(f"# load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
