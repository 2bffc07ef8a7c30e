"""``reshard_state_dict`` from an FSDP-sharded trainer to a tensor-parallel engine: bytes, time, and the planner alone.

4 gloo ranks in one world: ranks 0 and 1 are the trainer, each holding its ``Shard(0)`` rows of every tensor (FSDP2's
layout, as ``TensorSlice``), ranks 2 and 3 the engine in TP=2 (the first matrix of each layer column-parallel, the
second row-parallel, so the second's blocks cross the trainer's row shards). The model: 8 layers of two fp32 1024 x 1024
matrices and a 1024 bias, 64.0 MiB. Ways, interleaved in rotating order (a round's time is the slowest rank's, from a
barrier to every engine rank holding its shards):

* library: ``reshard_state_dict`` (steady state: the plan kept);
* limit: each trainer sends each engine rank exactly the bytes the plan sends it, as one ready contiguous buffer, with
  raw ``isend``/``irecv`` (no packing, no handshake);
* pieces: hand-written raw ``isend``/``irecv`` of the very pieces the library moves: each contiguous block straight from
  the trainer's tensor into the engine's, each strided block (the row-parallel matrices' column halves) packed by the
  trainer into a buffer first, the biases in one buffer per pair; no agreement and no receipts. What the same bytes in
  the same messages cost, with the one copy a strided block needs;
* protocol: the pieces with what the library's protocol adds, by hand: before them one round of 17 words per rank
  through rank 0 (the agreement of a kept plan), after them one receipt per pair that the trainer waits for (what the
  library's Python and bookkeeping leave out);
* verify, atomic: the library with ``verify=True``, and with ``atomic=True`` and a new version each round;
* gather + broadcast: the status quo: trainer rank 1 sends its rows to trainer rank 0 (raw ``send``/``recv`` per
  tensor), rank 0 ``broadcast_state_dict``s the full model to both engine ranks, each copies its shard out of it.

Bytes come from the reports, checked against the engines' wanted bytes; every engine shard is checked bit-identical to
the full model sliced first. Then the planner in one process: 1,000 tensors, 8 holders (2 data-parallel replicas x 4
FSDP row shards), 16 wanters (2 engine replicas x TP 8, half the tensors column-, half row-parallel): the plan's time
(cold), and the local cost of a repeat call (reading the arguments and comparing their metadata with the kept plan's;
the repeat then exchanges one fingerprint).

    python benchmarks/bench_reshard.py [--rounds 10] [--bucket-mib 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from _common import machine, run_ranks

LAYERS, WIDTH = 8, 1024


def _full(seed: int = 0) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        out[f"l{i}.up"] = torch.randn(WIDTH, WIDTH, generator=gen)
        out[f"l{i}.down"] = torch.randn(WIDTH, WIDTH, generator=gen)
        out[f"l{i}.bias"] = torch.randn(WIDTH, generator=gen)
    return out


def _task(rank: int, nproc: int, rounds: int, bucket_bytes: int, threads: int) -> dict:
    import torch
    import torch.distributed as dist

    from rlightning_comm import CommContext, TensorSlice, broadcast_state_dict, reshard_state_dict

    if threads:
        torch.set_num_threads(threads)
    ctx = CommContext()
    ctx.init_group([0, 1, 2, 3], "RESHARD")
    ctx.init_group([0, 2, 3], "BROADCAST")
    full = _full()
    held = wanted = None
    engine: dict[str, torch.Tensor] = {}
    if rank < 2:
        held = {}
        for name, t in full.items():
            rows = t.shape[0] // 2
            held[name] = TensorSlice(
                t[rank * rows : (rank + 1) * rows].clone(), (rank * rows,) + (0,) * (t.dim() - 1), tuple(t.shape)
            )
    else:
        r = rank - 2
        wanted = {}
        for name, t in full.items():
            if name.endswith(".down"):  # row-parallel: a column block
                engine[name] = torch.zeros(WIDTH, WIDTH // 2)
                wanted[name] = TensorSlice(engine[name], (0, r * WIDTH // 2), tuple(t.shape))
            elif name.endswith(".up"):  # column-parallel: a row block
                engine[name] = torch.zeros(WIDTH // 2, WIDTH)
                wanted[name] = TensorSlice(engine[name], (r * WIDTH // 2, 0), tuple(t.shape))
            else:  # replicated
                engine[name] = torch.zeros(WIDTH)
                wanted[name] = TensorSlice(engine[name], (0,), tuple(t.shape))

    def expected(name: str) -> torch.Tensor:
        t, r = full[name], rank - 2
        if name.endswith(".down"):
            return t[:, r * WIDTH // 2 : (r + 1) * WIDTH // 2]
        if name.endswith(".up"):
            return t[r * WIDTH // 2 : (r + 1) * WIDTH // 2]
        return t

    def identical() -> bool:
        return all(torch.equal(engine[n].view(torch.uint8), expected(n).contiguous().view(torch.uint8)) for n in engine)

    first = reshard_state_dict(held=held, wanted=wanted, comm_mode="RESHARD", bucket_bytes=bucket_bytes)
    ok = {"library": identical()}
    report = reshard_state_dict(held=held, wanted=wanted, comm_mode="RESHARD", bucket_bytes=bucket_bytes)
    wanted_bytes = sum(t.numel() * t.element_size() for t in engine.values())

    # The limit: the planned bytes per pair, one ready buffer each.
    sent_buffers = {peer: torch.empty(n, dtype=torch.uint8) for peer, n in report.sent.items()}
    recv_buffers = {peer: torch.empty(n, dtype=torch.uint8) for peer, n in report.received.items()}

    def limit() -> None:
        works = [dist.isend(b, dst=p) for p, b in sent_buffers.items()]
        works += [dist.irecv(b, src=p) for p, b in recv_buffers.items()]
        for w in works:
            w.wait()

    def library() -> None:
        reshard_state_dict(held=held, wanted=wanted, comm_mode="RESHARD", bucket_bytes=bucket_bytes)

    half = WIDTH // 2
    downs = [n for n in full if n.endswith(".down")]
    packed = {e: torch.empty(len(downs), half, half) for e in (2, 3)} if rank < 2 else None
    biases = {peer: torch.empty(len(downs), half) for peer in (0, 1, 2, 3) if (peer < 2) != (rank < 2)}

    words, rows = torch.zeros(17, dtype=torch.int64), torch.zeros(4, 17, dtype=torch.int64)
    token = torch.zeros(1, dtype=torch.uint8)

    def agree() -> None:  # one round of 17 words per rank through rank 0, as the library's agreement
        if rank == 0:
            for w in [dist.irecv(rows[r], src=r, tag=11) for r in (1, 2, 3)]:
                w.wait()
            works = [dist.isend(rows, dst=r, tag=11) for r in (1, 2, 3)]
        else:
            works = [dist.isend(words, dst=0, tag=11), dist.irecv(rows, src=0, tag=11)]
        for w in works:
            w.wait()

    def pieces(protocol: bool = False) -> None:
        works = []
        if protocol:
            agree()
        if rank < 2:
            receipts = [dist.irecv(token.clone(), src=e, tag=12) for e in (2, 3)] if protocol else []
            for e in (2, 3):
                c = (e - 2) * half
                if e - 2 == rank:  # the column-parallel rows this trainer holds: straight from its tensors
                    works += [dist.isend(held[n].tensor, dst=e) for n in full if n.endswith(".up")]
                for k, n in enumerate(downs):  # a column half of the trainer's rows: packed, then sent
                    packed[e][k].copy_(held[n].tensor[:, c : c + half])
                    works.append(dist.isend(packed[e][k], dst=e))
                for k, n in enumerate(n for n in full if n.endswith(".bias")):
                    biases[e][k].copy_(held[n].tensor)
                works.append(dist.isend(biases[e], dst=e))
            works = receipts + works  # the receipts first: the sends have completed once they came
        else:
            for src in (0, 1):
                if src == rank - 2:
                    works += [dist.irecv(engine[n], src=src) for n in full if n.endswith(".up")]
                works += [dist.irecv(engine[n][src * half : (src + 1) * half], src=src) for n in downs]
                works.append(dist.irecv(biases[src], src=src))
            for w in works:
                w.wait()
            works = [dist.isend(token, dst=src, tag=12) for src in (0, 1)] if protocol else []
            for src in (0, 1):
                for k, n in enumerate(n for n in full if n.endswith(".bias")):
                    engine[n][src * half : (src + 1) * half].copy_(biases[src][k])
        for w in works:
            w.wait()

    gathered = {n: torch.empty_like(t) for n, t in full.items()} if rank in (0, 2, 3) else None

    def gather_broadcast() -> None:
        if rank < 2:  # the gather onto trainer rank 0
            works = []
            for name, piece in held.items():
                rows = piece.tensor.shape[0]
                if rank == 0:
                    gathered[name][:rows].copy_(piece.tensor)
                    works.append(dist.irecv(gathered[name][rows:], src=1))
                else:
                    works.append(dist.isend(piece.tensor, dst=0))
            for w in works:
                w.wait()
        if rank != 1:
            broadcast_state_dict(gathered, "BROADCAST", src=0, bucket_bytes=bucket_bytes)
        if rank >= 2:
            for name, t in engine.items():
                r = rank - 2
                if name.endswith(".down"):
                    t.copy_(gathered[name][:, r * WIDTH // 2 : (r + 1) * WIDTH // 2])
                elif name.endswith(".up"):
                    t.copy_(gathered[name][r * WIDTH // 2 : (r + 1) * WIDTH // 2])
                else:
                    t.copy_(gathered[name])

    version = [0]

    def verify() -> None:
        reshard_state_dict(held=held, wanted=wanted, comm_mode="RESHARD", bucket_bytes=bucket_bytes, verify=True)

    def atomic() -> None:
        version[0] += 1
        reshard_state_dict(
            held=held, wanted=wanted, comm_mode="RESHARD", bucket_bytes=bucket_bytes, version=version[0], atomic=True
        )

    for name, way in (
        ("gather_broadcast", gather_broadcast),
        ("verify", verify),
        ("atomic", atomic),
        ("pieces", pieces),
        ("protocol", lambda: pieces(protocol=True)),
    ):
        for t in engine.values():
            t.zero_()
        way()
        ok[name] = identical()
    ways = {
        "library": library,
        "limit": limit,
        "pieces": pieces,
        "protocol": lambda: pieces(protocol=True),
        "verify": verify,
        "atomic": atomic,
        "gather_broadcast": gather_broadcast,
    }
    names = list(ways)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 2):  # two warm-up rounds
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            ways[name]()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if r >= 2:
                times[name].append(elapsed.item())
    return {
        "times": times,
        "identical": ok,
        "sent": dict(first.sent),
        "received": dict(first.received),
        "cached": report.plan_cached,
        "wanted_bytes": wanted_bytes,
        "model_bytes": sum(t.numel() * t.element_size() for t in full.values()),
    }


def planner(tensors: int = 1000, holders: int = 8, wanters: int = 16, repeats: int = 3) -> dict:
    """The plan's time for ``tensors`` tensors (cold, on one member: each builds the same), and a repeat call's local
    cost on a wanter (reading its arguments, hashing its metadata)."""
    import json

    import torch

    from rlightning_comm import TensorSlice
    from rlightning_comm.weights.core._memory import hash_key
    from rlightning_comm.weights.reshard._schedule import build_schedule
    from rlightning_comm.weights.reshard._slices import collect, metadata

    shape, tp = (512, 256), wanters // 2
    metas = []
    for h in range(holders):
        shard, rows = h % 4, shape[0] // 4
        metas.append(
            [
                [
                    f"t{i}",
                    "torch.float32",
                    list(shape),
                    [[[shard * rows, 0], [rows, shape[1]], [shape[1], 1], True]],
                    [],
                ]
                for i in range(tensors)
            ]
        )
    for w in range(wanters):
        r = w % tp
        entries = []
        for i in range(tensors):
            if i % 2:  # row-parallel: a column block of a contiguous local [512, 32]
                block = [[0, r * shape[1] // tp], [shape[0], shape[1] // tp], [shape[1] // tp, 1], True]
            else:
                block = [[r * shape[0] // tp, 0], [shape[0] // tp, shape[1]], [shape[1], 1], True]
            entries.append([f"t{i}", "torch.float32", list(shape), [], [block]])
        metas.append(entries)
    ranks = list(range(holders + wanters))
    cold = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        build_schedule(metas, 64 * 2**20, ranks, holders)
        cold.append(time.perf_counter() - t0)
    local = {f"t{i}": torch.zeros(shape[0] // tp, shape[1]) for i in range(tensors)}
    wanted = {n: TensorSlice(t, (0, 0), shape) for n, t in local.items()}
    repeat = []
    names, _ = collect(None, wanted, torch.device("cpu"))
    made = metadata(names)
    hash_key(json.dumps(made, separators=(",", ":")))  # once, when the plan is made
    for _ in range(repeats * 3):
        t0 = time.perf_counter()
        names, _ = collect(None, wanted, torch.device("cpu"))
        if metadata(names) != made:  # a repeat call compares with the kept plan's metadata
            raise SystemExit("the metadata changed")
        repeat.append(time.perf_counter() - t0)
    pieces = sum(len(m[0][3]) + len(m[0][4]) for m in metas)
    return {"cold_s": statistics.median(cold), "repeat_s": statistics.median(repeat), "blocks_per_tensor": pieces}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--bucket-mib", type=float, default=64.0)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads per rank (0: torch's default)")
    args = parser.parse_args()
    load = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    started = time.perf_counter()
    out = run_ranks(_task, 4, args.rounds, int(args.bucket_mib * 2**20), args.threads)
    times = out[0]["times"]
    print(
        f"{machine()}; 4 gloo ranks (trainer FSDP Shard(0) on 2, engine TP=2 on 2); "
        f"model {out[0]['model_bytes'] / 2**20:.1f} MiB"
    )
    print(
        f"{args.rounds} interleaved rounds, bucket {args.bucket_mib:g} MiB, threads {args.threads or 'default'}; "
        f"load before: {load}"
    )
    print()
    egress = sum(sum(o["sent"].values()) for o in out[:2])
    wanted = sum(o["wanted_bytes"] for o in out[2:])
    kept = all(sum(o["received"].values()) == o["wanted_bytes"] for o in out[2:])
    print(
        f"bytes: trainer egress {egress} = engines' wanted {wanted}: {egress == wanted}; "
        f"every engine receives exactly what it keeps: {kept}"
    )
    print(f"per pair (from the reports): {[o['sent'] for o in out[:2]]}; repeat call plan kept: {out[0]['cached']}")
    print()
    print("| way | median ms | min ms | library speed vs it (median of per-round ratios) | bit-identical |")
    print("|---|---|---|---|---|")
    for name, samples in times.items():
        vs = statistics.median(t / lib for t, lib in zip(samples, times["library"]))
        same = "-" if name == "limit" else ("yes" if all(o["identical"][name] for o in out[2:]) else "NO")
        print(f"| {name} | {statistics.median(samples) * 1e3:.1f} | {min(samples) * 1e3:.1f} | {vs:.2f}x | {same} |")
    pieces = statistics.median(lim / t for lim, t in zip(times["limit"], times["pieces"]))
    protocol = statistics.median(lim / t for lim, t in zip(times["limit"], times["protocol"]))
    print(f"\nthe hand-written pieces against the limit (median of per-round ratios): {pieces:.2f}x")
    print(f"the pieces with the agreement's round and the receipts, by hand, against the limit: {protocol:.2f}x")
    plan = planner()
    print()
    print(
        f"planner: 1,000 tensors, 8 holders, 16 wanters: {plan['cold_s'] * 1e3:.0f} ms to plan (median of 3); "
        f"a repeat call's local cost {plan['repeat_s'] * 1e3:.1f} ms, then one fingerprint exchange"
    )
    print(f"wall {time.perf_counter() - started:.0f} s; load after: {os.getloadavg()}")
    if not all(all(o["identical"].values()) for o in out[2:]) or egress != wanted or not kept:
        raise SystemExit("a check failed")


if __name__ == "__main__":
    main()
