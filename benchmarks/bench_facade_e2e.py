"""End to end: ``collective.all_reduce`` against raw ``torch.distributed.all_reduce`` on the same tensors, 2 gloo ranks.

Rounds are interleaved (which path goes first alternates); in each round each path makes ``calls`` calls after a
barrier, timed together. Reported per size: the median over rounds of the per-call time of each path and the median of
the per-round ratio facade/raw. Target: within noise at 4 bytes and at 16 MiB (no extra copies of the payload).

    python benchmarks/bench_facade_e2e.py [--rounds 21]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import machine, run_ranks

SIZES = {"4 B": (1, 400), "16 MiB": (4 * 2**20, 4)}  # float32 elements, calls per round


def _task(rank: int, nproc: int, rounds: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    from rlightning_comm import CommMode, collective

    out = {}
    for label, (numel, calls) in SIZES.items():
        t = torch.ones(numel)
        paths = {
            "facade": lambda t=t: collective.all_reduce(t, CommMode.GLOBAL),
            "raw": lambda t=t: dist.all_reduce(t),
        }
        for fn in paths.values():  # warm-up
            for _ in range(calls):
                fn()
        per_call: dict[str, list[float]] = {"facade": [], "raw": []}
        ratios = []
        for r in range(rounds):
            order = ("facade", "raw") if r % 2 == 0 else ("raw", "facade")
            for name in order:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    paths[name]()
                per_call[name].append((time.perf_counter() - t0) / calls * 1e6)
            ratios.append(per_call["facade"][-1] / per_call["raw"][-1])
        out[label] = [
            statistics.median(per_call["facade"]),
            statistics.median(per_call["raw"]),
            statistics.median(ratios),
            min(ratios),
            max(ratios),
        ]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=21)
    args = p.parse_args()
    res = run_ranks(_task, 2, args.rounds)
    print(f"# facade vs raw all_reduce, 2 gloo ranks, {args.rounds} interleaved rounds; {machine()}")
    print(
        f"{'size':<8} {'facade us':>10} {'raw us':>10} {'median ratio':>13} {'min..max ratio':>16} {'rank 1 ratio':>13}"
    )
    for label, (f, r, ratio, lo, hi) in res[0].items():
        print(f"{label:<8} {f:>10.1f} {r:>10.1f} {ratio:>13.3f} {lo:>7.3f}..{hi:<7.3f} {res[1][label][2]:>13.3f}")


if __name__ == "__main__":
    main()
