"""GPU check, under 5 minutes on a CUDA machine; its CPU-only parts run anywhere.

Steps (each PASS, FAIL or SKIP, with the reason):

1. ``nccl_bench``: ``rlightning-comm bench`` on NCCL, one rank per GPU (CUDA only).
2. ``gloo_cuda_bench``: the bench on gloo with CUDA tensors, 4 ranks on one GPU (CUDA only).
3. ``stats_cuda_gloo`` / ``stats_cuda_nccl``: communication stats on CUDA tensors (event timing,
   sync and async calls), counts, bytes and results against what was sent (CUDA only; gloo with
   2 ranks on one GPU, NCCL with one rank per GPU).
4. ``sequence_parallel``: scatter_to_sequence_parallel_region, gather_from_sequence_parallel_region
   and all_to_all on gloo, 4 ranks: forward against a single-process oracle on every device, and
   outputs and input gradients on CUDA against the same on CPU (SKIP when the ops are not installed).

Writes ``gpu_check.json`` (and the benches' JSON) under ``--out``; exit status 1 if a step failed.

    python benchmarks/gpu_check.py --out gpu-out            # everything the machine can run
    python benchmarks/gpu_check.py --cpu-only --out cpu-out # what runs without CUDA
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from _common import ROOT, machine, run_ranks

SP_NAMES = ("scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region", "all_to_all")


def bench_commands(out: str, gpus: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """The bench runs of steps 1 and 2: argv (after ``python -m rlightning_comm.bench``) and extra environment."""
    return {
        "nccl_bench": (["--backend", "nccl", "--nproc", str(gpus), "--sizes", "1K:64M", "--factor", "16", "--json", os.path.join(out, "nccl.json")], {}),
        "gloo_cuda_bench": (
            ["--backend", "gloo", "--device", "cuda", "--nproc", "4", "--sizes", "1K:4M", "--factor", "16", "--json", os.path.join(out, "gloo_cuda.json")],
            {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]},
        ),
    }


def run_bench(argv: list[str], env: dict[str, str], timeout: float = 150) -> dict[str, Any]:
    """Run the bench in a subprocess; PASS when it exits 0 (every result right)."""
    proc = subprocess.run(
        [sys.executable, "-m", "rlightning_comm.bench", *argv],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    print(proc.stdout, end="", flush=True)
    status = "PASS" if proc.returncode == 0 else "FAIL"
    return {"status": status, "exit": proc.returncode, "stderr_tail": proc.stderr[-2000:] if status == "FAIL" else ""}


def load_sp_ops() -> dict[str, Any] | str:
    """The sequence-parallel ops, or why they cannot be imported."""
    try:
        import rlightning_comm.sequence_parallel as sp

        return {name: getattr(sp, name) for name in SP_NAMES}
    except (ImportError, AttributeError) as err:
        return f"sequence-parallel ops not available: {err}"


def _grad_out(shape: tuple[int, ...], rank: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(4242 + rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def sp_check(rank: int, nproc: int, devices: list[str], ops: dict[str, Any] | None = None) -> dict[str, Any]:
    """Step 4 on one rank of an initialised world: forward vs oracle per device, CUDA vs CPU outputs and grads.

    ``ops`` maps the names of :data:`SP_NAMES` to callables with the seed's
    signatures; ``None`` imports them from ``rlightning_comm.sequence_parallel``.
    """
    import torch

    from rlightning_comm import CommContext, CommMode

    ops = load_sp_ops() if ops is None else ops
    if isinstance(ops, str):
        return {"status": "SKIP", "reason": ops}
    CommContext().init_group(list(range(nproc)), CommMode.SEQUENCE_PARALLEL)
    b, s_local, h, d = 2, 3, 2 * nproc, 4
    seq = s_local * nproc
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(b, seq, h, d, generator=gen, dtype=torch.float64)  # the same on every rank
    local = full[:, rank * s_local : (rank + 1) * s_local]  # this rank's sequence shard
    calls = {
        "scatter": (lambda x: ops["scatter_to_sequence_parallel_region"](x, False), full, local),
        "gather": (lambda x: ops["gather_from_sequence_parallel_region"](x, False), local, full),
        "all_to_all": (lambda x: ops["all_to_all"](x, 1, 2, CommMode.SEQUENCE_PARALLEL), local, full[:, :, rank * 2 : (rank + 1) * 2]),
    }
    results: dict[str, dict[str, Any]] = {}
    for name, (fn, x, oracle) in calls.items():
        per_device = {}
        for device in devices:
            xin = x.detach().to(device).requires_grad_(True)
            y = fn(xin)
            y.backward(_grad_out(tuple(y.shape), rank).to(device))
            per_device[device] = (y.detach().cpu(), xin.grad.detach().cpu())
        res: dict[str, Any] = {dev: bool(torch.equal(out, oracle)) for dev, (out, _) in per_device.items()}
        if "cuda" in per_device:
            (cpu_out, cpu_grad), (gpu_out, gpu_grad) = per_device["cpu"], per_device["cuda"]
            res["cuda_vs_cpu_out"] = float((cpu_out - gpu_out).abs().max())
            res["cuda_vs_cpu_grad"] = float((cpu_grad - gpu_grad).abs().max())
        results[name] = res
    ok = all(all(v for k, v in r.items() if k in devices) and r.get("cuda_vs_cpu_out", 0) == 0 and r.get("cuda_vs_cpu_grad", 0) == 0 for r in results.values())
    return {"status": "PASS" if ok else "FAIL", "devices": devices, "ops": results}


def stats_check(rank: int, nproc: int) -> dict[str, Any]:
    """Step 3 on one rank: stats on CUDA tensors (event timing), sync and async, vs what was sent."""
    import torch

    from rlightning_comm import CommContext, CommMode, collective

    if CommContext().get_communicator().backend == "gloo":
        torch.cuda.set_device(0)
    ctx = CommContext()
    ctx.reset_stats()
    ctx.enable_stats()
    t = torch.ones(1024, device=torch.device("cuda", torch.cuda.current_device()))  # 4 KiB
    for _ in range(3):
        collective.all_reduce(t, CommMode.GLOBAL)
    collective.all_reduce(t, CommMode.GLOBAL, async_op=True).wait()
    s = ctx.stats()["GLOBAL"]["all_reduce"]
    ctx.disable_stats()
    ok = s["count"] == 4 and s["bytes"] == 4 * 4096 and 0 < s["max_time_s"] <= s["total_time_s"] and s["in_flight"] == 0 and float(t[0]) == nproc**4
    return {"status": "PASS" if ok else "FAIL", "stats": s}


def _ranks_step(fn: Any, nproc: int, *args: Any, backend: str = "gloo") -> dict[str, Any]:
    try:
        results = run_ranks(fn, nproc, *args, timeout=120, backend=backend)
    except Exception as err:  # noqa: BLE001 - a failed step is reported, the others still run
        return {"status": "FAIL", "error": str(err)[-2000:]}
    worst = "FAIL" if any(r["status"] == "FAIL" for r in results) else results[0]["status"]
    return {**results[0], "status": worst, "ranks": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="GPU check for rlightning_comm (CPU-only parts run anywhere)")
    p.add_argument("--out", default="gpu-check-out", help="folder for gpu_check.json and the benches' JSON")
    p.add_argument("--cpu-only", action="store_true", help="run only what needs no CUDA")
    args = p.parse_args(argv)
    import torch

    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.cpu_only
    gpus = torch.cuda.device_count() if cuda else 0
    steps: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    for name, (bench_argv, env) in bench_commands(args.out, gpus).items():
        steps[name] = run_bench(bench_argv, env) if cuda else {"status": "SKIP", "reason": "no CUDA"}
    steps["stats_cuda_gloo"] = _ranks_step(stats_check, 2) if cuda else {"status": "SKIP", "reason": "no CUDA"}
    steps["stats_cuda_nccl"] = _ranks_step(stats_check, gpus, backend="nccl") if cuda else {"status": "SKIP", "reason": "no CUDA"}
    missing = load_sp_ops()
    if isinstance(missing, str):
        steps["sequence_parallel"] = {"status": "SKIP", "reason": missing}
    else:
        steps["sequence_parallel"] = _ranks_step(sp_check, 4, ["cpu", "cuda"] if cuda else ["cpu"])
    doc = {"machine": machine(), "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)], "seconds": time.monotonic() - started, "steps": steps}
    with open(os.path.join(args.out, "gpu_check.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, default=str)
    for name, step in steps.items():
        print(f"{name:<18} {step['status']}  {step.get('reason', '')}{step.get('error', '')}")
    print(f"# {doc['seconds']:.0f} s; {doc['machine']}; GPUs: {doc['gpus'] or 'none'}")
    return 1 if any(s["status"] == "FAIL" for s in steps.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
