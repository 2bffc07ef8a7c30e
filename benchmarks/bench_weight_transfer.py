"""``broadcast_state_dict`` against RLightning's per-dtype way, one broadcast per tensor, and the limit, in one run.

3 gloo ranks (rank 0 sends to ranks 1 and 2 over the weight-transfer group), a 68 MiB model of 121 tensors: a bf16
embedding (16384 x 256), 60 fp32 matrices (512 x 512) and their 60 fp32 biases. Ways, all on the same group:

* library: ``broadcast_state_dict(state, src=0)`` (steady state: the manifest is cached);
* library load: the same, the destinations passing a ``load`` callable (vLLM's ``load_weights`` shape) that copies each
  named tensor into its own with ``copy_``;
* rlightning: RLightning's "full" strategy: per dtype, flatten the source's tensors (``parameters_to_vector``), one
  async broadcast per dtype, wait, and the receivers copy the flat vector back into their tensors (its metadata list
  goes over Ray, not counted here);
* per tensor: one ``torch.distributed.broadcast`` per tensor, in place;
* sends per tensor: hand-written point-to-point, in place: each destination posts a ``torch.distributed.irecv`` per
  tensor and tells the source (one small send), the source then ``isend``s every tensor to every destination (no
  handshake, no coalescing);
* limit: one ``torch.distributed.broadcast`` of a ready flat buffer of the same bytes (no packing at all).

Interleaved rounds (the order rotates each round); a round's time for a way is the slowest rank's, from a barrier to
that rank holding every tensor. Medians over rounds, and the medians of the per-round ratios to the limit's speed. Every
way's destinations are checked bit-identical to the source first.

    python benchmarks/bench_weight_transfer.py [--rounds 20] [--bucket-mib 64] [--threads 0] [--ways library_load,...]

A ``load`` callable's ``copy_`` runs on torch's intra-op threads: with several ranks on few cores (torch's default is
one thread per core in every rank) that is several times a plain copy; ``--threads 1`` is what torchrun sets.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from _common import machine, print_speed_table, run_ranks

NPROC = 3
LAYERS = 60
WIDTH = 512
VOCAB = 16384
EMBED = 256


def _model(seed: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    state = {"embed.weight": torch.randn(VOCAB, EMBED, generator=gen).to(torch.bfloat16)}
    for i in range(LAYERS):
        state[f"layers.{i}.weight"] = torch.randn(WIDTH, WIDTH, generator=gen)
        state[f"layers.{i}.bias"] = torch.randn(WIDTH, generator=gen)
    return state


def measure(
    ways: dict, rank: int, tensors: list, rounds: int, barrier, slowest
) -> tuple[dict[str, list[float]], dict[str, bool]]:
    """Whether each way but ``"limit"`` leaves ``tensors`` equal to the source's (each rank starting from its own seed),
    then each way's time in interleaved rounds (the order rotates each round, after two warm-up rounds): the slowest
    rank's, from ``barrier()`` to holding every tensor (``slowest(t)`` reduces a float64 tensor to its maximum in
    place).
    """
    import torch

    reference = _model(seed=0)
    identical = {}
    for name, fn in ways.items():
        if name == "limit":
            continue
        with torch.no_grad():
            for t, r in zip(tensors, _model(seed=rank).values()):
                t.copy_(r)  # destinations start different again
        fn()
        identical[name] = all(
            torch.equal(t.view(-1).view(torch.uint8), r.view(-1).view(torch.uint8))
            for t, r in zip(tensors, reference.values())
        )
    names = list(ways)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + 2):  # two warm-up rounds
        for name in names[r % len(names) :] + names[: r % len(names)]:
            barrier()
            t0 = time.perf_counter()
            ways[name]()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            slowest(elapsed)
            if r >= 2:
                times[name].append(elapsed.item())
    return times, identical


def _task(rank: int, nproc: int, rounds: int, bucket_bytes: int, threads: int, only: list[str] | None) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    import torch.distributed as dist
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from rlightning_comm import CommContext, ParallelMode, broadcast_state_dict

    ctx = CommContext()
    ctx.init_weight_transfer_group(src=0, dst_ranks=list(range(1, nproc)))
    group = ctx.get_group(ParallelMode.WEIGHT_TRANSFER)
    state = _model(seed=rank)
    tensors = list(state.values())
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    total = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.empty(total, dtype=torch.uint8)

    def library() -> None:
        broadcast_state_dict(state, src=0, bucket_bytes=bucket_bytes)

    def load(named) -> None:
        for name, t in named:
            state[name].copy_(t)

    def library_load() -> None:
        broadcast_state_dict(state if rank == 0 else load, src=0, bucket_bytes=bucket_bytes)

    def rlightning() -> None:
        works, vectors = [], {}
        for dtype, ts in by_dtype.items():
            vec = parameters_to_vector(ts) if rank == 0 else torch.empty(sum(t.numel() for t in ts), dtype=dtype)
            vectors[dtype] = vec
            works.append(dist.broadcast(vec, src=0, group=group, async_op=True))
        for w in works:
            w.wait()
        if rank != 0:
            for dtype, ts in by_dtype.items():
                vector_to_parameters(vectors[dtype], ts)

    def per_tensor() -> None:
        for t in tensors:
            dist.broadcast(t, src=0, group=group)

    token = torch.zeros(1, dtype=torch.uint8)

    def sends_per_tensor() -> None:
        if rank == 0:
            for peer in range(1, nproc):
                dist.recv(token, src=peer, group=group)
            works = [dist.isend(t, dst=peer, group=group) for t in tensors for peer in range(1, nproc)]
        else:
            works = [dist.irecv(t, src=0, group=group) for t in tensors]
            dist.send(token, dst=0, group=group)
        for work in works:
            work.wait()

    def limit() -> None:
        dist.broadcast(flat, src=0, group=group)

    ways = {
        "library": library,
        "library_load": library_load,
        "rlightning": rlightning,
        "per_tensor": per_tensor,
        "sends_per_tensor": sends_per_tensor,
        "limit": limit,
    }
    ways = {
        name: fn
        for name, fn in ways.items()
        if only is None or name in only or name in ("library", "rlightning", "limit")
    }

    def slowest(elapsed: torch.Tensor) -> None:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)

    times, identical = measure(ways, rank, tensors, rounds, lambda: dist.barrier(group=group), slowest)
    return {"times": times, "identical": identical, "bytes": total, "tensors": len(tensors)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--bucket-mib", type=float, default=64.0, help="the library's bucket_bytes, in MiB")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help=(
            "torch's intra-op threads per rank (0: torch's default; torchrun sets OMP_NUM_THREADS=1 for several ranks)"
        ),
    )
    parser.add_argument(
        "--ways", help="comma-separated ways to run (library, rlightning and limit always run); default: all"
    )
    args = parser.parse_args()
    only = args.ways.split(",") if args.ways else None
    load = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    started = time.perf_counter()
    out = run_ranks(_task, NPROC, args.rounds, int(args.bucket_mib * 2**20), args.threads, only)[0]
    times = out["times"]
    print(
        f"{machine()}; {NPROC} gloo ranks (1 source, {NPROC - 1} destinations); {out['tensors']} tensors, "
        f"{out['bytes'] / 2**20:.1f} MiB"
    )
    threads = args.threads or "torch's default"
    print(
        f"{args.rounds} interleaved rounds, bucket {args.bucket_mib:g} MiB, intra-op threads per rank: {threads}; load "
        f"before: {load}"
    )
    print()
    print_speed_table(times, out["identical"])
    vs = statistics.median(rl / lib for rl, lib in zip(times["rlightning"], times["library"]))
    print()
    print(
        f"library speed vs rlightning's (median of per-round ratios): {vs:.2f}x; wall "
        f"{time.perf_counter() - started:.0f} s; load after: {os.getloadavg()}"
    )
    if not all(out["identical"].values()):
        raise SystemExit("a way left a destination different from the source")


if __name__ == "__main__":
    main()
