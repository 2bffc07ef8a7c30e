"""Threads: a communicator refuses a second thread (never a silent mispairing); the context stays consistent under concurrent use."""

from __future__ import annotations

import threading

from counting import backend_calls
from world import init_world


def _in_thread(fn, name):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except Exception as err:  # noqa: BLE001 - handed back to the test
            box["error"] = err

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join(timeout=30)
    if t.is_alive():
        raise RuntimeError(f"thread {name} did not finish")
    return box


def _ownership_task(rank, size, url):
    import torch

    from rlightning_comm import CommError, collective

    ctx = init_world(rank, size, url, timeout=30)
    glob = ctx.get_communicator("GLOBAL")
    out = {}
    t = torch.ones(2)
    collective.all_reduce(t, "GLOBAL")  # the main thread owns GLOBAL now
    with backend_calls() as calls:
        box = _in_thread(lambda: collective.all_reduce(torch.ones(2), "GLOBAL"), "intruder")
    out["intruder"] = (type(box.get("error")).__name__, str(box.get("error")), dict(calls))
    collective.all_reduce(t, "GLOBAL")  # still in step: the refusal sent nothing
    out["after_refusal"] = t.tolist()

    # Hand-over: release in the owner, use in another thread; a live owner still excludes others.
    glob.release_thread()
    ready, done = threading.Event(), threading.Event()

    def worker():
        x = torch.ones(2)
        collective.all_reduce(x, "GLOBAL")
        ready.set()
        done.wait(30)
        return x.tolist()

    th = threading.Thread(target=lambda: out.__setitem__("worker", worker()), name="worker")
    th.start()
    ready.wait(30)
    try:
        collective.all_reduce(torch.ones(2), "GLOBAL")
        out["main_while_worker_owns"] = "no error"
    except CommError as err:
        out["main_while_worker_owns"] = str(err)
    done.set()
    th.join(30)
    collective.all_reduce(t, "GLOBAL")  # the worker ended: ownership passes back
    out["main_after_worker"] = t.tolist()

    # One mode per thread: both run at once and every result is exact.
    ctx.init_group([0, 1], "A")
    ctx.init_group([0, 1], "B")

    def loop(mode, scale):
        got = []
        for i in range(30):
            x = torch.full((3,), float(scale * (rank + 1) + i))
            collective.all_reduce(x, mode)
            got.append(x[0].item())
        return got

    boxes = {}
    threads = [threading.Thread(target=lambda m=m, s=s: boxes.__setitem__(m, loop(m, s)), name=f"thread-{m}") for m, s in (("A", 1), ("B", 1000))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    out["per_mode"] = boxes
    return out


def test_second_thread_is_refused_and_one_mode_per_thread_works(world2):
    for out in world2.run(_ownership_task, timeout=60):
        kind, msg, backend_calls = out["intruder"]
        assert kind == "CommError" and backend_calls == {}
        assert "mode 'GLOBAL' is driven by thread 'MainThread'; thread 'intruder' may not run collectives on it too" in msg
        assert out["after_refusal"] == [4.0, 4.0]
        assert "is driven by thread 'worker'" in out["main_while_worker_owns"]
        assert out["worker"] == [2.0, 2.0] and out["main_after_worker"] == [8.0, 8.0]
        # rank 0 contributes scale*1 + i, rank 1 scale*2 + i.
        assert out["per_mode"] == {"A": [3.0 + 2 * i for i in range(30)], "B": [3000.0 + 2 * i for i in range(30)]}


def _context_task(rank, size, url):
    import torch.distributed as dist

    from rlightning_comm import CommError, ModeNotBoundError

    ctx = init_world(rank, size, url, timeout=30)
    modes = [f"M{i}" for i in range(40)]
    stop = threading.Event()
    bad = []
    seen = {"bound": 0, "unbound": 0}

    def reader():
        while not stop.is_set():
            for mode in ["GLOBAL", *modes]:
                try:
                    comm = ctx.get_communicator(mode)
                except ModeNotBoundError:
                    seen["unbound"] += 1
                    continue
                except Exception as err:  # noqa: BLE001
                    bad.append(repr(err))
                    continue
                if comm is None or comm.mode != mode or comm.world_size != 1:
                    bad.append(f"{mode}: {comm!r}")
                seen["bound"] += 1
            ctx.bound_modes()

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for th in readers:
        th.start()
    for mode in modes:
        ctx.init_group([0], mode)
    stop.set()
    for th in readers:
        th.join(30)

    # Concurrent initialisation of one mode with the same arguments: one group, one communicator.
    new_groups = []
    real = dist.new_group
    dist.new_group = lambda *a, **k: new_groups.append(1) or real(*a, **k)
    got = []
    racers = [threading.Thread(target=lambda: got.append(ctx.init_group([0], "SAME"))) for _ in range(4)]
    try:
        for th in racers:
            th.start()
        for th in racers:
            th.join(30)
    finally:
        dist.new_group = real

    # Double initialisation: a no-op with equal arguments, a CommError with different ones.
    glob = ctx.get_communicator("GLOBAL")
    same_env = ctx.init_distributed_env(world_size=size, rank=rank, backend="gloo", dist_url=url, timeout=30) is glob
    errors = []
    for call in (
        lambda: ctx.init_distributed_env(world_size=size, rank=rank, backend="gloo", dist_url=url, timeout=31),
        lambda: ctx.init_group([0], "M0", timeout=5),
    ):
        try:
            call()
        except CommError as err:
            errors.append(str(err))
    return {
        "bad": bad[:5],
        "seen": seen,
        "all_bound": ctx.bound_modes() == sorted(["GLOBAL", "SAME", *modes]),
        "same_comm": len(got) == 4 and all(c is got[0] for c in got),
        "new_groups": len(new_groups),
        "same_env": same_env,
        "same_group": ctx.init_group([0], "M0") is ctx.get_communicator("M0"),
        "errors": errors,
    }


def test_context_is_consistent_under_concurrent_use_and_double_init(world1):
    (out,) = world1.run(_context_task, timeout=60)
    assert out["bad"] == [] and out["seen"]["bound"] > 0 and out["seen"]["unbound"] > 0, out
    assert out["all_bound"] and out["same_comm"] and out["new_groups"] == 1
    assert out["same_env"] and out["same_group"]
    assert len(out["errors"]) == 2
    assert "CommContext is already initialised with" in out["errors"][0]
    assert "mode 'M0' is already bound to ranks [0]" in out["errors"][1]
