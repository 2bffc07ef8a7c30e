"""``all_reduce_dict`` with 256 scalar keys against one all_reduce per key and against one raw all_reduce of 256
elements.

2 gloo ranks, interleaved rounds (the order of the three paths rotates); in each round each path runs ``calls`` times
after a barrier. Paths:

* dict: ``collective.all_reduce_dict(d, mode)`` on 256 Python floats;
* per key: for each key, ``t = torch.tensor([v]); collective.all_reduce(t, mode); out[k] = t.item()``;
* raw: ``torch.distributed.all_reduce`` of a ready 256-element float32 tensor (no packing at all);
* by hand: ``t = torch.tensor(list(d.values())); dist.all_reduce(t); dict(zip(d, t.tolist()))``, the least any code that
  starts from a dict of Python numbers can do;
* raw+cpu, a control: the raw all_reduce preceded by as much busy CPU work as the dict path's own (measured first): what
  the dict would cost if its Python work were pure CPU with no other effect.

Targets: per key / dict >= 20; dict / raw <= 1.3 (medians of the per-round ratios).
The dict reduces a float64 buffer (exact integer counts), 2 KiB against raw's 1 KiB of float32. First, with the launch
of the collective replaced by a no-op, the CPU time (``time.thread_time``) per call of dict and by hand: the Python work
around the collective.

    python benchmarks/bench_all_reduce_dict.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import machine, run_ranks

KEYS = 256
CALLS = {"dict": 40, "per_key": 2, "raw": 40, "by_hand": 40, "raw+cpu": 40}


class _NoWire:
    """Stands in for the process group and its work object: the collective is done as soon as it is called."""

    def allreduce(self, tensors: object, opts: object) -> _NoWire:
        return self

    def wait(self) -> bool:
        return True


def _task(rank: int, nproc: int, rounds: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from rlightning_comm import CommContext, CommMode, collective

    values = {f"metric/{i:03d}": float(i * (rank + 1)) for i in range(KEYS)}
    flat = torch.arange(KEYS, dtype=torch.float32)

    def per_key() -> dict[str, float]:
        out = {}
        for k, v in values.items():
            t = torch.tensor([v])
            collective.all_reduce(t, CommMode.GLOBAL)
            out[k] = t.item()
        return out

    def by_hand() -> dict[str, float]:
        t = torch.tensor(list(values.values()))
        dist.all_reduce(t)
        return dict(zip(values, t.tolist()))

    def spin(seconds: float) -> None:  # busy CPU time of this thread, not wall time
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    paths = {
        "dict": lambda: collective.all_reduce_dict(values, CommMode.GLOBAL),
        "per_key": per_key,
        "raw": lambda: dist.all_reduce(flat),
        "by_hand": by_hand,
    }
    if not paths["dict"]() == per_key() == by_hand():  # the same answer every way
        raise RuntimeError("all_reduce_dict disagrees with one all_reduce per key")
    # No network: the Python work alone. The communicator calls its process group directly, so a stand-in group whose
    # work is already done takes its place (every check and the pack/unpack still run).
    comm = CommContext().get_communicator(CommMode.GLOBAL)
    real_all_reduce, dist.all_reduce = dist.all_reduce, lambda *a, **k: None
    real_group, comm._group = comm._group, _NoWire()
    cpu = {}
    for name in ("dict", "by_hand"):
        samples = []
        for _ in range(rounds):
            t0 = time.thread_time()
            for _ in range(200):
                paths[name]()
            samples.append((time.thread_time() - t0) / 200)
        cpu[name] = statistics.median(samples)
    dist.all_reduce, comm._group = real_all_reduce, real_group
    paths["raw+cpu"] = lambda: (spin(cpu["dict"]), dist.all_reduce(flat))
    times: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(CALLS[name]):
                paths[name]()
            times[name].append((time.perf_counter() - t0) / CALLS[name] * 1e6)
    per_key_over_dict = [p / d for p, d in zip(times["per_key"], times["dict"])]
    dict_over_raw = [d / r for d, r in zip(times["dict"], times["raw"])]
    dict_over_by_hand = [d / h for d, h in zip(times["dict"], times["by_hand"])]
    control_over_raw = [c / r for c, r in zip(times["raw+cpu"], times["raw"])]
    return {
        "dict_us": statistics.median(times["dict"]),
        "per_key_us": statistics.median(times["per_key"]),
        "raw_us": statistics.median(times["raw"]),
        "per_key/dict": statistics.median(per_key_over_dict),
        "dict/raw": statistics.median(dict_over_raw),
        "dict/raw min..max": f"{min(dict_over_raw):.3f}..{max(dict_over_raw):.3f}",
        "by_hand_us": statistics.median(times["by_hand"]),
        "dict/by_hand": statistics.median(dict_over_by_hand),
        "raw+cpu_us": statistics.median(times["raw+cpu"]),
        "(raw+cpu)/raw": statistics.median(control_over_raw),
        "cpu_us dict (no-op)": cpu["dict"] * 1e6,
        "cpu_us by_hand (no-op)": cpu["by_hand"] * 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    res = run_ranks(_task, 2, args.rounds)
    print(f"# all_reduce_dict, {KEYS} scalar keys, 2 gloo ranks, {args.rounds} interleaved rounds; {machine()}")
    for key, value in res[0].items():
        other = res[1][key]
        fmt = (lambda v: f"{v:.3f}") if isinstance(value, float) else str
        print(f"{key:<20} {fmt(value):>14}   (rank 1: {fmt(other)})")


if __name__ == "__main__":
    main()
