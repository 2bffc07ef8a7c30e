"""The GPU check's command: its options, the report after every step, and the summary (see the package's docstring)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ._launch import ROOT, kill_all
from ._steps import NEEDS, RUNNERS, STEPS, Plan, bench_commands

__all__ = ["STEPS", "bench_commands", "main", "summary_lines"]


def environment(cuda: bool) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cuda_available": torch.cuda.is_available(),
    }
    if cuda:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as err:  # noqa: BLE001 - informative only
            info["nccl"] = repr(err)
    return info


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """The short summary: one line per step (its cells' statuses, or why it was skipped), then what failed."""
    lines = []
    for name, step in doc["steps"].items():
        runs = step.get("runs", {})
        totals: dict[str, int] = {}
        for run in runs.values():
            for status, n in run.get("counts", {}).items():
                totals[status] = totals.get(status, 0) + n
        detail = ", ".join(f"{k} {v}" for k, v in sorted((totals or step.get("summary", {})).items()))
        if step.get("reason"):
            detail = step["reason"] + (f" ({detail})" if detail else "")
        lines.append(f"{name:<14} {step['status']:<5} {step.get('seconds', 0):6.1f} s  {detail}")
        for run_name, run in runs.items():
            if run["status"] not in ("ok", "skipped"):
                stuck = [
                    f"rank {r['rank']} in {r['unfinished_cell']!r}"
                    for r in run.get("ranks", [])
                    if r.get("unfinished_cell")
                ]
                lines.append(f"    {run_name}: {run['status']}" + (f" ({', '.join(stuck)})" if stuck else ""))
            lines += [f"    {run_name}: {line}" for line in run.get("failing", [])[:8]]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="GPU check for rlightning_comm: verify the NCCL paths on one GPU in minutes, "
        "with a JSON report of every cell"
    )
    p.add_argument(
        "--out",
        default="gpu-check-out",
        help="folder for gpu_check.json, every run's cells and logs (default gpu-check-out)",
    )
    p.add_argument(
        "--cpu-only",
        action="store_true",
        help="skip every CUDA step (automatic without CUDA); the CPU self-tests still run",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=520.0,
        help="the whole check's deadline in seconds; steps that no longer fit are skipped (default 520)",
    )
    p.add_argument(
        "--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)} (default all)"
    )
    p.add_argument(
        "--inject-wrong", action="store_true", help=argparse.SUPPRESS
    )  # test hook: a world whose all_reduce is wrong
    p.add_argument(
        "--quick", action="store_true", help=argparse.SUPPRESS
    )  # test hook: step 1's first run only, on a few cells
    args = p.parse_args(argv)
    import torch

    chosen = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(STEPS))
    if unknown:
        p.error(f"unknown steps {unknown}; choose from {list(STEPS)}")
    cuda = torch.cuda.is_available() and not args.cpu_only
    plan = Plan(args, cuda)
    plan.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    doc: dict[str, Any] = {
        "command": [sys.executable, *sys.argv] if argv is None else ["benchmarks/gpu_check", *argv],
        "root": str(ROOT),
        "budget_s": args.budget_s,
    }
    doc.update(cuda=cuda, environment=environment(cuda), steps={})
    report = plan.out / "gpu_check.json"
    previous = signal.signal(signal.SIGTERM, _stopped)
    try:
        return _run_steps(plan, chosen, doc, report, started)
    finally:
        kill_all()  # an interrupted check leaves no rank holding the GPU
        signal.signal(signal.SIGTERM, previous)


def _stopped(signum: int, frame: Any) -> None:
    raise SystemExit(f"gpu_check stopped by signal {signum}; the report holds the steps that finished")


def _run_steps(plan: Plan, chosen: list[str], doc: dict[str, Any], report: Path, started: float) -> int:
    args = plan.args
    for name in STEPS:
        t0 = time.time()
        if name not in chosen:
            step: dict[str, Any] = {"status": "SKIP", "reason": "not selected (--steps)"}
        else:
            try:
                step = RUNNERS[name](plan)
            except Exception as err:  # noqa: BLE001 - a step's own failure is recorded; the next step still runs
                import traceback

                step = {
                    "status": "FAIL",
                    "reason": f"the step itself raised {type(err).__name__}: {err}",
                    "traceback": traceback.format_exc()[-3000:],
                }
        doc["steps"][name] = {"needs": NEEDS[name], **step, "seconds": round(time.time() - t0, 1)}
        doc["seconds"] = round(time.time() - started, 1)
        report.write_text(json.dumps(doc, indent=1, default=str))  # after every step: a killed check keeps what it did
        print(summary_lines({"steps": {name: doc["steps"][name]}})[0], flush=True)
    print("\n".join(summary_lines(doc)))
    print(
        f"# {doc['seconds']:.0f} s of {args.budget_s:.0f}; "
        f"{'CUDA: ' + ', '.join(doc['environment'].get('gpus', [])) if plan.cuda else 'no CUDA'}; report {report}"
    )
    return 1 if any(s["status"] == "FAIL" for s in doc["steps"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
