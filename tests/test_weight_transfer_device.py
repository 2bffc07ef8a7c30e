"""broadcast_state_dict the way a device backend runs it, and on a group outside torch's world.

A stand-in communicator whose backend is not gloo makes a gloo group take NCCL's path: the handshake all-gathers, the
manifest and every unit are broadcasts. On CPU that checks the path's logic and that it needs no world (no world store,
no world group: the group is built from a store of its own, as a cross-world connection builds it); with a GPU, the same
stand-in on ``cuda:0`` checks that the handshake waits for nothing the caller queued and reads no device tensor back
with ``tolist``/``item``, and that host tensors are staged through pinned memory.
"""

from __future__ import annotations

from datetime import timedelta
from typing import ClassVar

import pytest
import torch
from test_weight_transfer import BIG, digests

from rlightning_comm import GlooCommunicator


class StandIn(GlooCommunicator):
    """A gloo group taking the path of a device backend (not point to point)."""

    backend: ClassVar[str] = "stand-in"


class CudaStandIn(StandIn):
    """The same on ``cuda:0``: gloo moves CUDA tensors through the host."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


class Counting:
    """A process group that counts the calls made on it (torch's profiler costs seconds to start in a process)."""

    def __init__(self, group) -> None:
        self._group, self.calls = group, {}

    def __getattr__(self, name: str):
        method = getattr(self._group, name)
        if name not in ("allgather", "broadcast", "send", "recv"):
            return method

        def call(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return method(*args, **kwargs)

        return call


def _own_group(rank: int, size: int, url: str, cls: type, name: str):
    """A communicator on a gloo group built from a store of its own, with no world at all; the mode's ranks are
    0..size-1."""
    import torch.distributed as dist

    path = url.removeprefix("file://") + f".{name}"
    group = Counting(dist.ProcessGroupGloo(dist.FileStore(path, size), rank, size, timedelta(seconds=60)))
    comm = cls(group, range(size), name, timeout=60)
    comm._global_rank, comm._rank = rank, rank  # what a connected mode has: this process's rank in the mode's numbering
    return comm


def _state(rank: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    state = {f"small.{i}": torch.randn(16, generator=gen) for i in range(5)}
    state["big"] = torch.randn(*BIG, generator=gen)
    state["big_t"] = torch.randn(*BIG, generator=gen).t()
    state["ids"] = torch.arange(9) * (rank + 1)
    state["c"] = torch.randn(4, 3, generator=gen, dtype=torch.complex64).conj()
    if device != "cpu":  # every other tensor on the GPU: host tensors go through the device's staging buffers
        state = {name: t.to(device) if i % 2 else t for i, (name, t) in enumerate(state.items())}
    return state


def _no_world(rank: int, size: int, url: str) -> dict:
    import torch.distributed as dist

    from rlightning_comm.weights.broadcast._call import transfer

    assert not dist.is_initialized()
    out: dict = {}
    for cls, name in ((GlooCommunicator, "P2P"), (StandIn, "BCAST")):
        comm = _own_group(rank, size, url, cls, name)
        state = _state(rank)
        out[f"{name}.before"] = digests(state.items())
        loaded: dict[str, torch.Tensor] = {}

        def load(named, loaded=loaded) -> None:
            loaded.update((n, t.clone()) for n, t in named)

        counts = []
        for _ in range(2):
            comm.group.calls = {}
            transfer(comm, load if rank == 2 else state, 0, 1 << 20, False)
            counts.append(comm.group.calls)
        out[f"{name}.after"] = digests(loaded.items() if rank == 2 else state.items())
        out[f"{name}.counts"] = counts
    return out


def test_a_group_outside_the_world_and_the_device_backends_path(world4) -> None:
    results = world4.run(_no_world, timeout=90)
    source = results[0]
    for name in ("P2P", "BCAST"):
        assert source[f"{name}.after"] == source[f"{name}.before"]
        for rank, r in enumerate(results[1:], start=1):
            assert r[f"{name}.before"] != source[f"{name}.before"] and r[f"{name}.after"] == source[f"{name}.before"], (
                name,
                rank,
            )
    # The device backends' path, steady state: one all-gather for the handshake, a broadcast per unit (3: "big" in
    # place, "big_t" staged, one bucket of the rest), nothing point to point.
    for r in results:
        first, steady = r["BCAST.counts"]
        assert steady == {"allgather": 1, "broadcast": 3}, steady
        # ... and the manifest (2 broadcasts), and a second round.
        assert first == {"allgather": 2, "broadcast": 3 + 2}, first
    # Over gloo point to point: the exchange through group rank 0 and the units are sends and receives only.
    for rank, r in enumerate(results):
        steady = r["P2P.counts"][1]
        assert set(steady) <= {"send", "recv"} and steady.get("recv", 0) >= 1, (rank, steady)


def _cuda_stand_in(rank: int, size: int, url: str) -> dict:
    from rlightning_comm.weights.broadcast._call import transfer
    from rlightning_comm.weights.core._memory import kept

    comm = _own_group(rank, size, url, CudaStandIn, "CUDA")
    state = _state(rank, "cuda:0")
    before = digests(state.items())
    read_back: list[str] = []
    tolist, item = torch.Tensor.tolist, torch.Tensor.item

    def watched(original):
        def call(self, *args, **kwargs):
            if self.is_cuda:
                read_back.append(original.__name__)
            return original(self, *args, **kwargs)

        return call

    torch.Tensor.tolist, torch.Tensor.item = watched(tolist), watched(item)
    try:
        for _ in range(2):
            busy = torch.cuda._sleep(int(1e8))  # queued work on the caller's stream: the handshake must not wait for it
            transfer(comm, state, 0, 1 << 20, False)
            del busy
    finally:
        torch.Tensor.tolist, torch.Tensor.item = tolist, item
    torch.cuda.synchronize()
    memory = kept(comm)
    return {
        "before": before,
        "after": digests(state.items()),
        "read_back": read_back,
        "side_stream": memory.stream is not None,
        "pinned": [m is not None and m[0].is_pinned() for m in memory.mirrors],
    }


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tensors need a GPU; this machine has none")
def test_cuda_staging_reads_nothing_back_and_stages_host_tensors_through_pinned_memory(world2) -> None:
    source, dst = world2.run(_cuda_stand_in, timeout=120)
    assert dst["before"] != source["before"] and dst["after"] == source["before"] == source["after"]
    for r in (source, dst):
        assert r["read_back"] == [] and r["side_stream"], r
        assert any(r["pinned"]), r
