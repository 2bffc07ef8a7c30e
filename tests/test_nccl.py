"""NCCL at world size 1 (one GPU): every facade against raw torch.distributed. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from rlightning_comm import CommContext, CommMode, NcclCommunicator, broadcast_state_dict, collective

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs CUDA; this machine has none")


def test_every_op_on_nccl_world_size_one(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    ctx = CommContext()
    comm = ctx.init_distributed_env(
        world_size=1, rank=0, backend="nccl", dist_url=f"file://{tmp_path}/store", timeout=60
    )
    assert isinstance(comm, NcclCommunicator) and comm.device.type == "cuda"
    dev = comm.device
    g = CommMode.GLOBAL
    for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX):
        ours, raw = torch.arange(4.0, device=dev), torch.arange(4.0, device=dev)
        collective.all_reduce(ours, g, op=op)
        dist.all_reduce(raw, op=op)
        assert torch.equal(ours, raw)
    with pytest.raises(ValueError, match="not supported by NcclCommunicator"):
        collective.all_reduce(torch.ones(1, dtype=torch.int64, device=dev), g, op=ReduceOp.BAND)
    with pytest.raises(ValueError, match="expects a CUDA tensor"):
        collective.all_reduce(torch.ones(1), g)
    out = torch.empty(3, device=dev)
    collective.all_gather(out, torch.arange(3.0, device=dev), g)
    assert torch.equal(out, torch.arange(3.0, device=dev))
    t = torch.ones(2, device=dev)
    assert collective.broadcast(t, g, src=0, async_op=True).wait()
    gl = [torch.zeros(2, device=dev)]
    collective.gather(t, g, gather_list=gl, dst=0)
    assert torch.equal(gl[0], t)
    s = torch.zeros(2, device=dev)
    collective.scatter(s, g, scatter_list=[torch.full((2,), 5.0, device=dev)], src=0)
    assert torch.equal(s, torch.full((2,), 5.0, device=dev))
    objs = [{"a": 1}]
    collective.broadcast_object_list(objs, g)
    assert objs == [{"a": 1}]
    got = collective.all_reduce_dict({"x": 2, "y": torch.ones(2, device=dev)}, g)
    assert got["x"] == 2.0 and got["y"].device == dev
    # Weight transfer broadcasts each unit on NCCL: GPU tensors in place, host ones (and a transposed one) through the
    # GPU buckets.
    weights = {
        "w": torch.randn(512, 512, device=dev),
        "w_t": torch.randn(64, 32, device=dev).t(),
        "host": torch.arange(5.0),
        "b": torch.ones(3, dtype=torch.bfloat16, device=dev),
    }
    kept = {name: t.clone() for name, t in weights.items()}
    broadcast_state_dict(weights, g, src=0, bucket_bytes=4096)
    assert all(
        torch.equal(weights[name], kept[name]) and weights[name].device == kept[name].device for name in kept
    )  # the source's tensors are only read
    collective.barrier(g)
