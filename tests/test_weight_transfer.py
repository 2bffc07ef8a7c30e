"""broadcast_state_dict on a real gloo world: bit-identical destinations, collectives bounded by buckets, errors on every rank."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from torch import nn
from world import init_world

N_EXTRA = 12  # small extra parameters, so a per-tensor transfer would need far more collectives than buckets
BUCKET_BYTES = 256


class Mixed(nn.Module):
    """float32 and bfloat16 parameters, int64 and bool buffers, many small tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 8)
        self.head = nn.Linear(8, 3).to(torch.bfloat16)
        self.extra = nn.ParameterList([nn.Parameter(torch.zeros(i + 1)) for i in range(N_EXTRA)])
        self.register_buffer("steps", torch.zeros(5, dtype=torch.int64))
        self.register_buffer("mask", torch.zeros(7, dtype=torch.bool))


def randomise(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.dtype == torch.bool:
                t.copy_(torch.randint(0, 2, t.shape, generator=gen).bool())
            elif t.dtype == torch.int64:
                t.copy_(torch.randint(-(2**62), 2**62, t.shape, generator=gen))
            else:
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


def digests(named) -> dict[str, str]:
    """sha256 of each tensor's raw bytes: equal digests mean bit-identical tensors."""
    return {name: hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest() for name, t in named}


class Recorder:
    """Count the torch.distributed calls made through the public namespace (what the library calls)."""

    NAMES = ("broadcast", "broadcast_object_list", "all_gather_object", "all_gather", "all_gather_into_tensor", "all_reduce", "send", "recv", "barrier")

    def __init__(self) -> None:
        import importlib

        import torch.distributed as dist

        from rlightning_comm.communicators import base

        weight_transfer = importlib.import_module("rlightning_comm.weight_transfer")

        self.calls: list[tuple[str, int | None]] = []
        self._depth = 0  # calls made inside a recorded call are part of it
        # The communicators call the process group directly, not torch.distributed's functions: their broadcast counts too.
        self._targets = [(dist, name) for name in self.NAMES] + [
            (base, "broadcast_objects"),
            (weight_transfer, "all_gather_objects"),
            (base.Communicator, "broadcast"),
        ]
        self._originals = {(mod, name): getattr(mod, name) for mod, name in self._targets}
        # The library's numpy-free object collectives count as torch's.
        aliases = {"broadcast_objects": "broadcast_object_list", "all_gather_objects": "all_gather_object"}
        for (mod, name), fn in self._originals.items():
            setattr(mod, name, self._wrap(aliases.get(name, name), fn))

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if self._depth == 0:
                self.calls.append((name, first.numel() if isinstance(first, torch.Tensor) else None))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return call

    def restore(self) -> None:
        for (mod, name), fn in self._originals.items():
            setattr(mod, name, fn)


def _send_model(rank: int, size: int, url: str, bucket_bytes: int) -> dict:
    from rlightning_comm import broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_weight_transfer_group(src=0, dst_ranks=[1, 2, 3])
    model = Mixed()
    randomise(model, seed=1000 + rank)
    before = digests(model.state_dict().items())
    recorder = Recorder()
    try:
        broadcast_state_dict(model, bucket_bytes=bucket_bytes)
    finally:
        recorder.restore()
    return {"before": before, "after": digests(model.state_dict().items()), "calls": recorder.calls}


@pytest.mark.parametrize("bucket_bytes", [BUCKET_BYTES, 1 << 20])
def test_model_reaches_three_destinations_bit_identical(world4, bucket_bytes: int) -> None:
    results = world4.run(_send_model, bucket_bytes)
    source = results[0]
    assert source["after"] == source["before"]  # the source is only read
    for dst in results[1:]:
        assert dst["before"] != source["before"]  # they really started different
        assert dst["after"] == source["before"]
    model = Mixed()
    sd = model.state_dict()
    assert {str(t.dtype) for t in sd.values()} == {"torch.float32", "torch.bfloat16", "torch.int64", "torch.bool"}
    total = sum(t.numel() * t.element_size() for t in sd.values())
    buckets = math.ceil(total / bucket_bytes)
    assert buckets < len(sd)
    for r in results:
        data = [n for name, n in r["calls"] if name == "broadcast"]
        # One broadcast per bucket, every bucket full but the last; then two small metadata collectives.
        assert data == [bucket_bytes] * (buckets - 1) + [total - bucket_bytes * (buckets - 1)]
        assert sorted(name for name, _ in r["calls"] if name != "broadcast") == ["all_gather_object", "broadcast_object_list"]


def _named_list_with_non_member(rank: int, size: int, url: str) -> dict:
    from rlightning_comm import CommMode, broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_weight_transfer_group(src=2, dst_ranks=[0, 3])
    gen = torch.Generator().manual_seed(rank)
    weight = torch.randn(6, 4, generator=gen)
    # A transposed (non-contiguous) destination and a bfloat16 scalar.
    named = [("w_t", weight.t()), ("scale", torch.randn((), generator=gen).to(torch.bfloat16)), ("ids", torch.arange(5) * (rank + 1))]
    before = digests(named)
    result = broadcast_state_dict(named, comm_mode=CommMode.WEIGHT_TRANSFER, bucket_bytes=32)
    from dataclasses import asdict

    from rlightning_comm import describe_layout

    view = asdict(describe_layout()["WEIGHT_TRANSFER"])
    return {"result": result, "before": before, "after": digests(named), "member": ctx.get_communicator(CommMode.WEIGHT_TRANSFER).is_member, "view": view}


def test_named_tensor_list_and_non_member(world4) -> None:
    results = world4.run(_named_list_with_non_member)
    assert [r["member"] for r in results] == [True, False, True, True]
    # Group ranks follow the declared order [src] + dst_ranks: the source is group rank 0; rank 1 is outside (no rank there).
    assert [r["view"] for r in results] == [
        {"ranks": (2, 0, 3), "rank": 1, "world_size": 3, "backend": "gloo"},
        {"ranks": (2, 0, 3), "rank": None, "world_size": 3, "backend": "gloo"},
        {"ranks": (2, 0, 3), "rank": 0, "world_size": 3, "backend": "gloo"},
        {"ranks": (2, 0, 3), "rank": 2, "world_size": 3, "backend": "gloo"},
    ]
    assert all(r["result"] is None for r in results)
    source = results[2]["before"]
    assert results[2]["after"] == source
    assert results[0]["after"] == source and results[3]["after"] == source
    assert results[1]["after"] == results[1]["before"] != source  # the non-member is untouched


def _mismatch(rank: int, size: int, url: str, case: str) -> dict:
    from rlightning_comm import broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_weight_transfer_group(src=0, dst_ranks=[1, 2, 3])
    state = {"a": torch.full((3,), float(rank)), "b": torch.full((2,), rank, dtype=torch.int64)}
    if case == "shape" and rank == 2:
        state["a"] = torch.zeros(4)
    if case == "missing" and rank == 3:
        del state["b"]
    if case == "source_not_tensor" and rank == 0:
        state["b"] = [1, 2]
    if case == "dtype" and rank == 1:
        state["b"] = state["b"].to(torch.int32)
    before = digests((k, v) for k, v in state.items() if isinstance(v, torch.Tensor))
    recorder = Recorder()
    try:
        broadcast_state_dict(state)
        error = None
    except (TypeError, ValueError) as err:
        error = (type(err).__name__, str(err))
    finally:
        recorder.restore()
    # Nothing moved, and the group is still in step: a correct call afterwards works.
    untouched = digests((k, v) for k, v in state.items() if isinstance(v, torch.Tensor)) == before
    good = {"a": torch.full((3,), float(rank))}
    broadcast_state_dict(good)
    return {"error": error, "data_broadcasts": sum(1 for name, _ in recorder.calls if name == "broadcast"), "untouched": untouched, "after": good["a"].tolist()}


@pytest.mark.parametrize(
    ("case", "kind", "text"),
    [
        ("shape", "ValueError", "rank 2: these tensors do not match the source's (1 differ: 'a': source torch.float32 [3], here torch.float32 [4])"),
        ("missing", "ValueError", "rank 3: these tensors do not match the source's (1 missing here: b)"),
        ("dtype", "ValueError", "'b': source torch.int64 [2], here torch.int32 [2]"),
        ("source_not_tensor", "TypeError", "rank 0: 'b' must be a torch.Tensor; got list"),
    ],
)
def test_mismatch_raises_on_every_rank_before_any_data_moves(world4, case: str, kind: str, text: str) -> None:
    results = world4.run(_mismatch, case, timeout=30)
    for r in results:
        assert r["error"] is not None and r["error"][0] == kind and text in r["error"][1], r["error"]
        assert r["data_broadcasts"] == 0
        assert r["untouched"]
        assert r["after"] == [0.0, 0.0, 0.0]


def test_bad_arguments_raise_locally(tmp_path) -> None:
    from rlightning_comm import CommContext, ModeNotBoundError, broadcast_state_dict

    CommContext().init_distributed_env(world_size=1, rank=0, backend="gloo", dist_url=f"file://{tmp_path}/store")
    with pytest.raises(ModeNotBoundError, match="WEIGHT_TRANSFER"):
        broadcast_state_dict({"a": torch.zeros(1)})
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int; got 0"):
        broadcast_state_dict({"a": torch.zeros(1)}, comm_mode="GLOBAL", bucket_bytes=0)
    with pytest.raises(ValueError, match=r"src=3 is not a global rank of mode 'GLOBAL'; expected one of \[0\]"):
        broadcast_state_dict({"a": torch.zeros(1)}, comm_mode="GLOBAL", src=3)


def _declared_source(rank: int, size: int, url: str) -> int:
    from rlightning_comm import CommError, broadcast_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_weight_transfer_group(src=1, dst_ranks=[0])
    assert ctx.get_transfer_source() == 1 and ctx.get_local_rank("WEIGHT_TRANSFER") == 1 - rank  # the source is group rank 0
    with pytest.raises(CommError, match=r"rank 0 is declared in two different groups, \[1, 0\] \(declared before\) and \[0, 1\]"):
        ctx.init_weight_transfer_group(src=0, dst_ranks=[1])
    t = torch.full((3,), float(rank))
    broadcast_state_dict({"t": t})  # the default src is the declared source
    assert t.tolist() == [1.0, 1.0, 1.0]
    ctx.init_group([0, 1], "OTHER")
    with pytest.raises(ValueError, match="src is required: mode 'OTHER' was not bound by init_weight_transfer_group"):
        broadcast_state_dict({"t": t}, comm_mode="OTHER")
    return ctx.get_transfer_source()


def test_default_source_is_the_declared_one(world2) -> None:
    assert world2.run(_declared_source) == [1, 1]
