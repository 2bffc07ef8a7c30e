"""A custom backend: a gloo communicator that records every call, registered by name.

The class is the one in the custom-backends guide (docs/custom-backends.md), with ``broadcast`` recorded too. From the
repository root, with the package installed (``pip install .``)::

    python examples/custom_backend.py                       # 2 local ranks, no launcher
    torchrun --nproc-per-node 2 examples/custom_backend.py
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.distributed import ReduceOp
from typing_extensions import override

from rlightning_comm import CommContext, GlooCommunicator, collective, register_communicator
from rlightning_comm.launch import run


@register_communicator("recording")
class RecordingCommunicator(GlooCommunicator):
    """Counts calls and payload bytes per op, then does the real gloo collective."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    @override
    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        self.calls["all_reduce"] += 1
        self.bytes["all_reduce"] += tensor.numel() * tensor.element_size()
        return super().all_reduce(tensor, op, async_op)

    @override
    def broadcast(self, tensor, src=0, async_op=False):
        self.calls["broadcast"] += 1
        self.bytes["broadcast"] += tensor.numel() * tensor.element_size()
        return super().broadcast(tensor, src, async_op)


def main() -> None:
    ctx = CommContext()
    world = ctx.get_world_size()
    comm = ctx.init_group(list(range(world)), "RECORDED", backend="recording")
    for step in range(3):
        grads = torch.full((256,), float(step))
        collective.all_reduce(grads, "RECORDED")
    collective.broadcast(torch.zeros(16), "RECORDED", src=0)
    # all_reduce_dict packs the dict into one buffer and reduces it through self.all_reduce.
    collective.all_reduce_dict({"loss": 1.0, "acc": 0.5}, "RECORDED")
    print(
        f"[rank {ctx.get_global_rank()}] {type(comm).__name__} calls={dict(comm.calls)} bytes={dict(comm.bytes)}",
        flush=True,
    )


if __name__ == "__main__":
    run(main, 2)
