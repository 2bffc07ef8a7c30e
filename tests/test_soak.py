"""Soak: thousands of mixed collectives over three modes on 2 gloo ranks, async handles waited out of order.

Every result is compared with its value worked out here in plain torch from the inputs (each rank's input is a function
of its global rank and the step). Run with ``-s`` to see ops/s.
"""

from __future__ import annotations

import random
import time

from world import init_world

OPS = 3000
BATCH = 8  # async ops in flight at once, across modes, waited in a shuffled order


def _soak_task(rank, size, url, seed):
    import torch
    import torch.distributed as dist

    from rlightning_comm import collective

    ctx = init_world(rank, size, url, timeout=60)
    ctx.init_group([0, 1], "A")
    ctx.init_group([1, 0], "B")  # declared order: global rank 1 is group rank 0
    modes = ("GLOBAL", "A", "B")
    rng = random.Random(seed)  # the same sequence of ops on every rank
    wrong, done, kinds = [], 0, {}

    def value(r, step, n):  # global rank r's input at this step
        return torch.arange(n, dtype=torch.float32) + 1000.0 * r + step

    def launch(step):
        mode = rng.choice(modes)
        comm = ctx.get_communicator(mode)
        ranks, me, n = list(comm.ranks), comm.rank, rng.randint(1, 6)
        kind = rng.choice(
            [
                "all_reduce",
                "all_gather",
                "broadcast",
                "reduce_scatter",
                "all_to_all_single",
                "all_reduce_dict",
                "gather",
                "scatter",
            ]
        )
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind == "all_reduce":
            t = value(rank, step, n)
            return kind, collective.all_reduce(t, mode, async_op=True), t, sum(value(r, step, n) for r in ranks)
        if kind == "all_gather":
            out = torch.empty(size * n)
            return (
                kind,
                collective.all_gather(out, value(rank, step, n), mode, async_op=True),
                out,
                torch.cat([value(r, step, n) for r in ranks]),
            )
        if kind == "broadcast":
            src = rng.choice(ranks)
            t = value(rank, step, n)
            return kind, collective.broadcast(t, mode, src=src, async_op=True), t, value(src, step, n)
        if kind == "reduce_scatter":
            out = torch.empty(n)
            expected = sum(value(r, step, size * n) for r in ranks)[me * n : (me + 1) * n]
            return kind, comm.reduce_scatter(out, value(rank, step, size * n), async_op=True), out, expected
        if kind == "all_to_all_single":
            out = torch.empty(size * n)
            expected = torch.cat([value(r, step, size * n)[me * n : (me + 1) * n] for r in ranks])
            return kind, comm.all_to_all_single(out, value(rank, step, size * n), async_op=True), out, expected
        if kind == "gather":
            dst = rng.choice(ranks)
            gathered = [torch.empty(n) for _ in ranks] if rank == dst else None
            work = collective.gather(value(rank, step, n), mode, gathered, dst=dst, async_op=True)
            return kind, work, gathered, ([value(r, step, n) for r in ranks] if rank == dst else None)
        if kind == "scatter":
            src = rng.choice(ranks)
            out = torch.empty(n)
            parts = [value(r, step, n) for r in ranks] if rank == src else None
            return kind, collective.scatter(out, mode, parts, src=src, async_op=True), out, value(rank, step, n)
        got = collective.all_reduce_dict(
            {"loss": float(rank + step), "tokens": 2**24 + rank, "t": value(rank, step, n)}, mode
        )
        expected = {
            "loss": float(sum(r + step for r in ranks)),
            "tokens": float(sum(2**24 + r for r in ranks)),
            "t": sum(value(r, step, n) for r in ranks),
        }
        return kind, None, got, expected

    def same(got, expected):
        if isinstance(expected, dict):
            return got.keys() == expected.keys() and all(same(got[k], expected[k]) for k in expected)
        if isinstance(expected, list):
            return all(torch.equal(g, e) for g, e in zip(got, expected))
        if expected is None:
            return got is None
        return torch.equal(got, expected) if isinstance(expected, torch.Tensor) else got == expected

    start = time.perf_counter()
    step = 0
    while done < OPS:
        batch = [launch(step + i) for i in range(BATCH)]
        step += BATCH
        order = list(range(BATCH))
        rng.shuffle(order)  # out of order, the same shuffle on every rank
        for i in order:
            kind, work, got, expected = batch[i]
            if work is not None:
                work.wait()
            if not same(got, expected):
                wrong.append((step, kind))
        done += BATCH
    seconds = time.perf_counter() - start
    dist.barrier()
    return {"ops": done, "seconds": seconds, "wrong": wrong, "kinds": kinds}


def test_soak_mixed_ops_over_three_modes(world2):
    results = world2.run(_soak_task, 5, timeout=240)
    for rank, out in enumerate(results):
        assert out["wrong"] == [], f"rank {rank}: {len(out['wrong'])} wrong results, first {out['wrong'][:5]}"
        assert out["ops"] >= OPS and len(out["kinds"]) == 8
    slowest = max(out["seconds"] for out in results)
    print(
        f"\nsoak: {results[0]['ops']} ops over 3 modes ({BATCH} async in flight, waited out of order), 0 wrong, "
        f"{results[0]['ops'] / slowest:.0f} ops/s; {results[0]['kinds']}"
    )
