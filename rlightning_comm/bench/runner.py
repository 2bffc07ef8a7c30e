"""The per-rank sweep: every op, every size, the library and raw torch.distributed interleaved, every result checked.

The overhead column is the cold per-call ratio a training loop sees (each call alone after a barrier, the two paths
interleaved on the same buffers), and with ``--repeat N`` the median of N independent measurements with their spread, so
noise can be told from cost.

Timing: each call is timed on its own (wall clock; on CUDA the device is
synchronised before the call and the timer stops after a second synchronisation), after a barrier so the ranks start
together (the process group's own, which runs no Python of either path); inputs are reset and outputs poisoned before
the barrier, and results are checked after the timer stops. The library's call and the raw call alternate within each
iteration, swapping which goes first, so both see the same machine. A row reports, per path, the median over the timed
calls on each rank, then the slowest rank's median.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from rlightning_comm.bandwidth import bus_factor, gbps
from rlightning_comm.bench import report
from rlightning_comm.bench.cases import CASES, Case, torch_objects_available
from rlightning_comm.bench.config import BenchConfig
from rlightning_comm.communicators.base import Communicator
from rlightning_comm.communicators.registry import get_communicator_class
from rlightning_comm.context import CommContext

_PATHS = ("facade", "raw")


def run_rank(rank: int, world_size: int, dist_url: str, cfg: BenchConfig) -> int:
    """Run the sweep on this rank; rank 0 prints rows and writes the files.

    Returns:
        0 when every result on every rank was right, 1 otherwise.
    """
    if cfg.device == "cuda" and get_communicator_class(cfg.backend).backend != "nccl":  # nccl picks its GPU itself
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    ctx = CommContext()
    ctx.init_distributed_env(
        world_size=world_size, rank=rank, backend=cfg.backend, dist_url=dist_url, timeout=cfg.timeout
    )
    try:
        comm = _bind(ctx, cfg, world_size)
        device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
        rows = sweep(comm, cfg, device, world_size, echo=rank == 0)
        if rank == 0:
            if cfg.json_path:
                report.write_json(cfg.json_path, cfg, world_size, comm.world_size, rows)
            if cfg.plot_path:
                report.write_plot(cfg.plot_path, rows, f"{cfg.backend}/{cfg.device}, {world_size} ranks, {cfg.dtype}")
        return 1 if any(r["wrong"] or r["raw_wrong"] for r in rows) else 0
    finally:
        ctx.destroy()


def _bind(ctx: CommContext, cfg: BenchConfig, world_size: int) -> Communicator:
    size = cfg.group_size or world_size
    if world_size % size:
        raise ValueError(f"group_size {size} does not divide the world size {world_size}")
    if cfg.mode != "GLOBAL":
        ctx.init_group([list(range(start, start + size)) for start in range(0, world_size, size)], cfg.mode)
    elif size != world_size:
        raise ValueError(
            f"mode GLOBAL is the whole world ({world_size} ranks); pick another --mode for groups of {size}"
        )
    return ctx.get_communicator(cfg.mode)


def sweep(
    comm: Communicator, cfg: BenchConfig, device: torch.device, world_size: int, echo: bool
) -> list[dict[str, Any]]:
    """Every op of ``cfg`` at every size; prints each row as it completes when ``echo``."""
    out = print if echo else (lambda *a, **k: None)
    out(report.header(cfg, world_size, comm.world_size), flush=True)
    rows = []
    for op in cfg.ops:
        if op == "broadcast_object_list" and not torch_objects_available():
            out(
                f"# {op}: skipped: its raw side, torch.distributed.broadcast_object_list, needs numpy (pip install "
                "numpy); the library's own does not",
                flush=True,
            )
            continue
        out(report.op_header(op, comm.world_size), flush=True)
        for size in cfg.sizes:
            if op == "barrier" and size != cfg.sizes[0]:
                continue  # no payload: one row
            case = CASES[op](comm, cfg.mode, size, cfg.torch_dtype, device, cfg.dict_keys)
            if case.payload and case.elements == 0:
                out(
                    f"{size:>12} {'':>12} {case.dtype_name:>8}  skipped: fewer bytes than one element per rank",
                    flush=True,
                )
                continue
            row = repeated(case, op, cfg, device)
            rows.append(row)
            out(report.format_row(row), flush=True)
            del case
    out(report.footer(rows), flush=True)
    return rows


def _barrier(comm: Communicator) -> None:
    """The process group's own barrier, C++ only: the ranks start together and neither path's Python is warmed first."""
    comm.group.barrier(comm._barrier_options()).wait()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def repeated(case: Case, op: str, cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    """``cfg.repeat`` independent measurements of ``case``: the one with the median overhead, plus every run's overhead
    and the wrong results of all."""
    runs = sorted((measure(case, op, cfg, device) for _ in range(cfg.repeat)), key=lambda r: r["overhead_pct"])
    row = dict(runs[len(runs) // 2])
    row["overhead_runs_pct"] = [r["overhead_pct"] for r in runs]
    row["wrong"], row["raw_wrong"] = sum(r["wrong"] for r in runs), sum(r["raw_wrong"] for r in runs)
    row["repeat"] = cfg.repeat
    return row


def measure(case: Case, op: str, cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    """Time and check ``case`` on both paths; every rank returns the same row (reduced over the world)."""
    times: dict[str, list[float]] = {p: [] for p in _PATHS}
    wrong = dict.fromkeys(_PATHS, 0)
    inject = cfg.inject_wrong == op
    for i in range(cfg.warmup + cfg.iters):
        phase = i & 1
        for path in _PATHS if i % 4 < 2 else _PATHS[::-1]:
            case.prepare(phase)
            _sync(device)
            _barrier(case.comm)
            t0 = time.perf_counter()
            getattr(case, path)()
            _sync(device)
            elapsed = time.perf_counter() - t0
            if inject and path == "facade":
                case.corrupt()
            wrong[path] += case.wrong()
            if i >= cfg.warmup:
                times[path].append(elapsed)
    # Reduce over the world (every group of a partition ran its own collectives): slowest medians, extremes, wrong
    # counts.
    stat_device = device if case.comm.backend == "nccl" else torch.device("cpu")
    peak = torch.tensor(
        [
            statistics.median(times["facade"]),
            statistics.median(times["raw"]),
            max(times["facade"]),
            max(times["raw"]),
            -min(times["facade"]),
            -min(times["raw"]),
        ],
        dtype=torch.float64,
        device=stat_device,
    )
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    bad = torch.tensor([wrong["facade"], wrong["raw"]], dtype=torch.float64, device=stat_device)
    dist.all_reduce(bad)
    t, t_raw, t_max, t_raw_max, t_min, t_raw_min = peak.tolist()
    factor = bus_factor(op, case.n)
    return {
        "op": op,
        "size": case.nbytes,
        "elements": case.elements,
        "dtype": case.dtype_name,
        "group_size": case.n,
        "bus_factor": factor,
        "time_us": t * 1e6,
        "algbw_gbps": gbps(case.nbytes, t),
        "busbw_gbps": gbps(case.nbytes, t) * factor,
        "wrong": int(bad[0]),
        "raw_time_us": t_raw * 1e6,
        "raw_algbw_gbps": gbps(case.nbytes, t_raw),
        "raw_busbw_gbps": gbps(case.nbytes, t_raw) * factor,
        "raw_wrong": int(bad[1]),
        "overhead_pct": (t / t_raw - 1.0) * 100.0 if t_raw > 0 else 0.0,
        "time_min_us": -t_min * 1e6,
        "time_max_us": t_max * 1e6,
        "raw_time_min_us": -t_raw_min * 1e6,
        "raw_time_max_us": t_raw_max * 1e6,
        "iters": cfg.iters,
        "warmup": cfg.warmup,
    }
