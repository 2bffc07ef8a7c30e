"""What the vLLM backend hands vLLM's weight loaders: a checkpoint tensor of which this worker holds one block, which
answers for the whole tensor and gives its elements only through a narrow inside the block (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlightning_comm import TensorSlice
from rlightning_comm.integrations.vllm._views import CheckpointBlock, checkpoint_view

FULL = torch.arange(10 * 4, dtype=torch.float32).reshape(10, 4)


def _rows(start: int, stop: int) -> torch.Tensor:
    return checkpoint_view(TensorSlice(FULL[start:stop].clone(), (start, 0), (10, 4)), "w")


def test_it_answers_for_the_whole_tensor():
    v = _rows(4, 7)
    assert isinstance(v, CheckpointBlock)
    assert v.shape == (10, 4) and v.size() == (10, 4) and v.size(0) == 10 and v.dim() == v.ndim == 2
    assert v.numel() == 40 and len(v) == 10 and v.dtype == torch.float32 and v.device.type == "cpu"
    assert "elements [4:7, 0:4]" in repr(v)
    v.shard_id = "k"  # vLLM's name mappers tag the tensors they pass on
    assert v.shard_id == "k"


def test_a_narrow_inside_the_block_gives_its_elements():
    v = _rows(4, 7)
    for out, expected in ((v.narrow(0, 4, 3), FULL[4:7]), (torch.narrow(v, 0, 5, 2), FULL[5:7])):
        assert type(out) is torch.Tensor and torch.equal(out, expected)
    cols = checkpoint_view(TensorSlice(FULL[:, 2:].clone(), (0, 2), (10, 4)), "w")
    assert torch.equal(cols.narrow(1, 2, 2), FULL[:, 2:])
    assert torch.equal(cols.narrow(-1, 3, 1), FULL[:, 3:])


def test_a_narrow_of_a_block_of_two_dimensions_stays_a_block_until_whole():
    block = checkpoint_view(TensorSlice(FULL[2:6, 1:3].clone(), (2, 1), (10, 4)), "w")
    rows = block.narrow(0, 2, 4)
    assert isinstance(rows, CheckpointBlock) and rows.shape == (4, 4)
    assert torch.equal(rows.narrow(1, 1, 2), FULL[2:6, 1:3])


def test_whole_tensors_are_handed_as_they_are():
    t = FULL.clone()
    assert checkpoint_view(TensorSlice(t, (0, 0), (10, 4)), "w") is t


def test_reading_outside_the_block_or_using_it_otherwise_raises_naming_it():
    v = _rows(4, 7)
    with pytest.raises(ValueError, match=r"loader of 'w' reads elements 3:5 of dimension 0; this worker received 4:7"):
        v.narrow(0, 3, 2)
    with pytest.raises(TypeError, match=r"loader of 'w' used it through .*copy_.*elements \[4:7, 0:4\]"):
        torch.zeros(10, 4).copy_(v)
    with pytest.raises(TypeError, match="loader of 'w'"):
        v.sum()
    with pytest.raises(TypeError):
        _ = v + 1


def test_vllms_copy_counter_sees_only_the_real_copy():
    seen = []

    class Count(TorchDispatchMode):  # what vLLM's layerwise reload runs a loader under
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    target = torch.zeros(3, 4)
    with Count():
        target.copy_(_rows(4, 7).narrow(0, 4, 3))
    assert torch.equal(target, FULL[4:7]) and torch.ops.aten.copy_.default in seen
