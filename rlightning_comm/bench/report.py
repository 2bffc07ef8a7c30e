"""What the bench prints, and the JSON and plot it writes (rank 0 only)."""

from __future__ import annotations

import datetime
import json
import os
import platform
from typing import Any

import torch

from rlightning_comm.bandwidth import FACTOR_FORMULAS, bus_factor
from rlightning_comm.bench.config import BenchConfig

_COLUMNS = (
    f"#{'size':>11} {'elements':>12} {'dtype':>8} {'time(us)':>10} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} "
    f"{'#wrong':>7}"
    f" {'raw(us)':>10} {'raw busbw':>10} {'overhead(%)':>11} {'spread(%)':>15}"
)

PLOT_MISSING = (
    "--plot needs matplotlib, which is not installed. Install it with: pip install 'rlightning-comm[plot]' (or pip "
    "install matplotlib)"
)


def header(cfg: BenchConfig, world_size: int, group_size: int) -> str:
    """The lines printed before any row."""
    where = f"{torch.cuda.get_device_name()}" if cfg.device == "cuda" else f"{os.cpu_count()} CPU cores"
    return "\n".join(
        [
            (
                f"# rlightning-comm bench: backend {cfg.backend}, device {cfg.device} ({where}), {world_size} ranks, "
                f"mode {cfg.mode} (group size {group_size}), dtype {cfg.dtype}, warmup {cfg.warmup}, iters {cfg.iters}"
            ),
            "# time: the slowest rank's median per-call time; algbw = size / time; busbw = algbw * the op's bus factor "
            "for the group size;",
            "# raw: the same op on the same buffers through torch.distributed, interleaved with the library's calls, "
            "each call alone after a barrier;",
            f"# overhead: library / raw - 1 (cold, per call); spread: min..max over --repeat {cfg.repeat} runs; every "
            "result is checked.",
        ]
    )


def op_header(op: str, group_size: int) -> str:
    """The lines that open an op's block of rows."""
    factor = bus_factor(op, group_size)
    return f"#\n# {op}: bus factor {FACTOR_FORMULAS[op]} = {factor:.3f} (n = {group_size})\n{_COLUMNS}"


def format_row(row: dict[str, Any]) -> str:
    """One row, as the user watches it arrive."""
    return (
        f"{row['size']:>12} {row['elements']:>12} {row['dtype']:>8} {row['time_us']:>10.1f} {row['algbw_gbps']:>11.3f} "
        f"{row['busbw_gbps']:>11.3f} {row['wrong']:>7} {row['raw_time_us']:>10.1f} {row['raw_busbw_gbps']:>10.3f} "
        f"{row['overhead_pct']:>+11.1f} {_spread(row):>15}"
    )


def _spread(row: dict[str, Any]) -> str:
    runs = row.get("overhead_runs_pct") or []
    return f"{runs[0]:+.1f}..{runs[-1]:+.1f}" if len(runs) > 1 else "-"


def footer(rows: list[dict[str, Any]]) -> str:
    """The closing lines: the wrong-result verdict."""
    wrong = sum(r["wrong"] + r["raw_wrong"] for r in rows)
    raw = sum(r["raw_wrong"] for r in rows)
    verdict = "OK" if wrong == 0 else f"FAILED ({raw} of them on the raw torch.distributed path)"
    return f"#\n# wrong results: {wrong} {verdict}"


def meta(cfg: BenchConfig, world_size: int, group_size: int) -> dict[str, Any]:
    """Run conditions recorded beside the rows."""
    return {
        "argv": list(cfg.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": cfg.backend,
        "device": cfg.device,
        "device_name": torch.cuda.get_device_name()
        if cfg.device == "cuda"
        else platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "world_size": world_size,
        "group_size": group_size,
        "mode": cfg.mode,
        "dtype": cfg.dtype,
        "iters": cfg.iters,
        "warmup": cfg.warmup,
        "repeat": cfg.repeat,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def write_json(path: str, cfg: BenchConfig, world_size: int, group_size: int, rows: list[dict[str, Any]]) -> None:
    """Write every figure of the run to ``path``."""
    doc = {
        "meta": meta(cfg, world_size, group_size),
        "rows": rows,
        "wrong": sum(r["wrong"] + r["raw_wrong"] for r in rows),
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def write_plot(path: str, rows: list[dict[str, Any]], title: str) -> None:
    """Draw busbw against size, one line per op (raw torch.distributed dashed).

    Raises:
        RuntimeError: matplotlib is not installed (the message says how to install it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError(PLOT_MISSING) from err
    fig, ax = plt.subplots(figsize=(8, 5))
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        (line,) = ax.plot([r["size"] for r in mine], [r["busbw_gbps"] for r in mine], marker="o", label=op)
        ax.plot(
            [r["size"] for r in mine],
            [r["raw_busbw_gbps"] for r in mine],
            linestyle="--",
            color=line.get_color(),
            alpha=0.6,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title + " (dashed: raw torch.distributed)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def matplotlib_available() -> bool:
    """Whether ``--plot`` can work."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
