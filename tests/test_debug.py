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


SHORT_TIMEOUT = 1.0
SMALL_BOUND = 0.75  # what a rank may take past the timeout (the store's old wait overshot by a whole second)


def _skip_one_of_four_task(rank, size, url):
    import torch
    import torch.distributed as dist

    from rlightning_comm import CommTimeoutError, collective

    ctx = init_world(rank, size, url, timeout=30)
    ctx.init_group(list(range(size)), "TP", timeout=SHORT_TIMEOUT)
    ctx.set_debug(True)
    out = {}
    if rank != 3:
        start = time.monotonic()
        try:
            collective.all_reduce(torch.ones(3), "TP")  # rank 3 never makes this call
        except CommTimeoutError as err:
            out = {"error": str(err), "elapsed": time.monotonic() - start}
    dist.barrier()  # raw torch: rank 3 goes on only once the others have given up
    t = torch.full((2,), float(rank + 1))
    raw = t.clone()
    collective.all_reduce(t, "TP")  # rank 3 finds its slot of the abandoned check marked and takes the next one
    dist.all_reduce(raw, group=ctx.get_group("TP"))
    out["after"] = torch.equal(t, raw)
    return out


def test_debug_mode_every_rank_names_the_same_absent_rank_within_the_timeout(world4):
    results = world4.run(_skip_one_of_four_task, timeout=60)
    assert [r["after"] for r in results] == [True] * 4, results
    waited = results[:3]
    assert all("error" in r for r in waited), results
    assert "collective #0 (all_reduce) on mode 'TP': global ranks [3] did not reach it" in waited[0]["error"], waited[0]
    assert len({r["error"] for r in waited}) == 1, [
        r["error"] for r in waited
    ]  # the same message on every waiting rank
    assert max(r["elapsed"] for r in waited) >= SHORT_TIMEOUT - 0.05, waited  # the first to give up waited its timeout
    assert all(r["elapsed"] <= SHORT_TIMEOUT + SMALL_BOUND for r in waited), waited


def _different_histories_task(rank, size, url):
    import os

    import torch
    import torch.distributed as dist

    from rlightning_comm import CommContext, collective

    if rank == 0:  # this process was in a world of its own first (as a restarted rank or a reused worker may have been)
        private = os.path.join(url.removeprefix("file://").rsplit("/", 1)[0], "private")
        CommContext().init_distributed_env(
            world_size=1, rank=0, backend="gloo", dist_url=f"file://{private}", timeout=5
        )
        CommContext().destroy()
    ctx = init_world(rank, size, url, timeout=5)
    ctx.set_debug(True)
    t = torch.arange(4.0) + rank
    raw = t.clone()
    collective.all_reduce(t, "GLOBAL")
    dist.all_reduce(raw)
    return torch.equal(t, raw)


def test_debug_mode_works_across_ranks_that_initialised_different_numbers_of_worlds(world2):
    # The checks' keys were namespaced by a count of worlds kept per process: rank 0 then looked for keys rank 1 never
    # wrote.
    assert world2.run(_different_histories_task, timeout=60) == [True, True]


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
        shadowed = sorted(
            name
            for name in ("all_reduce", "broadcast", "all_gather", "all_reduce_dict", "barrier")
            if name in vars(comm)
        )
        result = dict(counts), store.num_keys() - before, shadowed
        sync()
        counts.clear()  # after the sync: counting is at the process group, so it sees torch's own barrier too
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


def _refusal(name, rank, torch, coll):
    """Rank ``bad`` passes an argument its own local checks refuse; the other rank's call is fine."""
    if name == "non-contiguous":  # rank 1
        coll.all_reduce(torch.ones(3, 2)[:, 0] if rank == 1 else torch.ones(3), "TP")
    elif name == "root list":  # the root, rank 0, has one tensor too few: only it reads the list
        coll.gather(torch.ones(2), "TP", [torch.zeros(2)] if rank == 0 else None, dst=0)
    elif name == "split sizes":  # rank 1's input splits do not sum to its dim 0
        from rlightning_comm import CommContext

        comm = CommContext().get_communicator("TP")
        comm.all_to_all_single(torch.empty(4), torch.ones(4), [2, 2], [3, 3] if rank == 1 else [2, 2])


REFUSED = {
    "non-contiguous": (1, "tensor must be contiguous"),
    "root list": (0, "gather_list must hold one tensor per rank"),
    "split sizes": (1, "input_split_sizes"),
}


def _refusal_task(rank, size, url, name):
    import torch

    from rlightning_comm import collective

    ctx = init_world(rank, size, url, timeout=30)
    ctx.init_group([0, 1], "TP", timeout=GROUP_TIMEOUT)
    ctx.set_debug(True)
    out = {}
    start = time.monotonic()
    try:
        _refusal(name, rank, torch, collective)
    except Exception as err:  # noqa: BLE001 - the type is what the test compares
        out = {"type": type(err).__name__, "error": str(err), "elapsed": time.monotonic() - start}
    t = torch.full((2,), float(rank + 1))
    collective.all_reduce(t, "TP")  # nothing was started: the group is usable and in step
    out["after"] = t.tolist()
    return out


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_debug_mode_runs_local_checks_first_and_every_rank_learns_the_refusal(world2, name):
    bad, text = REFUSED[name]
    results = world2.run(_refusal_task, name, timeout=60)
    for out in results:
        assert out["type"] == "ValueError", out  # the refusing rank's own error type, on every rank
        assert f"global rank {bad} refused the call" in out["error"] and text in out["error"], out["error"]
        assert out["elapsed"] < GROUP_TIMEOUT, out  # nobody waited for a timeout
        assert out["after"] == [3.0, 3.0]


def _numbers_task(rank, size, url):
    import numpy as np
    import torch
    import torch.distributed as dist

    from rlightning_comm import collective

    ctx = init_world(rank, size, url, timeout=30)
    ctx.set_debug(True)
    # Valid calls that used to be flagged: an int against a float, a numpy scalar against a Python float.
    got = collective.all_reduce_dict(
        {"count": 0 if rank == 0 else 2.5, "x": np.float32(1.5) if rank == 0 else 1.5}, "GLOBAL"
    )
    raw = torch.tensor([0 if rank == 0 else 2.5, 1.5], dtype=torch.float64)
    dist.all_reduce(raw)
    return got == dict(zip(["count", "x"], raw.tolist()))


def test_debug_mode_fingerprints_numbers_as_numbers(world2):
    assert world2.run(_numbers_task, timeout=60) == [True, True]


def _resync_task(rank, size, url):
    import torch
    import torch.distributed as dist

    from rlightning_comm import CommTimeoutError, ModeNotBoundError, collective

    ctx = init_world(rank, size, url, timeout=30)
    ctx.init_group([0, 1], "TP", timeout=GROUP_TIMEOUT)
    ctx.set_debug(True)
    out = {}
    try:
        collective.all_reduce(
            torch.ones(3), "TP" if rank == 0 else "NOT_BOUND"
        )  # rank 1 raises locally, never reaching the check
    except (CommTimeoutError, ModeNotBoundError) as err:
        out["first"] = type(err).__name__, str(err)
    dist.barrier()  # raw torch: rank 1 waits here until rank 0 has given up
    got = []
    for step in range(3):  # the calls after the failure work on every rank, against raw torch on the same values
        t = torch.full((2,), float(rank + step))
        raw = t.clone()
        collective.all_reduce(t, "TP")
        dist.all_reduce(raw, group=ctx.get_group("TP"))
        got.append(torch.equal(t, raw))
    return out, got


def test_debug_mode_keeps_sequence_numbers_in_step_after_a_timeout(world2):
    (r0, got0), (r1, got1) = world2.run(_resync_task, timeout=60)
    assert r0["first"][0] == "CommTimeoutError" and "global ranks [1] did not reach it" in r0["first"][1]
    assert r1["first"][0] == "ModeNotBoundError"
    assert got0 == got1 == [True, True, True]
