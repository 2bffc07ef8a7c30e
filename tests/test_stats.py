"""Per-mode communication stats on 2 gloo ranks: counts and bytes against what the test sent, async timing, reset, no
wrapper when off."""

from __future__ import annotations

import time

import pytest
from world import init_world

from rlightning_comm.bandwidth import bus_factor
from rlightning_comm.stats import TRACKED_OPS


def _unwrapped(comm) -> bool:
    return all(op not in vars(comm) and getattr(comm, op).__func__ is getattr(type(comm), op) for op in TRACKED_OPS)


def _stats_task(rank, size, url):
    import torch
    import torch.distributed as dist

    from rlightning_comm import CommMode, collective

    ctx = init_world(rank, size, url)
    world = ctx.get_communicator(CommMode.GLOBAL)
    report = {"off_before": _unwrapped(world)}
    ctx.reset_stats()
    ctx.enable_stats()
    report["wrapped"] = all(op in vars(world) for op in TRACKED_OPS)

    # What the test sends, with the nccl-tests size of each op worked out here by hand.
    a = torch.ones(10)  # float32: 40 bytes
    collective.all_reduce(a, CommMode.GLOBAL)
    collective.all_reduce(torch.ones(3, dtype=torch.float64), "GLOBAL")  # 24 bytes
    collective.all_gather(torch.zeros(2 * size, 5), torch.ones(2, 5), CommMode.GLOBAL)  # output 2*size*5*4 = 80
    collective.broadcast(torch.ones(7, dtype=torch.int32), CommMode.GLOBAL, src=0)  # 28
    gather_list = [torch.zeros(4) for _ in range(size)] if rank == 0 else None
    collective.gather(torch.ones(4), CommMode.GLOBAL, gather_list, dst=0)  # 4*4*size = 32
    scatter_list = [torch.ones(6, dtype=torch.int64) for _ in range(size)] if rank == 0 else None
    collective.scatter(torch.zeros(6, dtype=torch.int64), CommMode.GLOBAL, scatter_list, src=0)  # 6*8*size = 96
    world.all_to_all_single(torch.zeros(4 * size), torch.ones(4 * size))  # input 4*size*4 = 32
    out = collective.all_reduce_dict({"a": 1.0, "b": torch.ones(3), "c": 2}, CommMode.GLOBAL)  # 5 float64 = 40
    report["dict_sum"] = [out["a"], out["b"].tolist(), out["c"]]
    collective.broadcast_object_list([{"x": rank}], CommMode.GLOBAL, src=0)
    collective.barrier(CommMode.GLOBAL)

    # Async: rank 1 joins 0.3 s late, so rank 0's call completes >= ~0.3 s after its launch returned.
    if rank == 1:
        time.sleep(0.3)
    t0 = time.perf_counter()
    work = collective.all_reduce(torch.ones(16), CommMode.GLOBAL, async_op=True)  # 64 bytes
    report["launch_s"] = time.perf_counter() - t0
    work.wait()
    # gloo's reduce_scatter work has no future: a watcher thread times it.
    work = world.reduce_scatter(torch.zeros(3), torch.ones(3 * size), async_op=True)  # input 12*size = 24
    work.wait()
    time.sleep(0.05)  # completion callbacks run on gloo's / the watcher's thread

    # A mode bound while stats are on is recorded too; a failed call is not.
    ctx.init_group([0, 1], "PAIR")
    pair = ctx.get_communicator("PAIR")
    report["pair_wrapped"] = "all_reduce" in vars(pair)
    collective.all_reduce(torch.ones(2, dtype=torch.int64), "PAIR")  # 16
    with pytest.raises(TypeError):
        collective.all_reduce([1.0], "PAIR")

    report["stats"] = ctx.stats()
    report["table"] = ctx.stats_table()
    ctx.reset_stats()
    report["after_reset"] = ctx.stats()
    collective.all_reduce(torch.ones(1), CommMode.GLOBAL)
    ctx.disable_stats()
    report["off_after"] = _unwrapped(world) and _unwrapped(pair)
    collective.all_reduce(torch.ones(1), CommMode.GLOBAL)  # not recorded: stats are off
    report["after_disable"] = ctx.stats()
    ctx.reset_stats()
    # Raw torch.distributed agrees with what the stats saw for the dict values.
    check = torch.tensor([1.0, 1.0, 1.0, 1.0, 2.0])
    dist.all_reduce(check)
    report["dict_oracle"] = check.tolist()
    return report


def test_stats_count_bytes_async_reset_and_unwrap(world2):
    reports = world2.run(_stats_task, timeout=60)
    size = 2
    expected_bytes = {
        "all_reduce": [40 + 24 + 64, 3],
        "all_gather": [80, 1],
        "broadcast": [28, 1],
        "gather": [32, 1],
        "scatter": [96, 1],
        "all_to_all_single": [32, 1],
        "all_reduce_dict": [40, 1],
        "broadcast_object_list": [0, 1],
        "barrier": [0, 1],
        "reduce_scatter": [24, 1],
    }
    for rep in reports:
        assert rep["off_before"] and rep["wrapped"] and rep["pair_wrapped"] and rep["off_after"]
        o = rep["dict_oracle"]
        assert rep["dict_sum"] == [o[0], o[1:4], o[4]]
        stats = rep["stats"]
        assert set(stats) == {"GLOBAL", "PAIR"}
        got = {op: [s["bytes"], s["count"]] for op, s in stats["GLOBAL"].items()}
        assert got == expected_bytes  # all_reduce_dict's inner all_reduce is not a call of its own
        assert {op: [s["bytes"], s["count"]] for op, s in stats["PAIR"].items()} == {"all_reduce": [16, 1]}
        for mode in stats.values():
            for op, s in mode.items():
                assert s["group_size"] == size and s["in_flight"] == 0
                assert 0 < s["max_time_s"] <= s["total_time_s"]
                assert s["mean_time_s"] == pytest.approx(s["total_time_s"] / s["count"])
                assert s["algbw_gbps"] == pytest.approx(s["bytes"] / s["total_time_s"] / 1e9)
                assert s["busbw_gbps"] == pytest.approx(s["algbw_gbps"] * bus_factor(op, size))
        assert "GLOBAL" in rep["table"] and "all_reduce_dict" in rep["table"]
        assert rep["after_reset"] == {}
        assert rep["after_disable"]["GLOBAL"]["all_reduce"]["count"] == 1
    # The async all_reduce waited ~0.3 s for rank 1: its recorded time covers that wait, not just the launch.
    r0 = reports[0]
    assert r0["launch_s"] < 0.1
    assert r0["stats"]["GLOBAL"]["all_reduce"]["max_time_s"] > 0.2


def _stats_with_debug_task(rank, size, url):
    import torch

    from rlightning_comm import CommMode, collective

    ctx = init_world(rank, size, url)
    comm = ctx.get_communicator(CommMode.GLOBAL)
    ctx.reset_stats()
    out = {}
    # Debug first, then stats on top; disabling stats puts debug's wrapper back.
    ctx.set_debug(True)
    debug_wrapper = vars(comm)["all_reduce"]
    ctx.enable_stats()
    collective.all_reduce(torch.ones(2), CommMode.GLOBAL)
    ctx.disable_stats()
    out["debug_restored"] = vars(comm)["all_reduce"] is debug_wrapper
    # Stats first, then debug switched on and off under it: stats keep recording throughout.
    ctx.enable_stats()
    ctx.set_debug(False)
    collective.all_reduce(torch.ones(2), CommMode.GLOBAL)
    ctx.set_debug(True)
    collective.all_reduce(torch.ones(2), CommMode.GLOBAL)
    ctx.set_debug(False)
    out["count"] = ctx.stats()["GLOBAL"]["all_reduce"]["count"]
    ctx.disable_stats()
    out["off"] = _unwrapped(comm)
    ctx.reset_stats()
    return out


def test_stats_compose_with_debug_mode(world2):
    for rep in world2.run(_stats_with_debug_task):
        assert rep == {"debug_restored": True, "count": 3, "off": True}


class _YieldingBytes(int):
    """A byte count whose addition runs Python code and lets another thread in: a read-modify-write race shows at
    once."""

    def __radd__(self, other):
        time.sleep(0)
        return int(other) + int(self)


def test_recording_from_many_threads_loses_nothing():
    # Async completions record from torch's callback threads while the caller records its own calls.
    import threading

    from rlightning_comm.stats._recorder import _Recorder

    rec = _Recorder()
    threads, per_thread = 8, 200

    def record():
        for _ in range(per_thread):
            rec._finish(("M", "all_reduce"), 2, _YieldingBytes(3), 1.0, time.perf_counter(), False, False)

    workers = [threading.Thread(target=record) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    row = rec.snapshot()["M"]["all_reduce"]
    assert (row["count"], row["bytes"]) == (threads * per_thread, 3 * threads * per_thread)


_EXIT_DURING_A_WAIT = """
import queue, threading, time
from datetime import timedelta
import torch.distributed as dist
from rlightning_comm.stats import _recorder

class SlowWork:  # a work whose wait is a native call that releases the GIL, as gloo's and NCCL's do
    def wait(self):
        try:
            dist.HashStore().wait(["never"], timedelta(seconds=0.5))
        except RuntimeError:
            pass

class SlowFinalisation:  # the interpreter's finalisation lasts a second: the wait returns into it
    def __del__(self, time=time):
        time.sleep(1.0)

import gc
gc.disable()
cycle = SlowFinalisation()
cycle.cycle = cycle
works = queue.SimpleQueue()
threading.Thread(target=_recorder._watch_works, args=(works,), daemon=True).start()
works.put((SlowWork(), lambda: None))
time.sleep(0.1)
print("exiting", flush=True)
"""


def test_the_stats_watcher_does_not_return_into_the_interpreters_finalisation(tmp_path):
    """The stats thread waits on async works (gloo's reduce_scatter has no future): a wait that returned while the
    interpreter finalises would abort the process ("terminate called without an active exception"); the exit waits for
    it instead."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-c", _EXIT_DURING_A_WAIT], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0 and done.stdout == "exiting\n", (done.returncode, done.stderr[-3000:])
    assert "terminate called" not in done.stderr and "Fatal Python error" not in done.stderr, done.stderr[-3000:]
