"""Connected modes under deaths, hangs, strangers and disagreements while they form and while they live.

Each multi-process test runs members forked from a server that imported torch once (so a member starts in milliseconds),
each reporting on a pipe of its own, and kills or stops them with signals. Every wait is bounded; every member's
traceback comes back. The oracles: the signal sent by the test (who died, when), the counts and times measured here, and
raw ``socket``/``TCPStore`` clients that play the stranger.
"""

from __future__ import annotations

import gc
import importlib
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
import traceback
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from rlightning_comm import (
    CommContext,
    CommError,
    CommTimeoutError,
    PeerLostError,
    broadcast_state_dict,
)
from rlightning_comm.connect import _generation

MODE = "WEIGHT_SYNC"
LIVENESS = (
    2.0  # the tests' liveness bound: a hung member is lost after 2 s without heartbeats (a loaded machine stalls ~1 s)
)
SLACK = 4.0  # what a loaded 2-core machine may add to a bound


# ---------------------------------------------------------------------- members
def _run(module: str, fn_name: str, args: tuple, kwargs: dict, out) -> None:
    try:
        getattr(importlib.import_module(module), fn_name)(out, *args, **kwargs)
    except BaseException:  # noqa: BLE001 - every failure goes back to the test
        out.send(("failed", fn_name, traceback.format_exc()))


def _error(err: BaseException) -> tuple:
    return (type(err).__name__, str(err), getattr(err, "member", None), time.monotonic())


def _connect_and_report(out, rank: int, world_size: int, address: str, hold: float = 60.0, **kwargs) -> None:
    """Connect (rank 0 listens first and sends its address), report what connect returned or raised, then wait for
    the test's word (a barrier with the others, or to be killed)."""
    ctx = CommContext()
    if rank == 0 and not address:
        address = ctx.listen("127.0.0.1:0")
        out.send(("address", address))
    kwargs.setdefault("timeout", 60)
    try:
        ctx.connect(MODE, rank=rank, world_size=world_size, address=address, **kwargs)
    except Exception as err:  # noqa: BLE001 - the outcome is the report
        out.send(("outcome", rank, _error(err)))
        time.sleep(hold)  # rank 0 keeps the store up for the others
        return
    out.send(("outcome", rank, ("formed", ctx.get_generation(MODE), None, time.monotonic())))
    time.sleep(hold)


def _dies_in_build(out, rank: int, world_size: int, address: str) -> None:
    """A member that passes the preflight, then dies while the group is built (SIGKILL: no cleanup)."""
    from rlightning_comm.connect import _groups

    def build_group(*args, **kwargs):
        out.send(("dying", rank))
        os.kill(os.getpid(), signal.SIGKILL)

    _groups.build_group = build_group
    CommContext().connect(MODE, rank=rank, world_size=world_size, address=address, timeout=60)


def _sees_the_closing_first(out, rank: int, world_size: int, address: str, where: str) -> None:
    """:func:`_connect_and_report` on a member that learns of rank 0's closing before it reads the verdict: its read
    of the verdict (``where="verdict"``) finds none until its watch told it of a loss (rank 0 closed the generation, or
    another member that read the verdict left first), or (``"watch"``)
    it found the generation undecided but reaches rank 0's watch only once rank 0 closed it. The verdict decides."""
    from rlightning_comm.connect import _connection, _generation

    closed = threading.Event()
    lose = _generation.Connection.lose

    def lose_and_tell(self, member, what):
        lose(self, member, what)
        if member is not None:  # rank 0's closing, or a counted member that raised the verdict's error and left first
            closed.set()

    class StaleOnce:  # the verdict's first check answers as if it came a moment before the verdict was posted
        def __init__(self, store):
            self.store, self.stale = store, True

        def check(self, keys):
            if self.stale:
                self.stale = False
                if not closed.wait(30):
                    raise TimeoutError("no member left and rank 0 did not close the generation within 30 s")
                return False
            return self.store.check(keys)

        def get(self, key):
            return self.store.get(key)

    find, join, await_verdict = _connection.find_generation, _connection.Watch.join, _connection.await_verdict
    if where == "verdict":
        _generation.Connection.lose = lose_and_tell
        _connection.await_verdict = lambda store, *args: await_verdict(StaleOnce(store), *args)
    else:

        def find_undecided(*args):
            return find(*args)[0], False  # read a moment before rank 0 posted its verdict

        def join_closed(address, *args):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until rank 0's watch refuses connections: it closed the generation
                try:
                    socket.create_connection(address, timeout=1).close()
                except ConnectionRefusedError:
                    return join(address, *args)
                time.sleep(0.05)
            raise TimeoutError("rank 0 did not close its watch within 30 s")

        _connection.find_generation, _connection.Watch.join = find_undecided, join_closed
    _connect_and_report(out, rank, world_size, address)


def _live_member(out, rank: int, address: str, role: str) -> None:
    """A member of a formed generation: connects, then (``"call"``) blocks in a barrier, or (``"idle"``) sleeps 3 s
    between calls and then calls; reports the PeerLostError with the time it was raised."""
    ctx = CommContext()
    if rank == 0 and not address:
        address = ctx.listen("127.0.0.1:0")
        out.send(("address", address))
    comm = ctx.connect(MODE, rank=rank, world_size=3, address=address, timeout=60, liveness_timeout=LIVENESS)
    out.send(("formed", rank, ctx.get_generation(MODE)))
    if role == "leaver":
        out_recv(out)  # once every member's connect returned: a leaver during the others' forming fails their connect
        ctx.destroy()  # leaves the mode: the others are told
        out.send(("left", rank, time.monotonic()))
        time.sleep(60)
    while True:
        if role == "idle":
            time.sleep(1.25 * LIVENESS + 2)  # the member is lost meanwhile: nothing of this process is in a call
        t0 = time.monotonic()
        try:
            comm.barrier()
        except PeerLostError as err:
            out.send(("lost", rank, _error(err), time.monotonic() - t0))
            break
        if role == "stopped":
            time.sleep(0.05)
    if role == "new-host":  # rank 0 was lost: this process hosts the next generation at an address of its own
        address = ctx.listen("127.0.0.1:0")
        out.send(("address", address))
        ctx.connect(MODE, rank=0, world_size=2, address=address, timeout=60)
        out.send(("formed", rank, ctx.get_generation(MODE)))
    elif role == "survivor":
        (address,) = out_recv(out)
        ctx.connect(MODE, rank=1, world_size=2, address=address, timeout=60)
        out.send(("formed", rank, ctx.get_generation(MODE)))
    time.sleep(60)


def out_recv(out) -> tuple:
    return out.recv()


class _Procs:
    """Members forked from a server that imported torch once, each with a pipe of its own (a process killed while it
    writes to a shared queue would keep its lock)."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(["torch", "rlightning_comm"])
        self.procs: dict[str, mp.Process] = {}
        self.pipes: dict[str, mp.connection.Connection] = {}

    def start(self, name: str, fn, *args, **kwargs) -> None:
        """Run ``fn(pipe, *args, **kwargs)`` (a function of a module the members can import) in a member ``name``."""
        ours, theirs = self._ctx.Pipe()
        p = self._ctx.Process(
            target=_run, args=(fn.__module__, fn.__name__, args, kwargs, theirs), daemon=True, name=name
        )
        p.start()
        theirs.close()
        self.procs[name], self.pipes[name] = p, ours

    def next(self, name: str, kind: str, timeout: float = 60) -> tuple:
        pipe = self.pipes[name]
        if not pipe.poll(timeout):
            pytest.fail(f"{name}: no {kind!r} message within {timeout} s")
        message = pipe.recv()
        if message[0] == "failed":
            pytest.fail(f"{name} failed:\n{message[2]}")
        assert message[0] == kind, (name, message)
        return message

    def signal(self, name: str, sig: int) -> float:
        os.kill(self.procs[name].pid, sig)
        return time.monotonic()

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)


@pytest.fixture
def procs():
    p = _Procs()
    yield p
    p.close()


def _store(address: str) -> dist.Store:
    """A raw client of rank 0's store, under the mode's prefix: the stranger's view (it needs no secret)."""
    host, port = address.split("/")[0].split(":")
    client = dist.TCPStore(host, int(port), None, False, timedelta(seconds=30), use_libuv=True)
    return dist.PrefixStore(f"rlightning_comm/connect/{MODE}", client)


def _wait_arrivals(store: dist.Store, key: int, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not (store.check([f"{key}/arrived"]) and int(store.add(f"{key}/arrived", 0)) >= n):
        assert time.monotonic() < deadline, f"fewer than {n} arrivals at generation key {key}"
        time.sleep(0.02)


# ------------------------------------------------------------------ in this process
def test_generations_free_their_communicators_and_buffers():
    """The weight transfer's kept state lives on the communicator: a closed generation's communicator goes."""
    ctx = CommContext()
    address = ctx.listen("127.0.0.1:0")
    refs = []
    for _ in range(4):
        comm = ctx.connect(MODE, rank=0, world_size=1, address=address, timeout=10)
        refs.append(weakref.ref(comm))
        broadcast_state_dict({f"w{i}": torch.randn(1000) for i in range(8)}, MODE, src=0, bucket_bytes=8192)
        del comm
    gc.collect()
    assert [r() is not None for r in refs] == [False, False, False, True]  # only the bound generation's
    ctx.destroy()
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_group_build_waits_for_its_peers_until_told_to_stop_or_its_timeout():
    """gloo's rendezvous waits on the store through one that ends the wait when the build should stop (its generation
    was lost, the interpreter exits): a build left behind ends at once, not at the group's timeout."""
    from rlightning_comm.connect._groups import build_group

    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False, use_libuv=True)
    why: list[str] = []
    outcome: list = []

    def build(key: str, timeout: float) -> None:
        store = dist.PrefixStore(key, server)
        try:
            build_group("gloo", store, 0, 2, timeout, "127.0.0.1", key, lambda: why[0] if why else None)
        except RuntimeError as err:  # member 1 never comes
            outcome.append((err, time.monotonic()))

    thread = threading.Thread(target=build, args=("stopped", 60.0))
    thread.start()
    time.sleep(0.3)  # it waits for member 1's address
    why.append("the generation was lost")
    told = time.monotonic()
    thread.join(10)
    assert not thread.is_alive() and outcome and "the generation was lost" in str(outcome[0][0]), outcome
    assert outcome[0][1] - told < 1.0, outcome[0][1] - told
    why.clear()
    t0 = time.monotonic()
    build("alone", 0.5)
    assert isinstance(outcome[1][0], dist.DistStoreError) and "timed out after 0.5 s" in str(outcome[1][0])
    assert 0.5 <= outcome[1][1] - t0 < 0.5 + SLACK


def test_rank_0_closing_its_watch_tells_every_member_it_closed():
    """Rank 0's watch tells every member it closes before its thread closes a socket: the first member's answer (it
    closes its end) must not make rank 0's thread cut the others off, which they would take for rank 0's death."""
    from rlightning_comm.connect._liveness import Watch

    for _ in range(20):
        told: dict[int, tuple] = {}
        arrived = threading.Event()

        def on_lost(rank, member, what, told=told, arrived=arrived):
            told[rank] = (member, what)
            if len(told) == 3:
                arrived.set()

        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        host = Watch.host(listener, "s", lambda m, w: None, 30.0, "test")
        members = [
            Watch.join(
                ("127.0.0.1", port),
                r,
                os.urandom(16).hex(),
                "s",
                time.monotonic() + 10,
                lambda m, w, r=r: on_lost(r, m, w),
                30.0,
                "test",
            )
            for r in (1, 2, 3)
        ]
        deadline = time.monotonic() + 10
        while len(host.candidates()) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        host.close()
        assert arrived.wait(10), told
        for watch in members:
            watch.close()
        assert all(member == 0 and what.startswith("closed this generation") for member, what in told.values()), told


def test_connect_holds_no_lock_of_the_context_while_it_waits():
    ctx = CommContext()
    address = ctx.listen("127.0.0.1:0")
    outcome: list = []

    def wait_for_a_member_that_never_comes():
        try:
            ctx.connect(MODE, rank=0, world_size=2, address=address, timeout=60)
        except Exception as err:  # noqa: BLE001 - the outcome is checked below
            outcome.append(err)

    thread = threading.Thread(target=wait_for_a_member_that_never_comes)
    thread.start()
    time.sleep(0.3)  # it waits in the preflight now
    t0 = time.monotonic()
    other = ctx.listen("127.0.0.1:0")
    ctx.connect("OTHER", rank=0, world_size=1, address=other, timeout=10).all_reduce(torch.ones(2))
    ctx.set_debug(False)
    with pytest.raises(CommError, match="already in progress in another thread"):
        ctx.connect(MODE, rank=0, world_size=2, address=address, timeout=60)
    ctx.destroy()  # ends the forming too
    thread.join(10)
    assert time.monotonic() - t0 < SLACK and not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], PeerLostError), outcome
    assert "destroy" in str(outcome[0]) and ctx.bound_modes() == []


def test_connect_timeout_is_apart_from_the_collectives_timeout():
    ctx = CommContext()
    address = ctx.listen("127.0.0.1:0")
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"ranks \[1\] did not arrive in time"):
        ctx.connect(MODE, rank=0, world_size=2, address=address, timeout=600, connect_timeout=1)
    assert 1.0 <= time.monotonic() - t0 < 1.0 + SLACK
    comm = ctx.connect(MODE, rank=0, world_size=1, address=address, timeout=600, connect_timeout=1)
    assert comm.timeout == 600
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match="could not reach rank 0's store"):
        ctx.connect(MODE, rank=1, world_size=2, address=f"127.0.0.1:{port}/x", timeout=600, connect_timeout=1)
    assert time.monotonic() - t0 < 1.0 + SLACK
    with pytest.raises(ValueError, match="connect_timeout must be > 0"):
        ctx.connect(MODE, rank=0, world_size=1, address=address, connect_timeout=0)
    with pytest.raises(TypeError, match="liveness_timeout must be a number"):
        ctx.connect(MODE, rank=0, world_size=1, address=address, liveness_timeout="1")


def test_the_address_carries_the_secret():
    ctx = CommContext()
    address = ctx.listen("127.0.0.1:0")
    host_port, secret = address.split("/")
    assert len(secret) == 32 and int(secret, 16) >= 0
    assert ctx.listen(host_port) == address  # the same store, the same secret
    with pytest.raises(ValueError, match="another secret"):
        ctx.listen(f"{host_port}/other")
    with pytest.raises(ValueError, match="the secret after '/'"):
        ctx.connect(MODE, rank=1, world_size=2, address=f"{host_port}/not a secret")
    assert CommContext().listen("127.0.0.1:0/chosen-by-the-launcher").endswith("/chosen-by-the-launcher")


# ------------------------------------------------------------------ deaths while forming
def test_a_member_dying_while_the_others_wait_in_connect_ends_their_connect(procs):
    """Survivors re-forming wait for a restarted engine; one of them dies meanwhile: PeerLostError, not the timeout."""
    procs.start("rank0", _connect_and_report, 0, 3, "")
    _, address = procs.next("rank0", "address")
    procs.start("rank1", _connect_and_report, 1, 3, address)
    _wait_arrivals(_store(address), 0, 2)  # both wait for rank 2 in the preflight
    killed = procs.signal("rank1", signal.SIGKILL)
    _, _, (kind, message, member, when) = procs.next("rank0", "outcome")
    assert (kind, member) == ("PeerLostError", 1), message
    assert when - killed < SLACK, f"rank 0 learned of the death {when - killed:.1f} s after it (timeout 60 s)"


def test_a_member_dying_while_the_group_is_built_ends_every_connect(procs):
    procs.start("rank0", _connect_and_report, 0, 3, "")
    _, address = procs.next("rank0", "address")
    procs.start("rank1", _connect_and_report, 1, 3, address)
    procs.start("rank2", _dies_in_build, 2, 3, address)
    procs.next("rank2", "dying")
    killed = time.monotonic()
    for name in ("rank0", "rank1"):
        _, _, (kind, message, member, when) = procs.next(name, "outcome")
        assert (kind, member) == ("PeerLostError", 2), (name, message)
        assert when - killed < SLACK, f"{name} learned of the death {when - killed:.1f} s after it"


def test_rank0_dying_during_a_members_connect_names_member_0_and_a_new_address(procs):
    procs.start("rank0", _connect_and_report, 0, 3, "")
    _, address = procs.next("rank0", "address")
    procs.start("rank1", _connect_and_report, 1, 3, address)
    _wait_arrivals(_store(address), 0, 2)
    killed = procs.signal("rank0", signal.SIGKILL)
    _, _, (kind, message, member, when) = procs.next("rank1", "outcome")
    assert (kind, member) == ("PeerLostError", 0), message
    assert "re-form the mode at an address the new rank 0 listens on" in message
    assert when - killed < SLACK


# ------------------------------------------------------------------ disagreements
def test_every_claimant_and_the_late_rank_1_get_the_mismatch(procs):
    """Two claimants of rank 2 arrive before rank 1: all four raise the same CommMismatchError."""
    procs.start("rank0", _connect_and_report, 0, 3, "")
    _, address = procs.next("rank0", "address")
    store = _store(address)
    procs.start("claimant-a", _connect_and_report, 2, 3, address)
    procs.start("claimant-b", _connect_and_report, 2, 3, address)
    _wait_arrivals(store, 0, 3)
    procs.start("rank1", _connect_and_report, 1, 3, address)
    messages = {}
    for name in ("rank0", "claimant-a", "claimant-b", "rank1"):
        _, _, (kind, message, _, _) = procs.next(name, "outcome")
        assert kind == "CommMismatchError", (name, message)
        messages[name] = message
    assert "rank 2 is claimed 2 times" in messages["rank0"] and "no process claimed ranks [1]" in messages["rank0"]
    assert len(set(messages.values())) == 1, messages  # one error, on every member


def test_a_verdict_posted_before_rank_0_closes_is_what_every_member_raises(procs):
    """The same forming as above, with rank 0's closing of the generation (after its verdict) reaching claimant-b
    before its read of the verdict, and the late rank 1 reaching rank 0's watch only after it closed: each still
    raises the verdict's CommMismatchError, not PeerLostError or an unreachable watch."""
    procs.start("rank0", _connect_and_report, 0, 3, "")
    _, address = procs.next("rank0", "address")
    store = _store(address)
    procs.start("claimant-a", _connect_and_report, 2, 3, address)
    procs.start("claimant-b", _sees_the_closing_first, 2, 3, address, "verdict")
    _wait_arrivals(store, 0, 3)
    procs.start("rank1", _sees_the_closing_first, 1, 3, address, "watch")
    messages = {}
    for name in ("rank0", "claimant-a", "claimant-b", "rank1"):
        _, _, (kind, message, _, _) = procs.next(name, "outcome")
        assert kind == "CommMismatchError", (name, message)
        messages[name] = message
    assert "rank 2 is claimed 2 times" in messages["rank0"], messages
    assert len(set(messages.values())) == 1, messages


def test_arrivals_after_the_group_formed_are_told_who_differs(procs):
    procs.start("rank0", _connect_and_report, 0, 3, "")
    _, address = procs.next("rank0", "address")
    for rank in (1, 2):
        procs.start(f"rank{rank}", _connect_and_report, rank, 3, address)
    for name in ("rank0", "rank1", "rank2"):
        assert procs.next(name, "outcome")[2][0] == "formed"
    # Another world size: it waits for the next generation (the members may re-form with it), and none opens.
    t0 = time.monotonic()
    procs.start("bigger", _connect_and_report, 1, 4, address, connect_timeout=1.5)
    procs.start("second-2", _connect_and_report, 2, 3, address)  # a second claimant of rank 2, alive
    _, _, (kind, message, _, when) = procs.next("bigger", "outcome")
    assert kind == "CommMismatchError" and "world_size differs: 3 on rank 0" in message and "4 on rank 1" in message
    assert "opened no later generation within connect_timeout" in message, message
    assert 1.5 <= when - t0 < 1.5 + SLACK, when - t0
    _, _, (kind, message, _, _) = procs.next("second-2", "outcome")
    assert kind == "CommMismatchError" and "rank 2 is taken" in message, message


# ------------------------------------------------------------------ strangers
def test_a_stranger_is_refused_and_a_silent_connection_delays_nothing(procs):
    procs.start("rank0", _connect_and_report, 0, 2, "")
    _, address = procs.next("rank0", "address")
    store = _store(address)
    deadline = time.monotonic() + 30
    while not store.check(["open"]):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    watch_port = json.loads(store.get("open"))["watch_port"]
    silent = socket.create_connection(("127.0.0.1", watch_port))  # a port scanner: connects, says nothing
    # A stranger who read the store claims rank 1 there first, without the secret.
    store.set(f"0/member/{store.add('0/arrived', 1) - 1}", json.dumps({"info": "{}", "proof": "00"}))
    store.add("0/arrived", 1)  # an arrival that never posts
    store.set(f"0/member/{store.add('0/arrived', 1) - 1}", "not json")
    procs.start("bare", _connect_and_report, 1, 2, address.split("/")[0])  # given only host:port
    _, _, (kind, message, _, _) = procs.next("bare", "outcome")
    assert kind == "CommError" and "could not prove the mode's secret" in message, message
    t0 = time.monotonic()
    procs.start("rank1", _connect_and_report, 1, 2, address)
    for name in ("rank0", "rank1"):
        _, _, (kind, generation, _, when) = procs.next(name, "outcome")
        assert (kind, generation) == ("formed", 0)
        assert when - t0 < SLACK  # the silent connection held up nothing
    silent.close()


# ------------------------------------------------------------------ liveness
def test_hung_members_are_lost_within_the_liveness_bound_during_and_between_calls(procs):
    """SIGSTOP a member: the others' barrier (in a call) and their next call (after idling) raise PeerLostError. Then
    SIGSTOP rank 0 of the next generation: its members learn it; one hosts a new store, and generations go on."""
    procs.start("rank0", _live_member, 0, "", "call")
    _, address = procs.next("rank0", "address")
    procs.start("rank1", _live_member, 1, address, "idle")
    procs.start("rank2", _live_member, 2, address, "stopped")
    for name in ("rank0", "rank1", "rank2"):
        procs.next(name, "formed")
    stopped = procs.signal("rank2", signal.SIGSTOP)
    _, _, (kind, message, member, when), _ = procs.next("rank0", "lost")
    assert (kind, member) == ("PeerLostError", 2) and "stopped answering" in message, message
    # Silence, not a closed connection: lost after LIVENESS without a heartbeat (the last came up to a quarter before).
    assert 0.7 * LIVENESS <= when - stopped < 1.25 * LIVENESS + SLACK, when - stopped
    _, _, (kind, _, member, _), call_s = procs.next("rank1", "lost")  # detected while it idled
    assert (kind, member) == ("PeerLostError", 2) and call_s < 0.5, call_s
    procs.signal("rank2", signal.SIGKILL)
    procs.close()
    # Rank 0 stops: the members name member 0; member 1 becomes the new rank 0 at an address of its own.
    procs.start("rank0", _live_member, 0, "", "stopped")
    _, address = procs.next("rank0", "address")
    procs.start("rank1", _live_member, 1, address, "new-host")
    procs.start("rank2", _live_member, 2, address, "survivor")
    for name in ("rank0", "rank1", "rank2"):
        procs.next(name, "formed")
    stopped = procs.signal("rank0", signal.SIGSTOP)
    for name in ("rank1", "rank2"):
        _, _, (kind, message, member, when), _ = procs.next(name, "lost")
        assert (kind, member) == ("PeerLostError", 0) and "stopped answering" in message, message
        assert when - stopped < 1.25 * LIVENESS + SLACK
    _, address = procs.next("rank1", "address")
    procs.pipes["rank2"].send((address,))
    for name in ("rank1", "rank2"):
        assert procs.next(name, "formed")[2] == 1  # generation 1 under the new rank 0's store: the count goes on


def test_a_member_that_leaves_is_named_by_the_others(procs):
    procs.start("rank0", _live_member, 0, "", "call")
    _, address = procs.next("rank0", "address")
    procs.start("rank1", _live_member, 1, address, "call")
    procs.start("rank2", _live_member, 2, address, "leaver")
    for name in ("rank0", "rank1", "rank2"):
        procs.next(name, "formed")
    procs.pipes["rank2"].send(("leave",))
    _, _, left = procs.next("rank2", "left")
    for name in ("rank0", "rank1"):
        _, _, (kind, message, member, when), _ = procs.next(name, "lost")
        assert (kind, member) == ("PeerLostError", 2) and "left the mode" in message, message
        assert when - left < SLACK


def _calls_then_rank_0_leaves(out, rank: int, address: str, rounds: int, numel: int) -> None:
    """Per generation: every member all-reduces ``numel`` floats; rank 0 leaves the generation the moment its call
    returns (it calls ``connect`` again, which closes it: the others are told at once), while the others may still be
    completing theirs (the ring's last steps between members 1 and 2). Reports each round's outcome; every member then
    leaves with ``destroy()``."""
    ctx = CommContext()
    if rank == 0:
        address = ctx.listen("127.0.0.1:0")
        out.send(("address", address))
    expected = torch.full((numel,), 6.0)  # 1 + 2 + 3, summed here
    for _ in range(rounds):
        comm = ctx.connect(MODE, rank=rank, world_size=3, address=address, timeout=60)
        tensor = torch.full((numel,), float(rank + 1))
        try:
            comm.all_reduce(tensor)
        except CommError as err:
            out.send(("round", rank, _error(err)))
            time.sleep(60)
        out.send(("round", rank, ("ok", ctx.get_generation(MODE), torch.equal(tensor, expected), time.monotonic())))
    ctx.destroy()
    out.send(("left", rank, time.monotonic()))
    time.sleep(60)


def test_rank_0_leaving_right_after_a_call_lets_the_members_complete_it(procs):
    """Rank 0 leaves right after its large all-reduce returns, while the others' may still be completing (the ring's
    last steps between members 1 and 2, rank 0's last bytes on their way): the call completes with the right result.
    A call the leaver never joined fails within the grace."""
    rounds, numel = 4, 8 << 20  # 32 MiB: the last ring steps between members 1 and 2 outlast rank 0's part
    procs.start("rank0", _calls_then_rank_0_leaves, 0, "", rounds, numel)
    _, address = procs.next("rank0", "address")
    for rank in (1, 2):
        procs.start(f"rank{rank}", _calls_then_rank_0_leaves, rank, address, rounds, numel)
    for g in range(rounds):
        for name in ("rank0", "rank1", "rank2"):
            _, _, (kind, generation, right, _) = procs.next(name, "round")
            assert (kind, generation, right) == ("ok", g, True), (name, kind, generation, right)
    _, _, left = procs.next("rank0", "left")
    for name in ("rank1", "rank2"):
        procs.next(name, "left")
    # Rank 0 leaves while the others wait in a call it never joins: they learn it within the grace, not the timeout.
    procs.close()
    procs.start("rank0", _live_member, 0, "", "leaver")
    _, address = procs.next("rank0", "address")
    for rank in (1, 2):
        procs.start(f"rank{rank}", _live_member, rank, address, "call")
    for name in ("rank0", "rank1", "rank2"):
        procs.next(name, "formed")
    procs.pipes["rank0"].send(("leave",))
    _, _, left = procs.next("rank0", "left")
    for name in ("rank1", "rank2"):
        _, _, (kind, message, member, when), _ = procs.next(name, "lost")
        assert (kind, member) == ("PeerLostError", 0) and "closed this generation" in message, message
        assert when - left < _generation._ORDERLY_GRACE + SLACK, when - left


def _broadcaster(out, rank: int, address: str, timeout: float) -> None:
    """Member 0 broadcasts 64 MiB; member 2 posts its receive and dies (SIGKILL) once the first bytes are in."""
    ctx = CommContext()
    if rank == 0:
        address = ctx.listen("127.0.0.1:0")
        out.send(("address", address))
    comm = ctx.connect(MODE, rank=rank, world_size=3, address=address, timeout=timeout)
    comm.barrier()
    big = torch.ones(16 * 2**20) if rank == 0 else torch.zeros(16 * 2**20)
    t0 = time.monotonic()
    if rank == 2:
        comm.broadcast(big, src=0, async_op=True)  # the receive is posted
        while big[0] == 0 and time.monotonic() - t0 < 10:  # until the first bytes are in: mid-message
            pass
        out.send(("midway", rank, int((big != 0).sum()) / big.numel()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.broadcast(big, src=0)
        first = ("completed", bool((big == 1).all()), None, time.monotonic())
    except Exception as err:  # noqa: BLE001 - the outcome is the report
        first = _error(err)
    try:
        comm.barrier()
        then = ("completed", None, None, time.monotonic())
    except Exception as err:  # noqa: BLE001 - the outcome is the report
        then = _error(err)
    out.send(("outcome", rank, first, then, t0))
    time.sleep(60)


def test_a_receiver_dying_mid_message_of_a_large_broadcast(procs):
    """The dead receiver's bytes were in flight: no survivor waits out the timeout, and the next call names it."""
    timeout = 30.0
    procs.start("rank0", _broadcaster, 0, "", timeout)
    _, address = procs.next("rank0", "address")
    procs.start("rank1", _broadcaster, 1, address, timeout)
    procs.start("rank2", _broadcaster, 2, address, timeout)
    _, _, share = procs.next("rank2", "midway")
    assert share > 0, share  # it died once bytes came in: usually mid-message (a share < 1), else right after
    for name in ("rank0", "rank1"):
        _, _, first, then, t0 = procs.next(name, "outcome", timeout=60)
        # The broadcast completes (this member had what it needed: rank 1 holds the root's bytes) or names the loss.
        assert first[:2] == ("completed", True) or first[0::2][:2] == ("PeerLostError", 2), (name, first)
        assert (then[0], then[2]) == ("PeerLostError", 2), (name, then)
        assert then[3] - t0 < SLACK, f"{name} took {then[3] - t0:.1f} s (timeout {timeout} s)"
