"""Connected modes: a group of processes from different worlds that meet at an address, re-formed by generation.

Oracles: raw torch (a ``ProcessGroupGloo`` built by the test from the same
store, called directly) on the same inputs, and the source's own bytes. The
processes: the reused world of 4 (two worlds of 2 inside it), and for the
deaths a trainer, a surviving engine and three replacements forked from a server that imported torch once, so a
replacement starts in milliseconds.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_ray_example import _wide_listeners
from world import init_world

from rlightning_comm import (
    CommContext,
    CommError,
    CommMismatchError,
    CommMode,
    CommTimeoutError,
    PeerLostError,
    broadcast_state_dict,
    collective,
)
from rlightning_comm.communicators import _rooted, _tensor_collectives
from rlightning_comm.connect._forming import member_info
from rlightning_comm.connect._judging import compare

MODE = "WEIGHT_SYNC"


def _digest(state: dict) -> str:
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _model(seed: int, scale: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    state = {"embed": torch.randn(64 * scale, 32, generator=gen).to(torch.bfloat16)}
    for i in range(6):
        state[f"layer{i}.w"] = torch.randn(128 * scale, 128, generator=gen)
        state[f"layer{i}.b"] = torch.randn(128, generator=gen)
    state["steps"] = torch.tensor([seed], dtype=torch.int64)
    return state


def _publish(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _read(path: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} was not published within {timeout} s")
        time.sleep(0.01)
    return Path(path).read_text()


# ------------------------------------------------------------------ in this process
def test_arguments_are_checked_before_anything_is_sent():
    ctx = CommContext()
    with pytest.raises(TypeError, match="rank must be an int"):
        ctx.connect(MODE, rank="0", world_size=2, address="127.0.0.1:1")
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.world_size-1 = 0\.\.1; got rank=2"):
        ctx.connect(MODE, rank=2, world_size=2, address="127.0.0.1:1")
    with pytest.raises(ValueError, match="address must be 'host:port'"):
        ctx.connect(MODE, rank=1, world_size=2, address="127.0.0.1")
    with pytest.raises(ValueError, match=r"call listen\('127.0.0.1:0'\) first"):
        ctx.connect(MODE, rank=0, world_size=2, address="127.0.0.1:0")
    with pytest.raises(CommError, match="bound by init_distributed_env"):
        ctx.connect("GLOBAL", rank=0, world_size=1, address="127.0.0.1:1")
    with pytest.raises(KeyError, match="No communicator registered as .nope."):
        ctx.connect(MODE, rank=0, world_size=1, address="127.0.0.1:1", backend="nope")
    assert ctx.bound_modes() == [] and not dist.is_initialized()


def test_one_member_mode_without_a_world_refuses_the_traced_paths(monkeypatch):
    ctx = CommContext()
    address = ctx.listen("127.0.0.1:0")
    assert address.startswith("127.0.0.1:") and not address.endswith(":0")
    comm = ctx.connect(MODE, rank=0, world_size=1, address=address, timeout=10)
    assert not dist.is_initialized() and ctx.get_ranks_in_group(MODE) == [0] and ctx.get_generation(MODE) == 0
    t = torch.arange(4.0)
    comm.all_reduce(t)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode(), pytest.raises(CommError, match="outside torch.distributed's world"):
        comm.all_reduce(t)
    for module in (_tensor_collectives, _rooted):  # as under dynamo
        monkeypatch.setattr(module, "compiling", lambda: True)
    for call in (lambda: comm.broadcast(t, src=0), lambda: comm.barrier(), lambda: comm.all_gather(torch.empty(4), t)):
        with pytest.raises(CommError, match="cannot run under torch.compile"):
            call()
    monkeypatch.undo()
    assert (
        ctx.connect(MODE, rank=0, world_size=1, address=address, timeout=10) is not comm
        and ctx.get_generation(MODE) == 1
    )
    with pytest.raises(PeerLostError, match="generation 0.*connect was called again") as lost:
        comm.all_reduce(t)  # the older generation's communicator refuses
    assert (lost.value.mode, lost.value.generation, lost.value.member) == (MODE, 0, None)
    ctx.destroy()
    assert ctx.bound_modes() == []


def test_preflight_names_every_member_that_differs():
    def info(rank, world_size=3, **extra):
        return {
            "rank": rank,
            "world_size": world_size,
            "backend": "nccl",
            "torch": "2.13.0",
            "nccl": "2.27.3",
            "NCCL_CUMEM_ENABLE": None,
            "who": f"pid {rank}",
            **extra,
        }

    assert compare([info(0), info(1), info(2)], 3) is None
    assert compare([info(2, nccl="x"), info(0), info(1)], 3) == compare(
        [info(0), info(1), info(2, nccl="x")], 3
    )  # the arrival order is not said
    problem = compare([info(0), info(1, nccl="2.21.5"), info(2, NCCL_CUMEM_ENABLE="0")], 3)
    assert "nccl differs: 2.27.3 on rank 0 (pid 0), rank 2 (pid 2); 2.21.5 on rank 1 (pid 1)" in problem
    assert "NCCL_CUMEM_ENABLE differs: None on rank 0 (pid 0), rank 1 (pid 1); 0 on rank 2 (pid 2)" in problem
    problem = compare([info(0), info(1), info(1, world_size=4)], 3)
    assert (
        "world_size differs" in problem
        and "rank 1 is claimed 2 times (pid 1, pid 1)" in problem
        and "no process claimed ranks [2]" in problem
    )
    assert "rank 5 is out of range for world_size 3" in compare([info(0), info(1), info(5)], 3)


def test_an_nccl_member_brings_its_nccl_version_and_cumem_setting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")
    info = member_info(1, 3, "nccl", uses_nccl=True)
    assert (info["nccl"], info["NCCL_CUMEM_ENABLE"], info["torch"]) == ("2.21.5", "0", torch.__version__)
    assert "nccl" not in member_info(1, 3, "gloo", uses_nccl=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_nccl_without_cuda_is_refused_before_anything_is_sent():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        CommContext().connect(
            MODE, rank=1, world_size=2, address="127.0.0.1:1", backend="nccl"
        )  # nothing listens on port 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a connected NCCL mode needs a GPU; this machine has none")
def test_nccl_mode_is_built_from_its_own_store():
    ctx = CommContext()
    address = ctx.listen("127.0.0.1:0")
    comm = ctx.connect(MODE, rank=0, world_size=1, address=address, backend="nccl", timeout=30)
    assert type(comm).__name__ == "NcclCommunicator" and not dist.is_initialized()
    t = torch.arange(4.0, device="cuda")
    comm.all_reduce(t)
    state = {name: v.cuda() for name, v in _model(0).items()}
    broadcast_state_dict(state, MODE, src=0)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0] and _digest({k: v.cpu() for k, v in state.items()}) == _digest(_model(0))


# ------------------------------------------------------- two worlds and a connected mode
def _equal_to_raw_torch(comm, raw, me: int) -> list[str]:
    """Every collective of ``comm`` against the raw ProcessGroupGloo ``raw`` of the same members on the same inputs."""
    wrong = []

    def check(name, ours, theirs):
        if not torch.equal(ours, theirs):
            wrong.append(f"{name}: {ours.tolist()} != {theirs.tolist()}")

    def opts(cls, **fields):
        o = cls()
        for k, v in fields.items():
            setattr(o, k, v)
        return o

    x = torch.arange(6.0) * (me + 1) + me
    ours, theirs = x.clone(), x.clone()
    comm.all_reduce(ours)
    raw.allreduce([theirs]).wait()
    check("all_reduce", ours, theirs)
    ours, theirs = x.to(torch.int64), x.to(torch.int64)
    comm.all_reduce(ours, op=dist.ReduceOp.MAX, async_op=True).wait()
    raw.allreduce([theirs], opts(dist.AllreduceOptions, reduceOp=dist.ReduceOp.MAX)).wait()
    check("all_reduce MAX async", ours, theirs)
    ours, theirs = x.clone(), x.clone()
    comm.broadcast(ours, src=1)
    raw.broadcast([theirs], opts(dist.BroadcastOptions, rootRank=1)).wait()
    check("broadcast", ours, theirs)
    ours, theirs = torch.empty(18), torch.empty(18)
    comm.all_gather(ours, x)
    raw._allgather_base(theirs, x).wait()
    check("all_gather", ours, theirs)
    ours, theirs = torch.empty(2), torch.empty(2)
    comm.reduce_scatter(ours, x)
    raw._reduce_scatter_base(theirs, x).wait()
    check("reduce_scatter", ours, theirs)
    ins, outs = [[1, 2, 3], [3, 2, 1], [2, 2, 2]][me], [[1, 3, 2], [2, 2, 2], [3, 1, 2]][me]
    ours, theirs = torch.empty(6), torch.empty(6)
    comm.all_to_all_single(ours, x, outs, ins)
    raw.alltoall_base(theirs, x, outs, ins, dist.AllToAllOptions()).wait()
    check("all_to_all_single", ours, theirs)
    ours = [torch.empty(6) for _ in range(3)] if me == 2 else None
    theirs = [[torch.empty(6) for _ in range(3)]] if me == 2 else []
    comm.gather(x, ours, dst=2)
    raw.gather(theirs, [x], opts(dist.GatherOptions, rootRank=2)).wait()
    if me == 2:
        check("gather", torch.stack(ours), torch.stack(theirs[0]))
    pieces = [torch.full((3,), 10.0 * r + 1) for r in range(3)]
    ours, theirs = torch.empty(3), torch.empty(3)
    comm.scatter(ours, pieces if me == 0 else None, src=0)
    raw.scatter([theirs], [pieces] if me == 0 else [], opts(dist.ScatterOptions, rootRank=0)).wait()
    check("scatter", ours, theirs)
    ours, theirs = x.clone(), x.clone()
    comm.reduce(ours, dst=2)
    raw.reduce([theirs], opts(dist.ReduceOptions, rootRank=2, reduceOp=dist.ReduceOp.SUM)).wait()
    if me == 2:
        check("reduce", ours, theirs)
    if me == 0:
        comm.send(x + 100, dst=1)
        raw.send([x + 100], 1, 7).wait()
    elif me == 1:
        ours, theirs = torch.empty(6), torch.empty(6)
        comm.recv(ours, src=0)
        raw.recv([theirs], 0, 7).wait()
        check("send/recv", ours, theirs)
    gathered = [None] * 3
    comm.all_gather_object(gathered, {"member": me})
    if gathered != [{"member": r} for r in range(3)]:
        wrong.append(f"all_gather_object: {gathered}")
    comm.barrier()
    got = collective.all_reduce_dict({"loss": float(me), "tokens": torch.tensor([me, 1.0])}, MODE)
    flat = torch.tensor([float(me), float(me), 1.0])
    raw.allreduce([flat]).wait()
    check("all_reduce_dict", torch.tensor([got["loss"], *got["tokens"].tolist()]), flat)
    objects = [{"step": 7, "names": ["a", "b"]}, "done"] if me == 0 else [None, None]
    comm.broadcast_object_list(objects, src=0)
    if objects != [{"step": 7, "names": ["a", "b"]}, "done"]:
        wrong.append(f"broadcast_object_list: {objects}")
    return wrong


def _sync_against_raw(raw, me: int, seed: int) -> list[str]:
    """broadcast_state_dict from member 0, checked tensor by tensor against a raw broadcast of the source's tensors."""
    state = _model(seed if me == 0 else 100 + me)
    broadcast_state_dict(state, MODE, src=0)
    wrong = []
    for name, tensor in _model(seed if me == 0 else 999).items():
        expected = tensor.contiguous()
        raw.broadcast([expected.view(-1).view(torch.uint8)], dist.BroadcastOptions()).wait()  # rootRank 0
        if not torch.equal(state[name].view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8)):
            wrong.append(f"broadcast_state_dict: {name}")
    return wrong


def _two_worlds(rank: int, size: int, url: str) -> dict:
    """Test ranks 0, 1: the trainer world; 2, 3: the engine world; the connected mode: trainer rank 0 (member 0), both
    engines (1, 2)."""
    world, local = divmod(rank, 2)
    ctx = init_world(local, 2, f"{url}-{'trainer' if world == 0 else 'engine'}")
    if (
        world == 0
    ):  # the trainer world is initialised twice: its processes count world generations apart from the engines'
        # Both ranks finish gloo's connection set-up first: a rank that tears the world down while its peer is still
        # connecting fails the peer's set-up ("Connection closed by peer").
        collective.barrier(CommMode.GLOBAL)
        ctx.destroy()
        ctx = init_world(local, 2, f"{url}-trainer-again")
    me = {0: 0, 2: 1, 3: 2}.get(rank)
    path = url.removeprefix("file://") + ".address"
    report: dict = {"wrong": []}

    def world_step(step: int) -> None:
        t = torch.full((3,), float(local + 1 + step))
        collective.all_reduce(t, CommMode.GLOBAL)  # this process's own world
        if t.tolist() != [float(3 + 2 * step)] * 3:
            report["wrong"].append(f"world all_reduce at step {step}: {t.tolist()}")

    def connect(member_rank=None, **kwargs):
        kwargs.setdefault("timeout", 30)
        return ctx.connect(
            MODE,
            rank=me if member_rank is None else member_rank,
            world_size=kwargs.pop("world_size", 3),
            address=address,
            **kwargs,
        )

    if me == 0:
        address = ctx.listen("127.0.0.1:0")
        _publish(path, address)
    elif me is not None:
        address = _read(path)
    world_step(0)
    if me is None:  # the trainer's other rank: only its own world, between the syncs
        for step in (1, 2, 3):
            world_step(step)
        report["listeners"] = sorted(_wide_listeners([os.getpid()]))
        return report
    world_groups = dict(
        dist.distributed_c10d._world.pg_map
    )  # torch's registry of the world's groups: connect adds nothing
    comm = connect()
    report["ranks"] = (
        ctx.get_ranks_in_group(MODE),
        ctx.get_local_rank(MODE),
        ctx.get_world_size(MODE),
        ctx.get_world_size(),
        ctx.get_local_rank(),
    )
    host, port = address.split("/")[0].split(":")
    store = dist.TCPStore(host, int(port), None, False, timedelta(seconds=30))
    raw = dist.ProcessGroupGloo(dist.PrefixStore("oracle", store), me, 3, timedelta(seconds=30))
    report["wrong"] += _equal_to_raw_torch(comm, raw, me)
    report["wrong"] += _sync_against_raw(raw, me, seed=1)
    world_step(1)
    report["wrong"] += _sync_against_raw(raw, me, seed=2)  # the steady state: the plan is kept
    world_step(2)
    # Debug mode fingerprints through the connected mode's own store; stats count its calls.
    ctx.set_debug(True)
    ctx.enable_stats()
    with pytest.raises(CommMismatchError, match="the ranks disagree"):
        comm.all_reduce(torch.zeros(5 if me == 2 else 4))
    comm.all_reduce(torch.zeros(4))
    report["stats"] = ctx.stats()[MODE]["all_reduce"]["count"], ctx.stats()[MODE]["all_reduce"]["group_size"]
    ctx.disable_stats()
    ctx.set_debug(False)
    world_step(3)
    # A member alive but absent: the others time out at the group's timeout, then all re-form with it.
    comm = connect(timeout=2)
    if me != 2:
        t0 = time.monotonic()
        with pytest.raises(
            CommTimeoutError,
            match=r"timed out after 2 s .*re-form the mode: every member calls connect\(.WEIGHT_SYNC., ...\) again "
            r"\(generation 2\)",
        ):
            comm.all_reduce(torch.zeros(4))
        report["hung_s"] = time.monotonic() - t0
        store.set(f"timed-out/{me}", "1")
    else:  # alive, connected, and elsewhere until the others gave up
        store.wait(["timed-out/0", "timed-out/1"])
    connect()
    report["wrong"] += _sync_against_raw(raw, me, seed=3)
    # Preflight: member 1 declares another world size; every member raises, naming it.
    with pytest.raises(
        CommMismatchError, match=r"world_size differs: 3 on rank 0 \(.*\), rank 2 \(.*\); 4 on rank 1 \("
    ) as mismatch:
        connect(world_size=4 if me == 1 else 3)
    report["mismatch"] = str(mismatch.value)
    # A member that never arrives: the others raise at the timeout, naming it.
    if me != 2:
        with pytest.raises(CommTimeoutError, match=r"ranks \[2\] did not arrive in time"):
            connect(timeout=1)
    store.set(f"missing-done/{me}", "1")
    store.wait([f"missing-done/{r}" for r in range(3)])
    connect()
    report["generation"] = ctx.get_generation(MODE)
    report["wrong"] += _sync_against_raw(raw, me, seed=4)
    if dict(dist.distributed_c10d._world.pg_map) != world_groups:
        report["wrong"].append("connect changed torch's registry of the world's groups")
    report["listeners"] = sorted(_wide_listeners([os.getpid()]))
    return report


def test_two_worlds_share_a_connected_mode_equal_to_raw_torch(world4):
    reports = world4.run(_two_worlds, env={"GLOO_SOCKET_IFNAME": "lo"}, timeout=120)
    for rank, report in enumerate(reports):
        assert report["wrong"] == [], (rank, report["wrong"])
        assert report["listeners"] == [], f"rank {rank} listened beyond loopback: {report['listeners']}"
    for rank, me in ((0, 0), (2, 1), (3, 2)):
        assert reports[rank]["ranks"] == ([0, 1, 2], me, 3, 2, rank % 2)
        assert reports[rank]["stats"] == (1, 3)
        assert (
            reports[rank]["generation"] == 5
        )  # after the first, the hung one, its re-forming, the mismatch and the missing member
    for rank in (0, 2):
        assert 2.0 <= reports[rank]["hung_s"] < 15.0


# ------------------------------------------------------- a death during a transfer, three times
def _member(role: str, rank: int, address: str, generations: range, out) -> None:
    """The trainer (rank 0, hosts the store), the surviving engine (rank 1), or one replacement of engine 2 (one
    generation)."""
    try:
        ctx = CommContext()
        if role == "trainer":
            address = ctx.listen("127.0.0.1:0")
            out.send(("address", address))
        big = _model(0, scale=64)  # about 12 MiB: the transfer is in flight when engine 2 dies
        for g in generations:
            t0 = time.monotonic()
            ctx.connect(MODE, rank=rank, world_size=3, address=address, timeout=60)
            reform_s = time.monotonic() - t0
            state = _model(g if rank == 0 else 50 + rank)
            broadcast_state_dict(state, MODE, src=0)
            out.send(
                (
                    "synced",
                    role,
                    g,
                    ctx.get_generation(MODE),
                    _digest(state),
                    reform_s,
                    os.getpid(),
                    sorted(_wide_listeners([os.getpid()])),
                )
            )
            if g == 3:  # the last generation: the trainer (the store's host) is killed; the engines' next calls name it
                if role == "trainer":
                    time.sleep(60)
                try:
                    while True:
                        broadcast_state_dict(state, MODE, src=0)
                except PeerLostError as err:
                    out.send(("lost", role, g, time.monotonic(), err.generation, err.member))
                break
            if role == "engine2":
                out.send(("entering", g, os.getpid()))
            try:
                while True:
                    broadcast_state_dict(big, MODE, src=0)
            except PeerLostError as err:
                out.send(("lost", role, g, time.monotonic(), err.generation, err.member))
        ctx.destroy()
        out.send(("done", role))
    except BaseException:  # noqa: BLE001 - every failure goes back to the test
        out.send(("failed", role, traceback.format_exc()))


class _Members:
    """Processes forked from a server that imported torch once, each reporting on a pipe of its own.

    One pipe per process, not one queue for all: a process killed while it writes to a shared queue would keep its lock
    forever, and every other writer would block on it.
    """

    def __init__(self) -> None:
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(["torch", "rlightning_comm"])
        self.procs: list = []
        self._readers: list = []
        self._early: list = []  # messages that came before the ones waited for

    def start(self, *args) -> None:
        reader, writer = self._ctx.Pipe(duplex=False)
        p = self._ctx.Process(target=_member, args=(*args, writer), daemon=True)
        p.start()
        writer.close()
        self.procs.append(p)
        self._readers.append(reader)

    def next(self, kind: str, timeout: float = 60) -> tuple:
        for i, message in enumerate(self._early):
            if message[0] == kind:
                return self._early.pop(i)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for reader in mp.connection.wait(self._readers, timeout=max(0.01, deadline - time.monotonic())):
                try:
                    message = reader.recv()
                except (EOFError, OSError):  # the process exited or was killed
                    self._readers.remove(reader)
                    continue
                if message[0] == "failed":
                    pytest.fail(f"{message[1]} failed:\n{message[2]}")
                if message[0] == kind:
                    return message
                self._early.append(message)
        pytest.fail(f"no {kind!r} message within {timeout} s; other messages: {self._early}")

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def test_engine_killed_during_transfer_is_replaced_three_times_then_the_trainer_dies():
    members = _Members()
    try:
        members.start("trainer", 0, "", range(4))
        _, address = members.next("address")
        members.start("engine1", 1, address, range(4))
        synced, lost, kills = [], [], []
        for g in range(4):
            members.start("engine2", 2, address, range(g, g + 1))
            synced.append([members.next("synced") for _ in range(3)])
            if g == 3:
                os.kill(members.procs[0].pid, signal.SIGKILL)  # the trainer, idle
            else:
                _, _, pid = members.next("entering")
                time.sleep(0.02)
                os.kill(pid, signal.SIGKILL)
            kills.append(time.monotonic())
            lost.append([members.next("lost") for _ in range(2)])
        for _ in range(2):
            members.next("done")
    finally:
        members.close()
    for g, got in enumerate(synced):
        digests = {m[4] for m in got}
        assert len(digests) == 1 and {m[3] for m in got} == {g}, f"generation {g}: {got}"
    assert all(m[7] == [] for got in synced for m in got), f"a member listened beyond loopback: {synced}"
    pids = {(m[1], m[6]) for got in synced for m in got if m[1] != "engine2"}
    assert len(pids) == 2, f"the trainer or engine 1 restarted: {pids}"
    for g, (kill, got) in enumerate(zip(kills, lost)):
        for _, role, gen, when, err_gen, member in got:
            assert (gen, err_gen, member) == (g, g, 2 if g < 3 else 0), got  # engine 2 three times, then the trainer
            assert when - kill < 5.0, f"{role} learned of the death {when - kill:.2f} s after it (timeout 60 s)"
