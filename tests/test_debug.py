"""Debug mode: every mismatch it must catch raises on every rank before the collective; off, it adds nothing."""

from __future__ import annotations

import time

import pytest
from counting import backend_calls
from world import init_world

GROUP_TIMEOUT = 1.5
BOUND = 4.0


def _scenario(name, rank, torch, coll):
    """Run scenario ``name``: rank 1 deviates from rank 0."""
    from torch.distributed import ReduceOp

    if name == "shape":
        coll.all_reduce(torch.ones(3 + rank), "GLOBAL")
    elif name == "reduce_op":
        coll.all_reduce(torch.ones(3), "GLOBAL", op=ReduceOp.MAX if rank else ReduceOp.SUM)
    elif name == "op":
        if rank == 0:
            coll.all_reduce(torch.ones(3), "GLOBAL")
        else:
            coll.broadcast(torch.ones(3), "GLOBAL", src=0)
    elif name == "src":
        coll.broadcast(torch.ones(3), "TP", src=rank)
    elif name == "keys":
        coll.all_reduce_dict({"loss": 1.0, ("acc" if rank == 0 else "accuracy"): 2.0}, "GLOBAL")
    elif name == "skip":
        # Rank 1 skips the all_reduce and runs the next step's broadcast.
        if rank == 0:
            coll.all_reduce(torch.ones(3), "GLOBAL")
        coll.broadcast(torch.ones(3), "GLOBAL", src=0)
    elif name == "splits":
        # Rank 0 sends 1 row to rank 1, which expects 2 from it.
        out_splits = [[1, 1], [2, 1]][rank]
        coll_out = torch.empty(sum(out_splits))
        from rlightning_comm import CommContext

        CommContext().get_communicator("GLOBAL").all_to_all_single(coll_out, torch.ones(2), out_splits, [1, 1])


EXPECTED = {
    "shape": "tensor: float32[3] on global ranks [0]; float32[4] on global ranks [1]",
    "reduce_op": "op: SUM on global ranks [0]; MAX on global ranks [1]",
    "op": "different calls: all_reduce(",
    "src": "src: 0 on global ranks [0]; 1 on global ranks [1]",
    "keys": "keys: [\"'acc'\", \"'loss'\"] on global ranks [0]; [\"'accuracy'\", \"'loss'\"] on global ranks [1]",
    "skip": "different calls: all_reduce(",
    "splits": "global rank 0 sends 1 rows to global rank 1, which expects 2",
}


def _mismatch_task(rank, size, url, name, via_env):
    import torch

    from rlightning_comm import CommContext, CommMismatchError, collective

    ctx = init_world(rank, size, url, timeout=30)
    ctx.init_group([0, 1], "TP")
    if not via_env:
        assert not ctx.is_debug()
        ctx.set_debug(True)
    out = {"debug": ctx.is_debug()}
    try:
        _scenario(name, rank, torch, collective)
    except CommMismatchError as err:
        out["error"] = str(err)
    # Nothing was started: the group is still usable and in step.
    t = torch.full((2,), float(rank + 1))
    collective.all_reduce(t, "GLOBAL")
    collective.all_reduce(t, "TP")
    out["after"] = t.tolist()
    CommContext().destroy()
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_debug_mode_catches_mismatch_on_every_rank(world2, name):
    results = world2.run(_mismatch_task, name, False, timeout=60)
    for rank, out in enumerate(results):
        assert "error" in out, f"rank {rank}: no CommMismatchError for {name}"
        assert EXPECTED[name] in out["error"], out["error"]
        assert out["after"] == [6.0, 6.0]
    assert results[0]["error"] == results[1]["error"]


def test_debug_mode_from_environment(world2):
    results = world2.run(_mismatch_task, "shape", True, env={"RLIGHTNING_COMM_DEBUG": "1"}, timeout=60)
    assert all(out["debug"] and EXPECTED["shape"] in out["error"] for out in results)


def _skip_last_task(rank, size, url):
    import torch

    from rlightning_comm import CommTimeoutError, collective

    ctx = init_world(rank, size, url, timeout=30)
    ctx.init_group([0, 1], "TP", timeout=GROUP_TIMEOUT)
    ctx.set_debug(True)
    out = {}
    if rank == 0:
        start = time.monotonic()
        try:
            collective.all_reduce(torch.ones(3), "TP")  # rank 1 never makes this call
        except CommTimeoutError as err:
            out = {"error": str(err), "elapsed": time.monotonic() - start}
    collective.barrier()  # checked too: GLOBAL's sequence is still in step
    return out


def test_debug_mode_names_the_rank_that_skipped_a_call(world2):
    results = world2.run(_skip_last_task, timeout=60)
    assert results[1] == {}
    r0 = results[0]
    assert "error" in r0, "no CommTimeoutError on rank 0"
    assert "collective #0 (all_reduce) on mode 'TP': global ranks [1] did not reach it" in r0["error"]
    assert GROUP_TIMEOUT - 0.1 <= r0["elapsed"] <= GROUP_TIMEOUT + BOUND


def _count_task(rank, size, url):
    import torch
    import torch.distributed as dist

    from rlightning_comm import collective, rendezvous

    ctx = init_world(rank, size, url, timeout=30)
    sync = dist.barrier  # the store is shared: no rank may start a phase before every rank has measured the last one
    store = rendezvous.world_store()
    comm = ctx.get_communicator("GLOBAL")

    def workload(counts):
        before = store.num_keys()
        collective.all_reduce(torch.ones(3), "GLOBAL")
        collective.broadcast(torch.ones(3), "GLOBAL", src=1)
        collective.all_gather(torch.empty(4), torch.ones(2), "GLOBAL")
        collective.all_reduce_dict({"a": 1.0}, "GLOBAL")
        collective.barrier("GLOBAL")
        shadowed = sorted(name for name in ("all_reduce", "broadcast", "all_gather", "all_reduce_dict", "barrier") if name in vars(comm))
        result = dict(counts), store.num_keys() - before, shadowed
        counts.clear()
        sync()
        return result

    out = {}
    with backend_calls() as counts:
        workload(counts)  # settles what torch itself leaves in the store after initialisation
        out["off"] = workload(counts)
        ctx.set_debug(True)
        out["on"] = workload(counts)
        ctx.set_debug(False)
        out["off_again"] = workload(counts)
    return out


def test_debug_mode_off_adds_no_collective_and_no_wrapper(world2):
    expected_calls = {"all_reduce": 2, "broadcast": 1, "all_gather_flat": 1, "barrier": 1}
    for out in world2.run(_count_task, timeout=60):
        for phase in ("off", "off_again"):
            calls, new_keys, shadowed = out[phase]
            assert calls == expected_calls, (phase, calls)
            assert new_keys == 0 and shadowed == [], (phase, new_keys, shadowed)
        calls, new_keys, shadowed = out["on"]
        # On: the same collectives (the check uses the store, not the backend), and fingerprints in the store.
        assert calls == expected_calls
        assert new_keys > 0 and shadowed == ["all_gather", "all_reduce", "all_reduce_dict", "barrier", "broadcast"]
