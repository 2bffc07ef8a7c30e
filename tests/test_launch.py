"""rlightning_comm.run (``launch.run``): the environment its ranks see, ``init_distributed_env`` inside them, failures,
bad arguments."""

from __future__ import annotations

import json
import multiprocessing.forkserver
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from rlightning_comm import launch, run
from rlightning_comm.errors import CommError

PLACEMENT = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
)


def _report_then_fail_on_rank_one(out_dir: str) -> None:
    import os

    from rlightning_comm import CommContext, collective

    ctx = CommContext()
    rank = ctx.get_global_rank()
    seen = {name: os.environ.get(name) for name in (*PLACEMENT, "RLC_CALLER_SET")}
    # What a newcomer pastes from a torchrun script: the launcher's world already, so a no-op.
    same = ctx.init_distributed_env(backend="gloo", timeout=20) is ctx.get_communicator()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"env": seen, "same": same}))
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    collective.barrier()


def test_local_ranks_get_the_callers_environment_and_torchruns_placement_and_a_failed_rank_stops_the_others(
    monkeypatch, tmp_path
):
    for name in PLACEMENT:
        monkeypatch.delenv(name, raising=False)
    launch._process_context()
    if sys.platform.startswith("linux"):
        # The fork server exists before the variable: its ranks must get it anyway.
        multiprocessing.forkserver.ensure_running()
    monkeypatch.setenv("RLC_CALLER_SET", "at run()")  # the ranks start with the caller's environment at the call
    with pytest.raises(RuntimeError, match=r"local ranks failed: exit codes \{.*'rank1': 1"):
        run(_report_then_fail_on_rank_one, 2, str(tmp_path), timeout=20)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        expected = dict(zip(PLACEMENT, map(str, (rank, 2, rank, 2, 0, 1, rank, 2)))) | {"RLC_CALLER_SET": "at run()"}
        assert report == {"env": expected, "same": True}, report


def _init_again(rank: int, size: int) -> dict[str, object]:
    import os

    from rlightning_comm import CommContext

    ctx = CommContext()
    world = ctx.get_communicator()
    same = [
        ctx.init_distributed_env(),  # asks for nothing in particular: the world run() set up
        ctx.init_distributed_env(backend="gloo"),
        ctx.init_distributed_env(backend="gloo", timeout=20),
        ctx.init_distributed_env(size, rank, "gloo", "env://", timedelta(seconds=20)),
        ctx.init_distributed_env(world_size=size, backend="gloo", dist_url=ctx._require_world().dist_url, timeout=20.0),
    ]
    refused = {}
    for name, kwargs in {
        "backend": {"backend": "nccl"},
        "timeout": {"timeout": 1800},
        "world_size": {"world_size": size + 1, "backend": "gloo", "timeout": 20},
        "rank": {"rank": 1 - rank, "backend": "gloo", "timeout": 20},
        "url": {"backend": "gloo", "timeout": 20, "dist_url": "tcp://127.0.0.1:1"},
        "bounded_wait": {"backend": "gloo", "timeout": 20, "bounded_wait": True},
    }.items():
        try:
            ctx.init_distributed_env(**kwargs)
        except CommError as err:
            refused[name] = str(err)
    try:
        ctx.init_distributed_env(world_size=0, backend="gloo", timeout=20)
    except ValueError:  # a bad value is still a bad value (pydantic's ValidationError)
        refused["bad"] = "ValueError"
    return {"same": all(c is world for c in same), "refused": refused, "env": os.environ["LOCAL_RANK"]}


def _launched_task(rank: int, size: int, url: str) -> dict[str, object]:
    import os

    out: dict[str, object] = {}
    # What each local rank of run() executes, on the suite's reusable ranks.
    launch._rank_main(
        lambda: out.update(_init_again(rank, size)), (), rank, size, "gloo", url, 20, env=dict(os.environ)
    )
    return out


def test_init_distributed_env_in_a_launched_function_is_a_no_op_for_its_world_and_an_error_naming_it_otherwise(world2):
    for rank, out in enumerate(world2.run(_launched_task)):
        assert out["same"] is True and out["env"] == str(rank), out
        refused = out["refused"]
        assert set(refused) == {"backend", "timeout", "world_size", "rank", "url", "bounded_wait", "bad"}, refused
        head = (
            f"rlightning_comm.launch.run already initialised this process's world with world_size=2, rank={rank}, "
            "backend='gloo', timeout=20 s, bounded_wait=False"
        )
        assert all(
            refused[k].startswith(head) for k in ("backend", "timeout", "world_size", "rank", "url", "bounded_wait")
        ), refused
        assert (
            "asked for backend='nccl'." in refused["backend"]
            and "asked for timeout=1800.0." in refused["timeout"]
            and "pass the backend, timeout and bounded_wait to run()" in refused["timeout"]
        )
        assert "asked for bounded_wait=True." in refused["bounded_wait"], refused
        assert (
            "asked for world_size=3." in refused["world_size"] and f"asked for rank={1 - rank}." in refused["rank"]
        ), refused
        assert "asked for dist_url='tcp://127.0.0.1:1'." in refused["url"] and refused["bad"] == "ValueError", refused


def test_nccl_with_more_ranks_than_gpus_is_refused_before_spawning(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(launch.mp, "get_context", lambda *a: pytest.fail("spawned ranks for a refused call"))
    with pytest.raises(ValueError, match=r"nproc must be at most torch.cuda.device_count\(\) = 1; got nproc=2"):
        run(_report_then_fail_on_rank_one, 2, backend="nccl")


@pytest.mark.parametrize("nproc", [0, -1, 1.5, True])
def test_a_bad_nproc_is_refused(monkeypatch, nproc):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="nproc must be a positive integer"):
        run(_report_then_fail_on_rank_one, nproc)
