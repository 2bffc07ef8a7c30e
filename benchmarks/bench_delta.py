"""``delta=True`` against a full sync, on ``broadcast_state_dict`` and ``reshard_state_dict``, at several change rates.

Each round, every source changes a fraction of the elements of each of its tensors (random positions, the lowest bit of
the element flipped, so every chosen element really changes), outside the timing; then the full sync and the delta sync
of the same weights, interleaved in rotating order, over two modes of the same ranks (each keeps its own snapshot and
version record). A round's time is the slowest rank's, from a barrier to every destination holding the new weights.
Bytes come from the reports; the changed bytes are counted against the previous round's weights (the oracle: the whole
tensors compared byte by byte in one process), and so are the least their positions cost (per tensor the fewer of 2
bytes per changed element and one bit per element). Every destination is checked bit-identical to its source after every
delta sync.

* broadcast: 3 gloo ranks, the model of ``bench_weight_transfer.py`` (a bf16 embedding 16384 x 256, 60 fp32 512 x 512
  matrices and their biases, 68.1 MiB), rank 0 to ranks 1 and 2 (a relay);
* reshard: 4 gloo ranks, the model of ``bench_reshard.py`` (8 layers of two fp32 1024 x 1024 matrices and a bias, 64.0
  MiB), trainer ranks 0 and 1 holding FSDP ``Shard(0)`` rows, engine ranks 2 and 3 in TP=2.

Also the source's comparison alone: the encoding of one round's changes against the snapshot, timed in one process,
and next to it the floor of any lossless delta here: one pass comparing the model with its snapshot (``torch.ne`` of
each tensor's words into a kept buffer).

    python benchmarks/bench_delta.py [--case broadcast|reshard|both] [--rounds 10] [--fractions 0,0.02,0.1,0.5,1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from _common import machine, run_ranks

R_WIDTH = 1024  # bench_reshard.py's width


def _broadcast_model(seed: int) -> dict:
    """bench_weight_transfer.py's model."""
    from bench_weight_transfer import _model

    return _model(seed)


def _reshard_model(seed: int) -> dict:
    """bench_reshard.py's model."""
    from bench_reshard import _full

    return _full(seed)


def _perturb(tensors, fraction: float, gen) -> None:
    """Flip the lowest bit of ``fraction`` of each tensor's elements (distinct random positions), in place."""
    import torch

    from rlightning_comm.weights.delta._changes import words

    for t in tensors:
        w = words(t).view(-1)
        k = round(w.numel() * fraction)
        if k:
            idx = torch.randperm(w.numel(), generator=gen)[:k]
            w[idx] ^= 1


def _changed_bytes(before, after) -> tuple[int, int]:
    """The bytes of the elements that changed (compared byte by byte, per element: not the library's code), and what
    their positions cost at least: per tensor the fewer of 2 bytes per changed element and one bit per element."""
    import torch

    changed = index = 0
    for a, b in zip(before, after):
        if not a.numel():
            continue
        rows = (
            a.contiguous().reshape(-1).view(torch.uint8).view(a.numel(), -1)
            != b.contiguous().reshape(-1).view(torch.uint8).view(a.numel(), -1)
        ).any(dim=1)
        k = int(rows.sum())
        changed += k * a.element_size()
        index += min(2 * k, -(-a.numel() // 8)) if k < a.numel() else 0
    return changed, index


def _sha(tensors) -> list[str]:
    """Each tensor's SHA-256 of its bytes (an oracle that is not the library's digest)."""
    import hashlib

    from rlightning_comm.weights.delta._changes import words

    return [hashlib.sha256(words(t).contiguous().view(-1).numpy().tobytes()).hexdigest() for t in tensors]


def _time(fn) -> float:
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _broadcast_task(rank: int, nproc: int, rounds: int, fractions: list[float], threads: int) -> dict:
    import torch
    import torch.distributed as dist

    from rlightning_comm import CommContext, broadcast_state_dict

    if threads:
        torch.set_num_threads(threads)
    ctx = CommContext()
    ctx.init_group([0, 1, 2], "FULL")
    ctx.init_group([0, 1, 2], "DELTA")
    state = _broadcast_model(0 if rank == 0 else rank + 10)
    delta_state = {n: t.clone() for n, t in state.items()}  # the destinations of the delta mode hold their own
    gen = torch.Generator().manual_seed(1)
    version = [0]
    out: dict = {}
    for fraction in fractions:
        times: dict[str, list[float]] = {"full": [], "delta": []}
        wire: list[int] = []
        changed: list[int] = []
        identical = True
        for r in range(rounds + 2):  # two warm-up rounds: the first delta sync of a mode is full
            before = [t.clone() for t in state.values()] if rank == 0 else None
            if rank == 0:
                _perturb(list(state.values()), fraction, gen)
                for n, t in state.items():
                    delta_state[n].copy_(t)
            version[0] += 1
            order = ["full", "delta"] if r % 2 == 0 else ["delta", "full"]
            reports = {}
            for name in order:
                box: dict = {}

                def run(name: str = name, box: dict = box, v: int = version[0]) -> None:
                    if name == "full":
                        box["report"] = broadcast_state_dict(state, "FULL", src=0, version=v)
                    else:
                        box["report"] = broadcast_state_dict(delta_state, "DELTA", src=0, version=v, delta=True)

                t = _time(run)
                reports[name] = box["report"]
                if r >= 2:
                    times[name].append(t)
            digests = [_sha(delta_state.values()) if rank == 0 else None]
            dist.broadcast_object_list(digests, src=0)
            if rank:
                identical &= _sha(delta_state.values()) == digests[0]
            if r >= 2 and rank == 0:
                kinds = set(reports["delta"].kinds.values())
                wire.append(reports["delta"].bytes_sent if kinds == {"delta"} else -reports["delta"].bytes_sent)
                changed.append(_changed_bytes(before, list(state.values())))
        flags = torch.tensor([int(identical)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        out[fraction] = {"times": times, "wire": wire, "changed": changed, "identical": bool(flags.item())}
    if rank == 0:
        out["model_bytes"] = sum(t.numel() * t.element_size() for t in state.values())
    return out


def _reshard_task(rank: int, nproc: int, rounds: int, fractions: list[float], threads: int) -> dict:
    import torch
    import torch.distributed as dist

    from rlightning_comm import CommContext, TensorSlice, reshard_state_dict

    if threads:
        torch.set_num_threads(threads)
    ctx = CommContext()
    ctx.init_group([0, 1, 2, 3], "FULL")
    ctx.init_group([0, 1, 2, 3], "DELTA")
    full = _reshard_model(0)  # every rank holds the model and changes it alike: the trainers cut their shards from it
    half = R_WIDTH // 2

    def want(name: str, t, r: int):
        if name.endswith(".down"):  # row-parallel: a column block
            return t[:, r * half : (r + 1) * half]
        if name.endswith(".up"):  # column-parallel: a row block
            return t[r * half : (r + 1) * half]
        return t  # replicated

    def layout(copy: bool):
        held = wanted = None
        engine = {}
        if rank < 2:
            held = {
                n: TensorSlice(t[rank * half : (rank + 1) * half].clone(), (rank * half, 0)[: t.dim()], tuple(t.shape))
                for n, t in full.items()
            }
        else:
            r = rank - 2
            wanted = {}
            for n, t in full.items():
                engine[n] = torch.zeros_like(want(n, t, r).contiguous())
                offsets = (0, r * half) if n.endswith(".down") else (r * half, 0) if n.endswith(".up") else (0,)
                wanted[n] = TensorSlice(engine[n], offsets, tuple(t.shape))
        return held, wanted, engine

    ways = {"full": layout(False), "delta": layout(True)}
    gen = torch.Generator().manual_seed(1)
    version = [0]
    out: dict = {}
    for fraction in fractions:
        times: dict[str, list[float]] = {"full": [], "delta": []}
        wire: list[int] = []
        changed: list[int] = []
        identical = True
        for r in range(rounds + 2):
            before = {n: t.clone() for n, t in full.items()}
            _perturb(list(full.values()), fraction, gen)
            for held, _, _ in ways.values():
                if held is not None:
                    for n, t in full.items():
                        held[n].tensor.copy_(t[rank * half : (rank + 1) * half])
            version[0] += 1
            order = ["full", "delta"] if r % 2 == 0 else ["delta", "full"]
            reports = {}
            for name in order:
                held, wanted, _ = ways[name]
                box: dict = {}

                def run(name: str = name, held=held, wanted=wanted, box: dict = box, v: int = version[0]) -> None:
                    box["report"] = reshard_state_dict(
                        held=held, wanted=wanted, comm_mode=name.upper(), version=v, delta=name == "delta"
                    )

                t = _time(run)
                reports[name] = box["report"]
                if r >= 2:
                    times[name].append(t)
            if rank >= 2:
                engine = ways["delta"][2]
                identical &= all(torch.equal(engine[n], want(n, full[n], rank - 2)) for n in engine)
            if r >= 2:
                report = reports["delta"]
                kinds = set(report.kinds.values())
                mine = sum(report.received.values()) if rank >= 2 else 0
                diff = (0, 0)
                if rank >= 2:
                    diff = _changed_bytes(
                        [want(n, before[n], rank - 2) for n in full], [want(n, full[n], rank - 2) for n in full]
                    )
                counts = torch.tensor([mine, *diff, int(kinds == {"delta"})], dtype=torch.int64)
                dist.all_reduce(counts)
                wire.append(int(counts[0]) if int(counts[3]) == 4 else -int(counts[0]))
                changed.append((int(counts[1]), int(counts[2])))
        flags = torch.tensor([int(identical)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        out[fraction] = {"times": times, "wire": wire, "changed": changed, "identical": bool(flags.item())}
    out["model_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
    return out


def compare_alone(fraction: float, threads: int, repeats: int = 9) -> dict:
    """The source's encoding of one round's changes against its snapshot (the broadcast model), in this process, and
    the floor of any lossless delta here: one pass comparing the model with its snapshot (``torch.ne`` of each tensor's
    words into a kept buffer), interleaved with it."""
    import torch

    from rlightning_comm.weights.delta import _changes
    from rlightning_comm.weights.delta import _encoding as _delta
    from rlightning_comm.weights.delta._snapshots import Snapshot

    if threads:
        torch.set_num_threads(threads)
    state = _broadcast_model(0)
    tensors = list(state.values())
    recs = _delta.records([(t.dtype, t.numel(), None) for t in tensors])
    snap = Snapshot("bench", recs)

    def views(record):
        return [_changes.words(tensors[i]) for i in record.pieces]

    snap.take(views, 1)
    copies = [_changes.words(t).clone() for t in tensors]
    outs = [torch.empty(t.shape, dtype=torch.bool) for t in copies]
    _perturb(tensors, fraction, torch.Generator().manual_seed(2))
    samples, floor = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        offer = snap.offer(views, torch.device("cpu"), 2**62)
        samples.append(time.perf_counter() - t0)
        snap._settle()  # the snapshot as it was: the next offer finds the same changes
        t0 = time.perf_counter()
        for t, c, o in zip(tensors, copies, outs):
            torch.ne(_changes.words(t), c, out=o)
        floor.append(time.perf_counter() - t0)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return {
        "median_s": statistics.median(samples),
        "floor_s": statistics.median(floor),
        "bytes": nbytes,
        "payload": offer.payload.numel(),
    }


def _report(case: str, out: list, fractions: list[float], model_bytes: int) -> bool:
    ok = True
    print(f"\n{case}: model {model_bytes / 2**20:.1f} MiB")
    print(
        "| changed | full ms (median) | delta ms (median) | delta speed vs full (median of per-round ratios) | "
        "bytes on the wire (delta) | changed bytes + their positions | wire / (changed + positions) | bit-identical |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for f in fractions:
        res = out[0][f]
        t = res["times"]
        ratio = statistics.median(a / b for a, b in zip(t["full"], t["delta"]))
        wire = statistics.median(abs(w) for w in res["wire"])
        full_rounds = sum(1 for w in res["wire"] if w < 0)
        changed = statistics.median(c + i for c, i in res["changed"])
        per = f"{wire / changed:.2f}x" if changed else "-"
        note = f" ({full_rounds} rounds full)" if full_rounds else ""
        same = "yes" if res["identical"] else "NO"
        ok &= res["identical"]
        print(
            f"| {f:.0%} | {statistics.median(t['full']) * 1e3:.1f} | {statistics.median(t['delta']) * 1e3:.1f} | "
            f"{ratio:.2f}x | {wire:,.0f}{note} | {changed:,.0f} | {per} | {same} |"
        )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="both", choices=["broadcast", "reshard", "both"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--fractions", default="0,0.02,0.1,0.5,1")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads per rank (0: torch's default)")
    args = parser.parse_args()
    fractions = [float(f) for f in args.fractions.split(",")]
    load = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    started = time.perf_counter()
    print(f"{machine()}; {args.rounds} interleaved rounds per rate; threads {args.threads or 'default'}")
    print(f"load before: {load}")
    ok = True
    if args.case in ("broadcast", "both"):
        out = run_ranks(_broadcast_task, 3, args.rounds, fractions, args.threads)
        ok &= _report("broadcast_state_dict, 3 ranks (a relay)", out, fractions, out[0]["model_bytes"])
        for f in (0.02,):
            alone = compare_alone(f, args.threads)
            print(
                f"the source's comparison and encoding alone at {f:.0%}: {alone['median_s'] * 1e3:.1f} ms for "
                f"{alone['bytes'] / 2**20:.1f} MiB ({alone['bytes'] / alone['median_s'] / 1e9:.1f} GB/s); the floor, "
                f"one pass comparing the model with its snapshot into a kept buffer: {alone['floor_s'] * 1e3:.1f} ms"
            )
    if args.case in ("reshard", "both"):
        out = run_ranks(_reshard_task, 4, args.rounds, fractions, args.threads)
        ok &= _report(
            "reshard_state_dict, 4 ranks (FSDP Shard(0) on 2 to TP=2 on 2)", out, fractions, out[0]["model_bytes"]
        )
    print(f"\nwall {time.perf_counter() - started:.0f} s; load after: {os.getloadavg()}")
    if not ok:
        raise SystemExit("a destination was not bit-identical to its source")


if __name__ == "__main__":
    main()
