"""The GPU check's probes: what the process group returns, raw NCCL on one GPU, groups, a skipped call, connected
modes."""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from rlightning_comm import CommContext, CommMismatchError, collective

from .._common import ROOT
from . import _matrix as matrix
from ._cells import NotApplicable, Recorder

TESTS = str(ROOT / "tests")


def _is_nccl(group: Any) -> bool:
    return "nccl" in dist.get_backend(group)


def pg_returns(rec: Recorder, device: torch.device) -> None:
    """What every process-group call returns with ``asyncOp=False`` (a work, or ``None``), on the world's group."""
    pg = dist.group.WORLD
    n, r = pg.size(), pg.rank()

    def t(k: int = 4) -> torch.Tensor:
        return torch.ones(k, device=device)

    def opts(cls: Any, **fields: Any) -> Any:
        o = cls()
        o.asyncOp = False
        for name, value in fields.items():
            setattr(o, name, value)
        return o

    barrier = opts(dist.BarrierOptions, device=device)
    if device.type == "cuda":
        barrier.device_ids = [device.index or 0]
    calls = {
        "allreduce": lambda: pg.allreduce([t()], opts(dist.AllreduceOptions)),
        "broadcast": lambda: pg.broadcast([t()], opts(dist.BroadcastOptions, rootRank=0, rootTensor=0)),
        "allgather": lambda: pg.allgather([[t() for _ in range(n)]], [t()], opts(AllgatherOptions)),
        "all_gather_single": lambda: pg.all_gather_single(t(4 * n), t(), opts(AllgatherOptions)),
        "reduce_scatter_single": lambda: pg.reduce_scatter_single(t(), t(4 * n), opts(dist.ReduceScatterOptions)),
        "all_to_all_single": lambda: pg.all_to_all_single(t(4 * n), t(4 * n), [], [], opts(dist.AllToAllOptions)),
        "reduce": lambda: pg.reduce([t()], opts(dist.ReduceOptions, rootRank=0, rootTensor=0)),
        "gather": lambda: pg.gather(
            [[t() for _ in range(n)]] if r == 0 else [], [t()], opts(dist.GatherOptions, rootRank=0)
        ),
        "scatter": lambda: pg.scatter(
            [t()], [[t() for _ in range(n)]] if r == 0 else [], opts(dist.ScatterOptions, rootRank=0)
        ),
        "barrier": lambda: pg.barrier(barrier),
    }
    if n > 1 and r < 2:
        calls["send" if r == 0 else "recv"] = (
            (lambda: pg.send([t()], 1, 0)) if r == 0 else (lambda: pg.recv([t()], 0, 0))
        )
    on_nccl = _is_nccl(pg)
    for name, call in calls.items():

        def probe(call: Any = call, name: str = name) -> tuple[str, str]:
            work = call()
            kind = "None" if work is None else type(work).__name__
            if work is not None:
                work.wait()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if on_nccl and work is not None and name not in ("send", "recv"):
                return (
                    "differs",
                    f"returns {kind}; the failure guide says ProcessGroupNCCL returns no work for a blocking call",
                )
            return ("ok" if on_nccl else "observed"), f"returns {kind}"

        rec.run(f"pg.{name}(asyncOp=False)", probe)


def smoke(
    rec: Recorder, backend: str, device: torch.device, rank: int, size: int, store_dir: str, timeout: float = 20
) -> None:
    """Raw torch.distributed: initialise (bound to the device, eagerly), one all_reduce read back on the host,
    destroy."""

    def init() -> None:
        device_id = device if device.type == "cuda" else None
        url = f"file://{store_dir}/smoke-store"
        dist.init_process_group(
            backend,
            init_method=url,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout),
            device_id=device_id,
        )

    def all_reduce() -> tuple[str, str] | None:
        t = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(t)
        got, want = t.cpu(), float(size * (size + 1) // 2)
        return (
            None if torch.equal(got, torch.full((1024,), want)) else ("wrong", f"got {got[:4].tolist()}, want {want}")
        )

    rec.run(
        "init_process_group",
        init,
        backend=backend,
        env={k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL"))},
    )
    rec.run("all_reduce", all_reduce)
    rec.run("destroy_process_group", dist.destroy_process_group)


def sp_gradients(rec: Recorder, device: torch.device) -> None:
    """The suite's own gradient check of every sequence-parallel op, every gradient layout (single-process autograd as
    oracle)."""

    def run() -> tuple[str, str] | None:
        if TESTS not in sys.path:
            sys.path.insert(0, TESTS)
        from sp_oracle import TOL
        from test_sequence_parallel_layouts import run_checks

        ctx = CommContext()
        errors = run_checks(ctx.get_world_size(matrix.SP_MODE), ctx.get_local_rank(matrix.SP_MODE), device)
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        return (
            ("wrong", f"{len(bad)} of {len(errors)} above {TOL}: {dict(list(bad.items())[:8])}")
            if bad
            else ("ok", f"{len(errors)} checks within {TOL}")
        )

    rec.run("sp.gradients (tests' run_checks)", run)


def groups(rec: Recorder, device: torch.device) -> None:
    """Groups the world makes: declared in reverse order, a gloo group with a non-member, a world-backend group with
    one."""
    ctx = CommContext()
    n, me = dist.get_world_size(), dist.get_rank()
    if n < 2:
        rec.record("groups", "n/a", "needs 2 ranks")
        return
    reverse = list(reversed(range(n)))
    rec.run(f"init_group({reverse})", lambda: ctx.init_group(reverse, "REVERSED"))
    ops = [
        "all_reduce",
        "all_gather",
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "send",
        "recv",
        "all_to_all_single[uneven]",
        "broadcast_object_list",
        "broadcast_state_dict",
        "broadcast_state_dict[load]",
    ]
    # Root global rank 0 is the group's last rank: every rooted op takes a non-zero group root here.
    matrix.run_matrix(rec, "REVERSED", device, 0, ops=ops, dtypes=["float32"], modes=["plain"], prefix="REVERSED:")

    def member_only(mode: str, members: list[int], t: torch.Tensor) -> tuple[str, str] | None:
        handle = collective.all_reduce(t, mode)
        world = torch.ones(2, device=device)
        collective.all_reduce(world, "GLOBAL")  # the world still works for everyone afterwards
        problems = []
        if handle is not None:
            problems.append(f"all_reduce returned {handle!r}")
        if me in members and t.cpu().tolist() != [float(len(members))] * 2:
            problems.append(f"member's result {t.cpu().tolist()}")
        if world.cpu().tolist() != [float(n)] * 2:
            problems.append(f"world's all_reduce after it gave {world.cpu().tolist()}")
        return ("wrong", "; ".join(problems)) if problems else None

    rec.run("init_group([0], use_cpu=True)", lambda: ctx.init_group([0], "HOST", use_cpu=True))
    rec.run("HOST all_reduce (rank 1.. non-members)", lambda: member_only("HOST", [0], torch.ones(2)))
    rec.run(f"init_group([{n - 1}]) on the world's backend", lambda: ctx.init_group([n - 1], "SOLO"))
    rec.run(
        "SOLO all_reduce (rank 0.. non-members)", lambda: member_only("SOLO", [n - 1], torch.ones(2, device=device))
    )


def refusal_travels(rec: Recorder, mode: str, device: torch.device) -> None:
    """Debug mode: group rank 1 alone passes uint16; every rank must raise, naming it.

    Where the backend cannot move uint16 (NCCL's dtype table) that is rank 1's refusal, a ``ValueError`` on every rank;
    where it can (gloo), a ``CommMismatchError`` naming both dtypes.
    """
    ctx = CommContext()
    comm = ctx.get_communicator(mode)
    refuses = comm.supported_dtypes is not None and torch.uint16 not in comm.supported_dtypes
    expected = ValueError if refuses else CommMismatchError

    def run() -> tuple[str, str] | None:
        if comm.world_size < 2:
            raise NotApplicable("needs 2 ranks")
        refuser = comm.ranks[1]
        dtype = torch.uint16 if comm.rank == 1 else torch.float32
        ctx.set_debug(True)
        try:
            collective.all_reduce(torch.zeros(4, dtype=dtype, device=device), mode)
        except expected as err:
            named = f"rank {refuser}" in str(err) if refuses else "uint16" in str(err)
            return None if named else ("wrong", f"the {expected.__name__} does not name rank {refuser}'s uint16: {err}")
        finally:
            ctx.set_debug(False)
        return "wrong", f"no {expected.__name__} on this rank"

    rec.run(f"{mode}: debug mode tells every rank of one rank's uint16 ({expected.__name__})", run)


def skip_call(rec: Recorder, device: torch.device, store_dir: str, timeout: float, hold_s: float) -> None:
    """Rank 0 calls an all_reduce that rank 1 skips, on a group of 2 with a ``timeout`` of its own: what the caller
    gets, and after how long.

    Rank 1 holds on (alive, not calling) for up to ``hold_s`` seconds. A death of rank 0 is what the parent sees (its
    exit and when).
    """
    ctx = CommContext()
    rec.run(f"init_group([0, 1], timeout={timeout:g})", lambda: ctx.init_group([0, 1], "PROBE", timeout=timeout))
    comm = ctx.get_communicator("PROBE")
    done = os.path.join(store_dir, "skip-probe-done")
    warm = torch.ones(4, device=device)
    rec.run(
        "warm-up all_reduce",
        lambda: (
            collective.all_reduce(warm, "PROBE") or (None if warm.cpu().tolist() == [2.0] * 4 else ("wrong", str(warm)))
        ),
    )
    rec.lockstep = None  # the ranks part ways on purpose from here
    if comm.rank != 0:
        rec.note(probe="skipping the call", hold_s=hold_s)
        until = time.time() + hold_s
        while time.time() < until and not os.path.exists(done):
            time.sleep(0.2)
        return
    bounded = comm.bounded_wait or comm.backend != "nccl"  # gloo always waits on the host
    t = torch.ones(4, device=device)
    started = time.time()
    rec.note(probe="call", t0=started, timeout=timeout, bounded=bounded)
    outcome: dict[str, Any] = {}

    def blocking() -> tuple[str, str]:
        try:
            collective.all_reduce(t, "PROBE")
        except Exception as err:  # noqa: BLE001 - what the user gets is the measurement
            outcome["raised"] = type(err).__name__
            return "observed", f"{type(err).__name__} after {time.time() - started:.1f} s: {str(err)[:300]}"
        outcome["returned"] = time.time() - started
        return "observed", f"returned after {outcome['returned']:.2f} s"

    rec.run("blocking all_reduce a peer skips", blocking, min_s=0)
    if "returned" in outcome:
        rec.note(probe="host read", t=time.time())
        rec.run(
            "host read of its result (.cpu())",
            lambda: ("observed", f"returned {t.cpu().tolist()} after {time.time() - started:.1f} s"),
            min_s=0,
        )
    if bounded:
        ok = outcome.get("raised") == "CommTimeoutError" and 0.5 * timeout <= time.time() - started <= 4 * timeout + 10
        verdict = (
            "ok" if ok else "differs",
            f"docs: CommTimeoutError after the group's timeout ({timeout:g} s), the process lives; got {outcome}",
        )
    else:
        verdict = (
            "differs",
            "docs: the process is ended by the watchdog after the timeout; it is still running after "
            f"{time.time() - started:.1f} s: {outcome}",
        )
    rec.run("against the failure guide's table", lambda: verdict, min_s=0)
    rec.run("destroy() after the failure", lambda: ctx.destroy(), min_s=0)
    Path(done).touch()


def connect(
    rec: Recorder, backend: str, device: torch.device, rank: int, size: int, store_dir: str, timeout: float
) -> None:
    """A mode connected across processes that are each in a world of their own; then one member is killed."""
    ctx = CommContext()
    if not hasattr(ctx, "connect"):
        rec.record("connect", "skipped", "CommContext.connect has not landed on this branch")
        return
    from rlightning_comm.errors import PeerLostError

    address_file, dying = os.path.join(store_dir, "connect-address"), os.path.join(store_dir, "connect-dying")
    rec.run(
        "own world",
        lambda: ctx.init_distributed_env(
            world_size=1, rank=0, backend=backend, dist_url=f"file://{store_dir}/own-world-{rank}", timeout=timeout
        ),
    )

    def join() -> None:
        if rank == 0:
            address = ctx.listen("127.0.0.1:0")
            Path(address_file + ".tmp").write_text(address)
            os.replace(address_file + ".tmp", address_file)
        else:
            until = time.time() + timeout
            while not os.path.exists(address_file):
                if time.time() > until:
                    raise TimeoutError(f"rank 0 published no address within {timeout:g} s")
                time.sleep(0.1)
            address = Path(address_file).read_text()
        ctx.connect("CROSS", rank=rank, world_size=size, address=address, backend=backend, timeout=timeout)

    rec.run("connect", join)
    ops = [
        "all_reduce",
        "broadcast",
        "all_gather",
        "broadcast_object_list",
        "broadcast_state_dict",
        "broadcast_state_dict[load]",
    ]
    matrix.run_matrix(
        rec, "CROSS", device, size - 1, ops=ops, dtypes=["float32", "bfloat16"], modes=["plain"], prefix="CROSS:"
    )
    if rec.stopped:
        return
    rec.lockstep = None  # one member dies on purpose from here
    if rank == size - 1:
        Path(dying).write_text(str(time.time()))
        rec.note(probe="killing myself", t=time.time())
        os.kill(os.getpid(), signal.SIGKILL)
    if rank != 0:
        return
    until = time.time() + timeout
    while not os.path.exists(dying) and time.time() < until:
        time.sleep(0.01)

    def after_kill() -> tuple[str, str]:
        died = float(Path(dying).read_text())
        try:
            for _ in range(1000):
                t = torch.ones(4, device=device)
                collective.broadcast(t, "CROSS", src=0)
                t.cpu()
                time.sleep(0.01)
        except PeerLostError as err:
            return "ok", f"PeerLostError {time.time() - died:.3f} s after the kill: {str(err)[:200]}"
        except Exception as err:  # noqa: BLE001 - the measurement
            return (
                "differs",
                f"{type(err).__name__} (not PeerLostError) {time.time() - died:.3f} s after the kill: {str(err)[:300]}",
            )
        return "differs", f"no error {time.time() - died:.1f} s after the kill"

    rec.run("broadcast after a member is killed", after_kill, min_s=0)
