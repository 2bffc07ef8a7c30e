"""all_reduce_dict's all-numbers fast path against raw torch.distributed on the same values (2 gloo ranks)."""

from __future__ import annotations

from world import init_world


def _numbers_task(rank, size, url):
    import torch
    import torch.distributed as dist

    from rlightning_comm import collective

    init_world(rank, size, url)
    out = {}
    # Keys inserted in a different order on each rank: the reduction pairs them by sorted key.
    keys = [f"m{i:03d}" for i in range(256)]
    values = {k: (i + 0.25) * (rank + 1) if i % 3 else (i * (rank + 2)) for i, k in enumerate(keys)}
    ordered = dict(reversed(list(values.items()))) if rank else dict(values)
    before = dict(ordered)
    got = collective.all_reduce_dict(ordered, "GLOBAL")
    raw = torch.tensor([values[k] for k in keys], dtype=torch.float32)
    dist.all_reduce(raw)
    out["float"] = (got == dict(zip(keys, raw.tolist())), list(got) == keys, ordered == before, all(type(v) is float for v in got.values()))
    # int64 reduction with MAX.
    ints = {"a": 3 + rank, "b": -7 * rank, "c": 10**12 + rank}
    got = collective.all_reduce_dict(ints, "GLOBAL", op=dist.ReduceOp.MAX, dtype=torch.int64)
    raw = torch.tensor([3 + rank, -7 * rank, 10**12 + rank], dtype=torch.int64)
    dist.all_reduce(raw, op=dist.ReduceOp.MAX)
    out["int"] = got == dict(zip("abc", raw.tolist()))
    # A bool is not a plain number: the general path reduces it the same way.
    got = collective.all_reduce_dict({"flag": True, "x": 1.5}, "GLOBAL")
    out["bool"] = got == {"flag": float(size), "x": 1.5 * size}
    out["empty"] = collective.all_reduce_dict({}, "GLOBAL") == {}
    return out


def test_all_numbers_dict_matches_raw_all_reduce(world2):
    for rep in world2.run(_numbers_task):
        assert rep["float"] == (True, True, True, True)
        assert rep["int"] and rep["bool"] and rep["empty"]
