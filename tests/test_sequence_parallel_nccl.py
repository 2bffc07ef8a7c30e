"""The sequence-parallel ops on CUDA tensors, on what one GPU can run: NCCL at world size 1 (every op), and gloo
with CUDA tensors on 4 ranks (every op, every gradient layout, against single-process autograd on the GPU).

Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from sp_oracle import SP, Checks, assert_all_within, data
from test_sequence_parallel_layouts import run_checks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA sequence-parallel tests need a CUDA device")


def _task_nccl_world1(rank: int, size: int, url: str) -> dict[str, float]:
    import os

    import torch.distributed as dist
    from world import init_world

    import rlightning_comm.sequence_parallel as sp

    os.environ["LOCAL_RANK"] = "0"  # NcclCommunicator picks this rank's GPU from it
    ctx = init_world(rank, size, url, backend="nccl")
    ctx.init_group([0], SP)
    dev = torch.device("cuda", torch.cuda.current_device())
    errors = run_checks(1, 0, dev)  # every op, both rank0_only settings, ulysses, every gradient layout
    chk = Checks()
    (x,) = (t.to(dev) for t in data(3, (2, 5, 4, 3)))
    # One rank: each op is the identity through every group form, and stays on the GPU.
    for form in (SP, ctx.get_communicator(SP), ctx.get_group(SP), dist.group.WORLD):
        chk.true(f"all_to_all identity via {type(form).__name__}", sp.all_to_all(x, 1, 2, form) is x)
    out = sp.ulysses_attention(x, x, x, is_causal=True)
    chk.close("ulysses equals attention on the GPU", out, sp.sdpa_bshd(x, x, x, is_causal=True))
    chk.true("ulysses stays on the GPU", out.device == dev)
    return errors | chk.errors


def test_every_op_on_nccl_at_world_size_one(world1) -> None:
    assert_all_within(world1.run(_task_nccl_world1, timeout=120))


def _task_gloo_cuda(rank: int, size: int, url: str) -> dict[str, float]:
    from sp_oracle import init_sp

    import rlightning_comm.sequence_parallel as sp

    init_sp(rank, size, url)  # gloo, with CUDA tensors (gloo stages them through the host)
    dev = torch.device("cuda", 0)
    errors = run_checks(size, rank, dev)
    chk = Checks()
    (x,) = (t.to(dev) for t in data(rank, (2, 3, 4, 3)))
    chk.true("all_to_all stays on the GPU", sp.all_to_all(x, 1, 2, SP).device == dev)
    return errors | chk.errors


def test_every_op_on_gloo_with_cuda_tensors(world4) -> None:
    assert_all_within(world4.run(_task_gloo_cuda, timeout=180))
