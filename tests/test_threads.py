"""Threads: any thread may call, one call at a time; an overlapping call is refused (never a silent mispairing); the
context stays consistent."""

from __future__ import annotations

import threading

import pytest
import torch
from counting import backend_calls
from world import init_world


class _Pool:
    """``n`` live threads, each running what it is handed, one call at a time (as a Ray actor's thread pool does)."""

    def __init__(self, n):
        import queue

        self.inboxes = [queue.SimpleQueue() for _ in range(n)]
        self.threads = [
            threading.Thread(target=self._serve, args=(box,), name=f"pool-{i}", daemon=True)
            for i, box in enumerate(self.inboxes)
        ]
        for t in self.threads:
            t.start()

    @staticmethod
    def _serve(box):
        while (job := box.get()) is not None:
            fn, reply = job
            try:
                reply.put(("ok", fn()))
            except Exception as err:  # noqa: BLE001 - handed back to the caller
                reply.put(("error", err))

    def call(self, i, fn):
        import queue

        reply = queue.SimpleQueue()
        self.inboxes[i].put((fn, reply))
        kind, value = reply.get(timeout=30)
        if kind == "error":
            raise value
        return value

    def close(self):
        for box in self.inboxes:
            box.put(None)
        for t in self.threads:
            t.join(30)


def _pool_task(rank, size, url):
    import torch
    import torch.distributed as dist

    from rlightning_comm import collective

    ctx = init_world(rank, size, url, timeout=30)
    group = ctx.get_communicator("GLOBAL").group
    pool = _Pool(4)
    mismatches, calls = [], 0
    try:
        collective.barrier("GLOBAL")  # the main thread first, then every pool thread in turn
        for step in range(12):
            i = step % 4
            ours = torch.arange(5, dtype=torch.float64) * (rank + 1) + step
            raw = ours.clone()
            pool.call(i, lambda t=ours: collective.all_reduce(t, "GLOBAL"))
            dist.all_reduce(raw, group=group)
            out = torch.empty(size * 5, dtype=torch.float64)
            raw_out = torch.empty_like(out)
            pool.call((i + 1) % 4, lambda o=out, t=ours: collective.all_gather(o, t, "GLOBAL"))
            dist.all_gather_into_tensor(raw_out, raw, group=group)
            calls += 2
            if not (torch.equal(ours, raw) and torch.equal(out, raw_out)):
                mismatches.append(step)
        pool.call(3, lambda: collective.barrier("GLOBAL"))
        x = torch.full((2,), float(rank))
        collective.broadcast(x, "GLOBAL", src=size - 1)  # back on the main thread
    finally:
        pool.close()
    return {
        "mismatches": mismatches,
        "calls": calls,
        "alive": sum(t.is_alive() for t in pool.threads),
        "broadcast": x.tolist(),
    }


def test_sequential_calls_from_a_pool_of_live_threads_work(world2):
    for out in world2.run(_pool_task, timeout=60):
        assert out == {"mismatches": [], "calls": 24, "alive": 0, "broadcast": [1.0, 1.0]}


def _overlap_task(rank, size, url):
    import time

    import torch

    from rlightning_comm import CommError, collective

    ctx = init_world(rank, size, url, timeout=30)
    ctx.init_group([0, 1], "SIDE")  # a second communicator: rank 1 waits on it, so rank 0's first call stays in flight
    glob = ctx.get_communicator("GLOBAL")
    first = torch.full((3,), float(rank + 1))
    out = {}
    if rank == 0:
        box = {}
        th = threading.Thread(target=lambda: box.setdefault("r", collective.all_reduce(first, "GLOBAL")), name="first")
        th.start()
        deadline = time.monotonic() + 20
        while glob._lock.acquire(False) and time.monotonic() < deadline:  # until 'first' holds the claim
            glob._lock.release()
            time.sleep(0.001)
        late = torch.full((3,), 100.0)
        with backend_calls() as calls:
            try:
                collective.all_reduce(late, "GLOBAL")
                out["late"] = "no error"
            except CommError as err:
                out["late"] = str(err)
        out["late_calls"], out["late_tensor"] = dict(calls), late.tolist()
        collective.barrier("SIDE")  # now rank 1 joins the first call
        th.join(30)
        out["first_alive"] = th.is_alive()
    else:
        collective.barrier("SIDE")
        collective.all_reduce(first, "GLOBAL")
    out["first"] = first.tolist()
    after = torch.full((2,), float(rank))
    collective.all_reduce(after, "GLOBAL")  # the group is in step: nothing of the late call was sent
    out["after"] = after.tolist()
    return out


def test_an_overlapping_call_from_another_thread_is_refused_and_the_first_loses_nothing(world2):
    r0, r1 = world2.run(_overlap_task, timeout=60)
    assert (
        "all_reduce on mode 'GLOBAL' from thread 'MainThread' overlaps a call that thread 'first' has in flight"
        in r0["late"]
    ), r0
    assert "nothing was sent" in r0["late"]
    assert r0["late_calls"] == {} and r0["late_tensor"] == [100.0] * 3 and not r0["first_alive"]
    assert r0["first"] == r1["first"] == [3.0] * 3
    assert r0["after"] == r1["after"] == [1.0, 1.0]


def _backward_hook_task(rank, size, url, device):
    import torch
    import torch.distributed as dist

    from rlightning_comm import collective

    ctx = init_world(rank, size, url, timeout=30)
    group = ctx.get_communicator("GLOBAL").group
    collective.barrier("GLOBAL")  # the main thread used GLOBAL last
    seen = {}

    def hook(grad):
        seen["thread"] = threading.current_thread().name
        g = grad.contiguous().clone()
        collective.all_reduce(g, "GLOBAL")
        return g

    def step():
        w = torch.arange(4, dtype=torch.float64, device=device).requires_grad_()
        y = w * (rank + 2)
        y.register_hook(hook)
        (y * y).sum().backward()
        return w

    w = step()
    raw = (2 * (torch.arange(4, dtype=torch.float64, device=device) * (rank + 2))).contiguous()
    dist.all_reduce(raw, group=group)
    expected = raw * (rank + 2)
    box = {}
    th = threading.Thread(
        target=lambda: box.setdefault("w", step()), name="trainer"
    )  # backward from another thread, too
    th.start()
    th.join(30)
    return {
        "main": torch.equal(w.grad, expected),
        "thread": torch.equal(box["w"].grad, expected),
        "hook_thread": seen["thread"],
    }


def test_a_collective_inside_backward_works(world2):
    for out in world2.run(_backward_hook_task, "cpu", timeout=60):
        assert out["main"] and out["thread"], out


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: autograd runs a CUDA backward on its own device thread"
)
def test_a_collective_inside_backward_works_on_autograd_device_threads(world2):
    for out in world2.run(_backward_hook_task, "cuda", timeout=60):
        assert out["main"] and out["thread"], out
        assert out["hook_thread"] not in ("MainThread", "trainer"), out  # it really ran on autograd's thread


def _per_mode_task(rank, size, url):
    import torch

    from rlightning_comm import collective

    ctx = init_world(rank, size, url, timeout=30)
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
    threads = [
        threading.Thread(target=lambda m=m, s=s: boxes.__setitem__(m, loop(m, s)), name=f"thread-{m}")
        for m, s in (("A", 1), ("B", 1000))
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return boxes


def test_one_mode_per_thread_runs_concurrently(world2):
    for out in world2.run(_per_mode_task, timeout=60):
        # rank 0 contributes scale*1 + i, rank 1 scale*2 + i.
        assert out == {"A": [3.0 + 2 * i for i in range(30)], "B": [3000.0 + 2 * i for i in range(30)]}


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


def _raw_group_overlap_task(rank, size, url):
    import time

    import torch
    import torch.distributed as dist

    import rlightning_comm.sequence_parallel as sp
    from rlightning_comm import CommError, collective

    ctx = init_world(rank, size, url, timeout=30)
    ctx.init_group([0, 1], "SP")
    ctx.init_group([0, 1], "SIDE")  # rank 1 waits on it, so rank 0's first call stays in flight
    comm, pg = ctx.get_communicator("SP"), ctx.get_group("SP")
    first_in, first_out = torch.full((4,), float(rank + 1)), torch.empty(4)
    x = torch.arange(8, dtype=torch.float64).view(1, 2, 4) + 10 * rank
    out = {}
    if rank == 0:
        th = threading.Thread(target=lambda: comm.all_to_all_single(first_out, first_in), name="first")
        th.start()
        deadline = time.monotonic() + 20
        while comm._lock.acquire(False) and time.monotonic() < deadline:  # until 'first' holds the claim
            comm._lock.release()
            time.sleep(0.001)
        with backend_calls() as calls:
            try:
                sp.all_to_all(x, 1, 2, pg)  # the same group, reached through its raw ProcessGroup
                out["late"] = "no error"
            except CommError as err:
                out["late"] = str(err)
        out["late_calls"] = dict(calls)
        collective.barrier("SIDE")  # now rank 1 joins the first call
        th.join(30)
        out["first_alive"] = th.is_alive()
    else:
        collective.barrier("SIDE")
        comm.all_to_all_single(first_out, first_in)
    out["first"] = first_out.tolist()
    raw = [torch.empty(1, 2, 2, dtype=torch.float64) for _ in range(size)]
    dist.all_to_all(raw, [c.contiguous() for c in x.chunk(size, 2)], group=pg)  # the oracle: torch's list form
    out["after_equal"] = torch.equal(
        sp.all_to_all(x, 1, 2, pg), torch.cat(raw, 1)
    )  # in step: nothing of the late call was sent
    return out


def test_a_raw_process_group_shares_its_mode_claim(world2):
    r0, r1 = world2.run(_raw_group_overlap_task, timeout=60)
    assert (
        "all_to_all_single on mode 'process group " in r0["late"]
        and "overlaps a call that thread 'first' has in flight" in r0["late"]
    ), r0
    assert r0["late_calls"] == {} and not r0["first_alive"]
    assert r0["first"] == [1.0, 1.0, 2.0, 2.0] and r1["first"] == [1.0, 1.0, 2.0, 2.0]
    assert r0["after_equal"] and r1["after_equal"]
