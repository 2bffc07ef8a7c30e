"""all_reduce_dict against raw torch.distributed on the same values (2 gloo ranks): key order, exact counts, clear
errors, one copy each way."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from world import init_world

from rlightning_comm.communicators._packing import EXACT_INT_BOUND, pack


def _numbers_task(rank, size, url):
    import numpy as np
    import torch.distributed as dist

    from rlightning_comm import collective

    init_world(rank, size, url)
    out = {}
    # Keys inserted in a different order on each rank: the reduction pairs them by key.
    keys = [f"m{i:03d}" for i in range(256)]
    values = {k: (i + 0.25) * (rank + 1) if i % 3 else (i * (rank + 2)) for i, k in enumerate(keys)}
    ordered = dict(reversed(list(values.items()))) if rank else dict(values)
    before = dict(ordered)
    got = collective.all_reduce_dict(ordered, "GLOBAL")
    raw = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(raw)
    out["float"] = (
        got == dict(zip(keys, raw.tolist())),
        list(got) == keys,
        ordered == before,
        all(type(v) is float for v in got.values()),
    )
    # int64 reduction with MAX.
    ints = {"a": 3 + rank, "b": -7 * rank, "c": 10**12 + rank}
    got = collective.all_reduce_dict(ints, "GLOBAL", op=dist.ReduceOp.MAX, dtype=torch.int64)
    raw = torch.tensor([3 + rank, -7 * rank, 10**12 + rank], dtype=torch.int64)
    dist.all_reduce(raw, op=dist.ReduceOp.MAX)
    out["int"] = got == dict(zip("abc", raw.tolist()))
    # bool and numpy scalars are numbers like the others (np.bool_ included).
    got = collective.all_reduce_dict({"flag": True, "x": 1.5, "np": np.float32(0.5), "npb": np.bool_(True)}, "GLOBAL")
    out["bool"] = got == {"flag": float(size), "x": 1.5 * size, "np": 0.5 * size, "npb": float(size)}
    out["empty"] = collective.all_reduce_dict({}, "GLOBAL") == {}
    # Defect 1: keys with no common sort (str and int) inserted in different orders must still pair up by key.
    mixed = {"loss": 1.0, 0: 10.0, ("tp", 1): 100.0, None: 1000.0}
    mixed = dict(reversed(list(mixed.items()))) if rank else mixed
    out["mixed"] = collective.all_reduce_dict(mixed, "GLOBAL")
    # Defect 9: integer counts come back exact with the default dtype, numbers and tensors in one dict.
    tokens = 2**24 + 1 + rank
    got = collective.all_reduce_dict({"tokens": tokens, "t": torch.full((3,), 0.5)}, "GLOBAL")
    raw = torch.tensor([tokens], dtype=torch.int64)
    dist.all_reduce(raw)
    out["tokens"] = (got["tokens"] == raw.item(), got["t"].dtype, got["t"].tolist())
    near = EXACT_INT_BOUND // 2 - 1 + rank  # the sum is 2**53 - 1, the largest odd integer float64 holds
    raw = torch.tensor([near], dtype=torch.int64)
    dist.all_reduce(raw)
    out["bound"] = (collective.all_reduce_dict({"n": near}, "GLOBAL")["n"], raw.item())
    return out


def test_dict_matches_raw_all_reduce(world2):
    for rep in world2.run(_numbers_task):
        assert rep["float"] == (True, True, True, True)
        assert rep["int"] and rep["bool"] and rep["empty"]
        assert rep["mixed"] == {"loss": 2.0, 0: 20.0, ("tp", 1): 200.0, None: 2000.0}
        assert rep["tokens"] == (True, torch.float32, [1.0, 1.0, 1.0])
        assert rep["bound"] == (EXACT_INT_BOUND - 1, EXACT_INT_BOUND - 1)


CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("value", "error", "text"),
    [
        ({"a": 1 + 2j}, TypeError, "must be a real number or a tensor; got the complex number (1+2j)"),
        ({"a": "text"}, TypeError, "must be a number or a tensor; got str"),
        ({"a": torch.ones(2, dtype=torch.complex64)}, TypeError, "is a complex tensor"),
        ({"a": torch.ones(2).to_sparse()}, TypeError, "sparse_coo tensor; expected a dense tensor"),
        ({"a": 1.0, frozenset(): 2.0}, TypeError, "keys must be None, real numbers, str, bytes or tuples of those"),
        ({float("nan"): 2.0}, TypeError, "a NaN key has no order"),
    ],
)
def test_bad_values_and_keys_are_refused_before_anything_is_packed(value, error, text):
    with pytest.raises(error) as info:
        pack(value, torch.float32, CPU, "M")
    assert text in str(info.value) and "(mode 'M')" in str(info.value)


@pytest.mark.parametrize(
    ("dtype", "error", "text"),
    [
        ("float32", TypeError, "dtype must be a torch.dtype such as torch.float32; got str 'float32'"),
        (torch.complex64, ValueError, "real floating-point or integer dtype; got torch.complex64"),
    ],
)
def test_bad_dtype_is_refused(dtype, error, text):
    with pytest.raises(error) as info:
        pack({"a": 1.0}, dtype, CPU, "M")
    assert text in str(info.value)


class _Transfers(TorchFunctionMode):
    """Counts what would cross between host and device: tensors made from host data, copies across devices, host
    reads."""

    def __init__(self) -> None:
        super().__init__()
        self.made = {}  # device type -> tensors built from Python data there
        self.crossings = 0
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.tensor, torch.as_tensor):
            device = torch.device(kwargs.get("device") or "cpu").type
            self.made[device] = self.made.get(device, 0) + 1
        elif func in (torch.Tensor.to, torch.Tensor.copy_) and isinstance(out, torch.Tensor):
            src = args[1] if func is torch.Tensor.copy_ else args[0]
            self.crossings += src.device != out.device
        elif func in (torch.Tensor.tolist, torch.Tensor.item):
            self.reads.append(tuple(args[0].shape))
        return out


def _mixed(device):
    # 4 numbers between 4 tensors: 4 runs of numbers in key order.
    return {f"k{i}": (float(i) if i % 2 else torch.full((2,), float(i), device=device)) for i in range(8)}


def test_one_host_to_device_copy_for_numbers_and_device_tensors():
    # The meta device stands in for a GPU: the numbers cost one copy in, the tensors already there none.
    meta = torch.device("meta")
    with _Transfers() as seen:
        flat, _ = pack(_mixed(meta), torch.float32, meta, "M")
    assert seen.made.get("meta", 0) + seen.crossings == 1, (seen.made, seen.crossings)
    assert flat.shape == (4 + 4 * 2,) and flat.dtype == torch.float64 and flat.device == meta


def test_unpack_reads_the_numbers_in_one_transfer():
    d = _mixed(CPU)
    flat, unpack = pack(d, torch.float32, CPU, "M")
    with _Transfers() as seen:
        out = unpack(flat)
    assert (
        seen.reads == [(4,)] and seen.made == {} and seen.crossings == 0
    )  # one slice, no index tensor sent to the device
    assert list(out) == sorted(d)
    assert all(torch.equal(out[k], d[k]) for k in d if isinstance(d[k], torch.Tensor))
    assert [out[k] for k in d if not isinstance(d[k], torch.Tensor)] == [1.0, 3.0, 5.0, 7.0]
