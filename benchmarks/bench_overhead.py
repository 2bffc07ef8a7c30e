"""Added cost per call, hot loop: the Python time around one collective, with no network time in it (the second figure).

The headline figure is the cold per-call ratio of ``bench_cold.py``; this one isolates the Python. Each of 2 gloo ranks
replaces the process group's methods (``allreduce``, ``broadcast``, ``all_gather_single``) with a stub that returns an
already completed work, then times, in a tight loop: the facade (``collective.all_reduce(t, mode)``: mode lookup,
communicator method, checks, the one-call claim, the launch), raw torch.distributed (``dist.all_reduce(t, group=pg)``)
and the stubbed process-group call alone (``pg.allreduce([t], opts).wait()``). Added cost = path - stub, per call: the
median over rounds of the mean of many calls (one call is too short for a timer). Target for all_reduce of a 4-byte
tensor: at most 2 us, and below torch.distributed's own. Also shown: broadcast, all_gather, and all_reduce with stats
on.

Two clocks: the calling thread's CPU time (``time.thread_time``: what the library spends, untouched by the time the
thread waits for a core on a shared machine) and wall time (``time.perf_counter``).

    python benchmarks/bench_overhead.py [--rounds 31] [--calls 10000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import machine, run_ranks


class _Done:
    """A completed work."""

    def wait(self, *args, **kwargs):
        return True


_DONE = _Done()


def _stub(*args, **kwargs):
    return _DONE


def _time(clock, fn, calls: int) -> float:
    t0 = clock()
    for _ in range(calls):
        fn()
    return (clock() - t0) / calls * 1e6


def _task(rank: int, nproc: int, rounds: int, calls: int) -> dict[str, dict[str, list[float]]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import AllgatherOptions

    from rlightning_comm import CommContext, CommMode, collective

    ctx = CommContext()
    pg = ctx.get_group(CommMode.GLOBAL)
    t = torch.zeros(1)  # 4 bytes
    out = torch.zeros(nproc)
    ar, bc, ag = dist.AllreduceOptions(), dist.BroadcastOptions(), AllgatherOptions()
    # Stubs on the class: every path (ours, torch's) reaches the backend through these methods.
    for name in ("allreduce", "broadcast", "all_gather_single"):
        setattr(dist.ProcessGroup, name, _stub)
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    cases = {
        "all_reduce": (
            lambda: collective.all_reduce(t, CommMode.GLOBAL),
            lambda: dist.all_reduce(t, group=pg),
            lambda: pg.allreduce([t], ar).wait(),
        ),
        "broadcast": (
            lambda: collective.broadcast(t, CommMode.GLOBAL, 0),
            lambda: dist.broadcast(t, 0, group=pg),
            lambda: pg.broadcast([t], bc).wait(),
        ),
        "all_gather": (
            lambda: collective.all_gather(out, t, CommMode.GLOBAL),
            lambda: all_gather_single(out, t, group=pg),
            lambda: pg.all_gather_single(out, t, ag).wait(),
        ),
    }
    per_call: dict[str, dict[str, list[float]]] = {}
    for stats_on in (False, True):
        if stats_on:
            ctx.enable_stats()
            cases = {"all_reduce (stats on)": cases["all_reduce"]}
        for name, (facade, raw, stub) in cases.items():
            per_call[name] = {}
            for clock_name, clock in (("cpu", time.thread_time), ("wall", time.perf_counter)):
                ours, torch_s, base = [], [], []
                for _ in range(rounds):
                    f, r, b = _time(clock, facade, calls), _time(clock, raw, calls), _time(clock, stub, calls)
                    ours.append(f - b)
                    torch_s.append(r - b)
                    base.append(b)
                per_call[name][clock_name] = [
                    statistics.median(ours),
                    statistics.median(torch_s),
                    statistics.median(base),
                ]
    ctx.disable_stats()
    ctx.reset_stats()
    return per_call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--calls", type=int, default=10000)
    args = p.parse_args()
    res = run_ranks(_task, 2, args.rounds, args.calls)
    print(f"# added cost per call, hot loop, 2 gloo ranks, process-group methods stubbed; {machine()}")
    print(
        f"# median over {args.rounds} rounds of the mean of {args.calls} calls; rank 0 (rank 1's library figure in "
        "brackets)"
    )
    print(
        f"{'op':<24} {'clock':>5} {'library added us':>17} {'torch.distributed added us':>27} {'stub call us':>13} "
        f"{'rank 1 library':>15}"
    )
    for name, clocks in res[0].items():
        for clock, (ours, raw, base) in clocks.items():
            print(f"{name:<24} {clock:>5} {ours:>17.3f} {raw:>27.3f} {base:>13.3f} {res[1][name][clock][0]:>15.3f}")


if __name__ == "__main__":
    main()
