"""The weight-sync digest against SHA-256 on one thread: a model's tensors, whole, medians of interleaved rounds.

    python benchmarks/bench_digest.py [--rounds 9]

The model is bench_weight_versions.py's (a bf16 embedding 4096 x 256, 60 fp32 256 x 256 matrices and their biases, 17.1
MiB) and one fp32 4096 x 4096 matrix (64 MiB). Each round times the library's digest of every tensor (row weights
already cached, as in a repeat sync) and ``hashlib.sha256`` of the same bytes, in alternating order.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time

import torch
from _common import machine
from bench_weight_versions import _model

from rlightning_comm.weights import tensor_digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{machine()}; load before: {os.getloadavg()}; one thread")
    print("| tensors | MiB | digest (ms) | SHA-256 (ms) | digest GB/s | SHA-256 GB/s |")
    print("|---|---|---|---|---|---|")
    for label, state in (("model", _model(seed=0)), ("4096 x 4096 fp32", {"w": torch.randn(4096, 4096)})):
        total = sum(t.numel() * t.element_size() for t in state.values())
        raw = [t.contiguous().view(torch.uint8).reshape(-1).numpy() for t in state.values()]
        times: dict[str, list[float]] = {"digest": [], "sha": []}
        for r in range(args.rounds + 1):
            for way in ("digest", "sha") if r % 2 else ("sha", "digest"):
                t0 = time.perf_counter()
                if way == "digest":
                    for t in state.values():
                        tensor_digest(t)
                else:
                    for b in raw:
                        hashlib.sha256(b).digest()
                if r:
                    times[way].append(time.perf_counter() - t0)
        d, s = statistics.median(times["digest"]), statistics.median(times["sha"])
        rates = f"{total / d / 1e9:.2f} | {total / s / 1e9:.2f}"
        print(f"| {label} ({len(state)}) | {total / 2**20:.1f} | {d * 1e3:.1f} | {s * 1e3:.1f} | {rates} |")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
