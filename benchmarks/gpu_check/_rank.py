"""One rank of a GPU check run: ``python -m benchmarks.gpu_check._rank SPEC_JSON RANK`` in the checkout (started by
:mod:`._launch`).

The spec names the run (see :data:`RUNS`), the backend, the device, the world's timeout, the root and what part of the
matrix to run. Every outcome goes to this rank's JSON-lines file as it happens; a dump of every thread's stack goes to
the log shortly before the parent would kill a hung rank. The process ends with ``os._exit``, so no interpreter teardown
(torch's atexit hooks on a broken NCCL group) can hang it.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rlightning_comm import CommContext

from . import _comms as comms
from . import _matrix as matrix
from . import _probes as probes
from ._cells import Lockstep, Recorder


def _device(spec: dict[str, Any]) -> torch.device:
    return torch.device("cuda", 0) if spec["device"] == "cuda" else torch.device("cpu")


def _matrix(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: spec["matrix"][k] for k in ("ops", "dtypes", "calls", "modes") if spec.get("matrix", {}).get(k)}


def world1(rec: Recorder, spec: dict[str, Any], rank: int) -> None:
    """Step 1: the process group's returns, then the whole matrix on the world."""
    probes.pg_returns(rec, _device(spec))
    matrix.run_matrix(rec, "GLOBAL", _device(spec), spec.get("root", 0), **_matrix(spec))


def matrix_only(rec: Recorder, spec: dict[str, Any], rank: int) -> None:
    """Part of the matrix on the world, the last rank as root."""
    matrix.run_matrix(rec, "GLOBAL", _device(spec), dist.get_world_size() - 1, **_matrix(spec))


def bounded(rec: Recorder, spec: dict[str, Any], rank: int) -> None:
    """Step 1, ``bounded_wait=True``: the flag reached the communicator, then a few ops."""
    comm = CommContext().get_communicator()
    want = comm.backend == "nccl"
    rec.run(
        "bounded_wait is on",
        lambda: None if comm.bounded_wait == want else ("wrong", f"bounded_wait={comm.bounded_wait} on {comm.backend}"),
    )
    matrix.run_matrix(rec, "GLOBAL", _device(spec), spec.get("root", 0), **_matrix(spec))


def pairs(rec: Recorder, spec: dict[str, Any], rank: int) -> None:
    """Step 3: several ranks of the world's backend: returns, the matrix with the last rank as root, gradients,
    refusals, groups."""
    device = _device(spec)
    probes.pg_returns(rec, device)
    matrix.run_matrix(rec, "GLOBAL", device, dist.get_world_size() - 1, **_matrix(spec))
    probes.sp_gradients(rec, device)
    probes.refusal_travels(rec, "GLOBAL", device)
    probes.groups(rec, device)


def branches(rec: Recorder, spec: dict[str, Any], rank: int) -> None:
    """Step 4: the matrix through the test-only communicator on a gloo group, staging on the device."""
    device = _device(spec)
    comms.set_cuda_gloo_device(device)
    n = dist.get_world_size()
    rec.run(
        "init_group(CUDA_GLOO)", lambda: CommContext().init_group(list(range(n)), "CUDA_GLOO", backend=comms.CUDA_GLOO)
    )
    matrix.run_matrix(rec, "CUDA_GLOO", device, n - 1, **_matrix(spec))
    probes.refusal_travels(rec, "CUDA_GLOO", device)


def skip_call(rec: Recorder, spec: dict[str, Any], rank: int) -> None:
    """Step 3's probe: a call that one rank skips."""
    probes.skip_call(rec, _device(spec), spec["store"], spec["probe_timeout"], spec.get("hold_s", 60))


def smoke(rec: Recorder, spec: dict[str, Any], rank: int) -> None:
    probes.smoke(rec, spec["backend"], _device(spec), rank, spec["nproc"], spec["store"], spec["timeout"])


def connect(rec: Recorder, spec: dict[str, Any], rank: int) -> None:
    probes.connect(rec, spec["backend"], _device(spec), rank, spec["nproc"], spec["store"], spec["timeout"])


# name -> (function, whether this program initialises the world first and destroys it after)
RUNS: dict[str, tuple[Callable[[Recorder, dict[str, Any], int], None], bool]] = {
    "world1": (world1, True),
    "matrix": (matrix_only, True),
    "bounded": (bounded, True),
    "pairs": (pairs, True),
    "branches": (branches, True),
    "skip_call": (skip_call, True),  # rank 0 destroys its context in the probe; the skipping rank just leaves
    "smoke": (smoke, False),
    "connect": (connect, False),
}


def environment(device: torch.device) -> dict[str, Any]:
    """What this rank runs on (recorded once per rank)."""
    info: dict[str, Any] = {"torch": torch.__version__, "pid": os.getpid(), "cuda_available": torch.cuda.is_available()}
    info.update(
        {
            k: v
            for k, v in os.environ.items()
            if k.startswith(("NCCL_", "TORCH_NCCL", "CUDA_VISIBLE", "LOCAL_", "GLOO_"))
        }
    )
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["device_count"] = torch.cuda.device_count()
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as err:  # noqa: BLE001 - informative only
            info["nccl"] = repr(err)
    return info


def main(spec: dict[str, Any], rank: int) -> None:
    kill_at = spec["kill_at"]
    faulthandler.enable()  # a crash in C++ still prints the Python stack
    faulthandler.dump_traceback_later(max(1.0, kill_at - time.time() - 2), exit=False)
    size = spec["nproc"]
    lockstep = (
        Lockstep(dist.FileStore(os.path.join(spec["store"], "lockstep"), size), rank, size, spec.get("lockstep_s", 60))
        if size > 1
        else None
    )
    rec = Recorder(
        spec["cells"].format(rank=rank), rank, deadline=kill_at - spec.get("reserve_s", 5), lockstep=lockstep
    )
    device = _device(spec)
    rec.note(environment=environment(device))
    run, owns_world = RUNS[spec["run"]]
    ctx = CommContext()
    if owns_world:
        backend = comms.WRONG_GLOO if spec.get("inject_wrong") else spec["backend"]
        url = f"file://{spec['store']}/world"
        bounded = spec.get("bounded", False)
        init = functools.partial(
            ctx.init_distributed_env,
            world_size=size,
            rank=rank,
            backend=backend,
            dist_url=url,
            timeout=spec["timeout"],
            bounded_wait=bounded,
        )
        if rec.run("init_distributed_env", init, backend=backend)["status"] != "ok":
            return
    run(rec, spec, rank)
    if owns_world and ctx.is_initialized() and spec["run"] != "skip_call":
        rec.lockstep = None  # teardown is local
        rec.run("destroy", ctx.destroy, min_s=0)
    rec.note(end=True)


if __name__ == "__main__":
    try:
        main(json.loads(sys.argv[1]), int(sys.argv[2]))
    except BaseException:  # noqa: BLE001 - the traceback goes to the log; the exit status says it failed
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(3)
    sys.stdout.flush()
    os._exit(0)
