"""Added cost per call: the Python time the library spends around one collective, with no network time in it.

Each of 2 gloo ranks replaces the torch.distributed function behind the op
with a no-op, then times the facade (``collective.all_reduce(t, mode)``:
mode lookup, communicator method, validation, the call) against calling the
same no-op directly with the arguments the library passes. Added cost =
facade - direct, per call: the median over rounds of the mean of many calls
(one call is too short for a timer). Target for all_reduce of a 4-byte tensor:
at most 2 us. Also shown: broadcast, all_gather, and all_reduce with stats on.

Two clocks: the calling thread's CPU time (``time.thread_time``: what the
library spends, untouched by the time the thread waits for a core on a
shared machine) and wall time (``time.perf_counter``).

    python benchmarks/bench_overhead.py [--rounds 31] [--calls 10000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import machine, run_ranks


def _noop(*args, **kwargs):
    return None


def _time(clock, fn, calls: int) -> float:
    t0 = clock()
    for _ in range(calls):
        fn()
    return (clock() - t0) / calls * 1e6


def _task(rank: int, nproc: int, rounds: int, calls: int) -> dict[str, dict[str, list[float]]]:
    import torch
    import torch.distributed as dist

    from rlightning_comm import CommContext, CommMode, collective

    ctx = CommContext()
    group = ctx.get_group(CommMode.GLOBAL)
    t = torch.zeros(1)  # 4 bytes
    out = torch.zeros(nproc)
    SUM = dist.ReduceOp.SUM
    from rlightning_comm.communicators import base

    dist.all_reduce = dist.broadcast = dist.all_gather_into_tensor = _noop
    if hasattr(base, "_all_gather_flat"):  # bound at import where torch has all_gather_single
        base._all_gather_flat = _noop
    cases = {
        "all_reduce": (lambda: collective.all_reduce(t, CommMode.GLOBAL), lambda: _noop(t, op=SUM, group=group, async_op=False)),
        "broadcast": (lambda: collective.broadcast(t, CommMode.GLOBAL, 0), lambda: _noop(t, src=0, group=group, async_op=False)),
        "all_gather": (lambda: collective.all_gather(out, t, CommMode.GLOBAL), lambda: _noop(out, t, group=group, async_op=False)),
    }
    per_call: dict[str, dict[str, list[float]]] = {}
    for stats_on in (False, True):
        if stats_on:
            ctx.enable_stats()
            cases = {"all_reduce (stats on)": cases["all_reduce"]}
        for name, (facade, direct) in cases.items():
            per_call[name] = {}
            for clock_name, clock in (("cpu", time.thread_time), ("wall", time.perf_counter)):
                added, facade_us, direct_us = [], [], []
                for _ in range(rounds):
                    f, d = _time(clock, facade, calls), _time(clock, direct, calls)
                    facade_us.append(f)
                    direct_us.append(d)
                    added.append(f - d)
                per_call[name][clock_name] = [statistics.median(added), statistics.median(facade_us), statistics.median(direct_us), min(added)]
    ctx.disable_stats()
    ctx.reset_stats()
    return per_call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--calls", type=int, default=10000)
    args = p.parse_args()
    res = run_ranks(_task, 2, args.rounds, args.calls)
    print(f"# added cost per call, 2 gloo ranks, backend call replaced by a no-op; {machine()}")
    print(f"# median over {args.rounds} rounds of the mean of {args.calls} calls; figures of rank 0 (rank 1 in brackets)")
    print(f"{'op':<24} {'clock':>5} {'added us':>9} {'facade us':>10} {'direct us':>10} {'min added':>10} {'rank 1 added':>13}")
    for name, clocks in res[0].items():
        for clock, (added, f, d, lo) in clocks.items():
            print(f"{name:<24} {clock:>5} {added:>9.3f} {f:>10.3f} {d:>10.3f} {lo:>10.3f} {res[1][name][clock][0]:>13.3f}")


if __name__ == "__main__":
    main()
