"""The sequence-parallel ops on NCCL (two GPUs): values and gradients against single-process torch on the GPU.

Skipped without two CUDA devices.
"""

from __future__ import annotations

import pytest
import torch
from sp_oracle import SP, Checks, assert_all_within

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL sequence-parallel tests need two CUDA devices")


def _task_nccl(rank: int, size: int, url: str) -> dict[str, float]:
    import os

    from world import init_world

    import rlightning_comm.sequence_parallel as sp

    os.environ["LOCAL_RANK"] = str(rank)  # NcclCommunicator picks this rank's GPU from it
    ctx = init_world(rank, size, url, backend="nccl")
    ctx.init_group(list(range(size)), SP)
    dev = torch.device("cuda", torch.cuda.current_device())
    chk = Checks()
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(2, 7, 4, 8, generator=gen, dtype=torch.float64).to(dev)  # 7 tokens: uneven over 2 ranks
    W = torch.randn(2, 7, 4, 8, generator=gen, dtype=torch.float64).to(dev)
    lens = sp.sequence_split_sizes(7, size)

    # all_to_all alone (Ulysses layout), on the input's device.
    full = X.clone().requires_grad_()
    parts = full.split(lens, 1)
    ref_loss = sum((full.chunk(size, 2)[r] * W.chunk(size, 2)[r]).sum() for r in range(size))
    (ref_grad,) = torch.autograd.grad(ref_loss, full)
    x = parts[rank].detach().clone().requires_grad_()
    y = sp.all_to_all(x, 1, 2, SP)
    (y * W.chunk(size, 2)[rank]).sum().backward()
    chk.true("all_to_all stays on the input's device", y.device == dev)
    chk.equal("all_to_all forward", y, X.chunk(size, 2)[rank])
    chk.close("all_to_all grad", x.grad, ref_grad.split(lens, 1)[rank])

    # Ulysses attention inside scatter/gather against attention on the whole sequence.
    rq = X.clone().requires_grad_()
    ref = sp.sdpa_bshd(rq, rq, rq, is_causal=True)
    (ref * W).sum().backward()
    q = X.clone().requires_grad_()
    local = sp.scatter_to_sequence_parallel_region(q, False)
    out = sp.gather_from_sequence_parallel_region(sp.ulysses_attention(local, local, local, is_causal=True), False)
    (out * W).sum().backward()
    chk.close("ulysses forward", out, ref)
    chk.close("ulysses grad", q.grad, rq.grad)

    # A CPU tensor on an NCCL group is refused before any collective starts.
    try:
        sp.all_to_all(X.cpu(), 1, 2, SP)
        chk.true("cpu tensor refused", False)
    except ValueError as err:
        chk.true("cpu tensor refused", "NCCL" in str(err))
    return chk.errors


def test_ops_on_nccl(world2) -> None:
    assert_all_within(world2.run(_task_nccl, timeout=120))
