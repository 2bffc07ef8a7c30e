"""The CPU-only parts of benchmarks/gpu_check.py: its plan, its import guard, and its sequence-parallel check.

The check's machinery (oracles, gradients, verdicts) is exercised with stand-in
ops built from torch.distributed.nn.functional, and with a deliberately wrong
one; the library's own ops run through it once they are installed.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
from world import init_world

from rlightning_comm.bench.cli import build_parser

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


def _gpu_check():
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    return importlib.import_module("gpu_check")


def _stand_in_ops(wrong_gather: bool = False):
    import torch
    import torch.distributed.nn.functional as dnn

    from rlightning_comm import CommContext

    def group():
        return CommContext().get_group("SEQUENCE_PARALLEL")

    def scatter(x, rank0_only=True):
        return x.tensor_split(CommContext().get_world_size("SEQUENCE_PARALLEL"), dim=1)[CommContext().get_local_rank("SEQUENCE_PARALLEL")]

    def gather(x, rank0_only=True):
        parts = list(dnn.all_gather(x.contiguous(), group=group()))
        return torch.cat(parts[::-1] if wrong_gather else parts, dim=1)

    def all_to_all(x, gather_dim, scatter_dim, group_):
        n = CommContext().get_world_size(group_)
        inputs = [c.contiguous() for c in x.tensor_split(n, dim=scatter_dim)]
        outputs = [torch.empty_like(inputs[0]) for _ in range(n)]
        return torch.cat(dnn.all_to_all(outputs, inputs, group=group()), dim=gather_dim)

    return {"scatter_to_sequence_parallel_region": scatter, "gather_from_sequence_parallel_region": gather, "all_to_all": all_to_all}


def _sp_task(rank, size, url, which):
    init_world(rank, size, url)
    check = _gpu_check()
    ops = None if which == "library" else _stand_in_ops(wrong_gather=which == "wrong")
    return check.sp_check(rank, size, ["cpu"], ops)


def test_sp_check_passes_right_ops_and_fails_wrong_ones(world2):
    right = world2.run(_sp_task, "stand-in")
    assert [r["status"] for r in right] == ["PASS", "PASS"]
    assert right[0]["ops"] == {name: {"cpu": True} for name in ("scatter", "gather", "all_to_all")}
    wrong = world2.run(_sp_task, "wrong")
    assert [r["status"] for r in wrong] == ["FAIL", "FAIL"]
    assert wrong[0]["ops"]["gather"] == {"cpu": False} and wrong[0]["ops"]["scatter"] == {"cpu": True}


@pytest.mark.skipif(isinstance(_gpu_check().load_sp_ops(), str), reason="the library's sequence-parallel ops arrive with issue 3")
def test_sp_check_passes_the_librarys_ops_on_cpu(world2):
    assert [r["status"] for r in world2.run(_sp_task, "library")] == ["PASS", "PASS"]


def test_missing_sp_ops_are_reported_not_raised(monkeypatch):
    monkeypatch.setitem(sys.modules, "rlightning_comm.sequence_parallel", None)
    reason = _gpu_check().load_sp_ops()
    assert isinstance(reason, str) and "not available" in reason


def test_gpu_bench_commands_are_valid_bench_arguments(tmp_path):
    commands = _gpu_check().bench_commands(str(tmp_path), gpus=8)
    nccl = build_parser().parse_args(commands["nccl_bench"][0])
    assert (nccl.backend, nccl.nproc) == ("nccl", 8)
    gloo = build_parser().parse_args(commands["gloo_cuda_bench"][0])
    assert (gloo.backend, gloo.device, gloo.nproc) == ("gloo", "cuda", 4)
    assert commands["gloo_cuda_bench"][1]["CUDA_VISIBLE_DEVICES"].isdigit()  # all 4 ranks on one GPU
