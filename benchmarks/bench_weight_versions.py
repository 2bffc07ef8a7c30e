"""Versions, verification and relay: ``broadcast_state_dict`` star against relay, ``verify`` and ``atomic`` against a
plain sync, and seeding a newcomer from a peer, on 1 to 4 engines, in one run per engine count.

1 trainer (rank 0) and E engines (ranks 1..E), gloo, one process each, a model of 121 tensors (a bf16 embedding 4096 x
256, 60 fp32 matrices 256 x 256 and their biases, about 17.8 MiB). Ways, interleaved per round (the order rotates each
round, two warm-up rounds first); a round's time for a way is the slowest rank's:

* star: ``broadcast_state_dict(state, fanout="star")``: the source sends every unit to every engine;
* relay: ``fanout="chain"``: the source sends each unit once, the engines forward it down a chain; a relay acknowledges
  the whole transfer only once its successor has, so the trainer returns only when the last engine holds everything;
* verify: the relay with ``verify=True`` (per-tensor digests computed as the bytes pass, one more round);
* atomic: the relay with ``atomic=True`` and a version (staging, verify, the commit through the world's store);
* seed: engine 1 sends the model to engine E over a group of the two (the trainer takes no part); with E = 1, the
  trainer's sync to engine 1 over the same kind of group ("seed" then stands for "a sync from the trainer");
* limit: one ``torch.distributed.broadcast`` of a flat buffer of the same bytes over the whole group.

Trainer egress is counted from the reports (``sum(report.sent.values())`` on rank 0), not from time. With one engine
there is no relay (relay and star are one path). The second table puts the trainer's own call time in a relay beside the
slowest rank's: the end-to-end receipt makes them end together.

    python benchmarks/bench_weight_versions.py [--engines 1,2,3,4] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _common import machine, run_ranks

LAYERS = 60
WIDTH = 256
VOCAB = 4096
EMBED = 256


def _model(seed: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    state = {"embed.weight": torch.randn(VOCAB, EMBED, generator=gen).to(torch.bfloat16)}
    for i in range(LAYERS):
        state[f"layers.{i}.weight"] = torch.randn(WIDTH, WIDTH, generator=gen)
        state[f"layers.{i}.bias"] = torch.randn(WIDTH, generator=gen)
    return state


def _task(rank: int, nproc: int, rounds: int) -> dict:
    import torch
    import torch.distributed as dist

    from rlightning_comm import CommContext, broadcast_state_dict

    torch.set_num_threads(1)
    engines = nproc - 1
    ctx = CommContext()
    ctx.init_group(list(range(nproc)), "SYNC")
    pair = [1, engines] if engines > 1 else [0, 1]
    ctx.init_group(pair, "SEED")
    group = ctx.get_group("SYNC")
    state = _model(seed=rank)
    total = sum(t.numel() * t.element_size() for t in state.values())
    flat = torch.empty(total, dtype=torch.uint8)
    version = [0]
    egress: dict[str, int] = {}

    def sync(name: str, **kw):
        def run() -> None:
            report = broadcast_state_dict(state, "SYNC", src=0, **kw)
            if rank == 0:
                egress[name] = sum(report.sent.values())

        return run

    def atomic() -> None:
        version[0] += 1
        broadcast_state_dict(state, "SYNC", src=0, fanout="chain", version=version[0], atomic=True)

    def seed() -> None:
        if rank in pair:
            broadcast_state_dict(state, "SEED", src=pair[0])

    def limit() -> None:
        dist.broadcast(flat, src=0, group=group)

    ways = {
        "star": sync("star", fanout="star"),
        "relay": sync("relay", fanout="chain"),
        "verify": sync("verify", fanout="chain", verify=True),
        "atomic": atomic,
        "seed": seed,
        "limit": limit,
    }
    names = list(ways)
    times: dict[str, list[float]] = {name: [] for name in names}
    trainer: dict[str, list[float]] = {name: [] for name in names}  # rank 0's own call time
    for r in range(rounds + 2):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier(group=group)
            t0 = time.perf_counter()
            ways[name]()
            mine = time.perf_counter() - t0
            elapsed = torch.tensor([mine], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            if r >= 2:
                times[name].append(elapsed.item())
                trainer[name].append(mine)
    reference = _model(seed=0)
    identical = all(torch.equal(state[k], reference[k]) for k in reference)
    return {"times": times, "trainer": trainer, "egress": egress, "bytes": total, "identical": identical}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="1,2,3,4", help="comma-separated engine counts, one run each")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    started = time.perf_counter()
    print(f"{machine()}; load before: {os.getloadavg()}; {args.rounds} interleaved rounds per engine count")
    print()
    print(
        "| engines | trainer egress star / relay (MiB, reports) | star ms | relay ms | relay vs star | verify vs relay "
        "| atomic vs relay | seed from a peer ms | relay vs limit | bit-identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    receipts = []
    for engines in (int(e) for e in args.engines.split(",")):
        out = run_ranks(_task, engines + 1, args.rounds)[0]
        t, mib, own = out["times"], 2**20, out["trainer"]
        receipts.append(
            f"| {engines} | {statistics.median(own['relay']) * 1e3:.1f} | {statistics.median(t['relay']) * 1e3:.1f} "
            f"| {statistics.median(x / y for x, y in zip(own['relay'], t['relay'])):.2f}x |"
        )

        def med(name: str, t: dict = t) -> float:
            return statistics.median(t[name]) * 1e3

        def ratio(a: str, b: str, t: dict = t) -> float:
            return statistics.median(x / y for x, y in zip(t[a], t[b]))

        print(
            f"| {engines} | {out['egress']['star'] / mib:.1f} / {out['egress']['relay'] / mib:.1f} | {med('star'):.1f} "
            f"| {med('relay'):.1f} | {ratio('star', 'relay'):.2f}x faster | {ratio('verify', 'relay'):.2f}x time "
            f"| {ratio('atomic', 'relay'):.2f}x time | {med('seed'):.1f} | {ratio('limit', 'relay'):.2f}x "
            f"| {'yes' if out['identical'] else 'NO'} |"
        )
    print()
    print(
        "| engines | trainer's call, relay (ms) | slowest rank, relay (ms) | trainer's call vs slowest rank (x time) |"
    )
    print("|---|---|---|---|")
    print("\n".join(receipts))
    print()
    wall = time.perf_counter() - started
    print(f"model {out['bytes'] / 2**20:.1f} MiB; wall {wall:.0f} s; load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
