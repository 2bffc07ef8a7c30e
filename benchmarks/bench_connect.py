"""A connected mode across worlds: the weight sync against one raw broadcast, and what a member's death costs.

``sync``: 3 processes, each in a world of its own (a 1-rank gloo world), joined by a connected mode (rank 0, the
trainer, hosts it at 127.0.0.1); the trainer sends the 68 MiB model of 121 tensors of ``bench_weight_transfer.py`` to
the two engines. Ways, on the same connected group, interleaved (the order rotates each round); a round's time for a way
is the slowest member's, from a barrier to that member holding every tensor; medians over rounds, and the median of the
per-round ratios to the limit's speed:

* library: ``broadcast_state_dict(state, mode, src=0)``, in place (the steady state: the plan is kept);
* load: the same, the engines passing a ``load`` callable that copies each named tensor into their own;
* limit: one broadcast of a ready flat buffer of the same bytes, by the group itself (no packing at all).

``loss``: a trainer (member 0), an engine that survives (member 1) and an engine replaced after each death (member 2,
forked from a server that imported torch once). Each round member 2 enters a transfer of a 12 MiB model and is
SIGKILLed; recorded: the time from the kill to each survivor's ``PeerLostError``, and the time to re-form (the slowest
member's ``connect``, from the moment every member, the replacement included, is ready to call it).

    python benchmarks/bench_connect.py [--rounds 20] [--kills 11] [--only sync|loss] [--threads N]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import statistics
import subprocess
import tempfile
import time
import traceback

from _common import machine, print_speed_table, run_ranks
from bench_weight_transfer import _model, measure

MODE = "WEIGHT_SYNC"


# ---------------------------------------------------------------------------- sync
def _sync_task(rank: int, nproc: int, rounds: int, address_file: str, threads: int) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    import torch.distributed as dist

    from rlightning_comm import CommContext, broadcast_state_dict

    ctx = CommContext()  # in a world of its own (run_ranks(own_worlds=True))
    if rank == 0:
        address = ctx.listen("127.0.0.1:0")
        with open(address_file + ".tmp", "w") as f:
            f.write(address)
        os.replace(address_file + ".tmp", address_file)
    else:
        while not os.path.exists(address_file):
            time.sleep(0.01)
        with open(address_file) as f:
            address = f.read()
    comm = ctx.connect(MODE, rank=rank, world_size=nproc, address=address, timeout=300)
    state = _model(seed=rank)
    tensors = list(state.values())
    total = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.empty(total, dtype=torch.uint8)
    root = dist.BroadcastOptions()
    root.rootRank = 0

    def load(named_tensors) -> None:  # an engine that copies each bucket's tensors into its own (same names here)
        for name, t in named_tensors:
            state[name].copy_(t)

    def library() -> None:
        broadcast_state_dict(state, MODE, src=0)

    def via_load() -> None:
        broadcast_state_dict(state if rank == 0 else load, MODE, src=0)

    def limit() -> None:
        comm.group.broadcast([flat], root).wait()

    ways = {"library": library, "load": via_load, "limit": limit}

    def slowest(elapsed: torch.Tensor) -> None:
        comm.all_reduce(elapsed, op=dist.ReduceOp.MAX)

    times, identical = measure(ways, rank, tensors, rounds, comm.barrier, slowest)
    return {"times": times, "identical": identical, "bytes": total, "tensors": len(tensors)}


def sync(rounds: int, threads: int) -> None:
    load = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    address_file = os.path.join(tempfile.mkdtemp(prefix="rlc-bench-connect-"), "address")
    out = run_ranks(_sync_task, 3, rounds, address_file, threads, timeout=1200, own_worlds=True)[0]
    print(f"{machine()}; 3 processes, each in its own gloo world, joined by a connected mode (1 trainer, 2 engines)")
    threads_text = threads or "torch's default"
    print(
        f"{out['tensors']} tensors, {out['bytes'] / 2**20:.1f} MiB; {rounds} interleaved rounds; intra-op threads per "
        f"rank: {threads_text}; load before: {load}"
    )
    print()
    print_speed_table(out["times"], out["identical"])
    print(f"\nload after: {os.getloadavg()}")
    if not all(out["identical"].values()):
        raise SystemExit("a way left an engine different from the trainer")


# ---------------------------------------------------------------------------- loss
def _loss_member(role: str, rank: int, address: str, pipe) -> None:
    """Member 0 and 1 run every round; each member 2 runs one. ``pipe`` (its own) carries the go-aheads and its
    reports."""
    try:
        from rlightning_comm import CommContext, PeerLostError, broadcast_state_dict

        ctx = CommContext()
        if role == "trainer":
            address = ctx.listen("127.0.0.1:0")
            pipe.send(("address", address))
        state = {name: t for name, t in list(_model(seed=rank).items())[:13]}  # about 12 MiB
        while True:
            pipe.send(("ready", role))
            if pipe.recv() == "stop":
                break
            t0 = time.monotonic()
            ctx.connect(MODE, rank=rank, world_size=3, address=address, timeout=120)
            pipe.send(("formed", role, t0, time.monotonic(), ctx.get_generation(MODE)))
            broadcast_state_dict(state, MODE, src=0)
            if role == "engine2":
                pipe.send(("entering", os.getpid()))
            try:
                while True:
                    broadcast_state_dict(state, MODE, src=0)
            except PeerLostError as err:
                pipe.send(("lost", role, time.monotonic(), err.member))
        ctx.destroy()
    except BaseException:  # noqa: BLE001 - the traceback goes to the parent
        pipe.send(("failed", role, traceback.format_exc()))


class _Members:
    """Processes forked from a server that imported torch once, each on a pipe of its own (a process killed while it
    wrote to a queue shared by all would keep the queue's lock)."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(["torch", "rlightning_comm"])
        self.pipes: dict[str, object] = {}
        self._procs: list = []
        self._early: list = []

    def start(self, role: str, rank: int, address: str) -> None:
        mine, theirs = self._ctx.Pipe()
        p = self._ctx.Process(target=_loss_member, args=(role, rank, address, theirs), daemon=True)
        p.start()
        theirs.close()
        self._procs.append(p)
        self.pipes[role] = mine

    def next(self, kind: str, timeout: float = 300) -> tuple:
        for i, message in enumerate(self._early):
            if message[0] == kind:
                return self._early.pop(i)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pipe in mp.connection.wait(list(self.pipes.values()), timeout=max(0.01, deadline - time.monotonic())):
                try:
                    message = pipe.recv()
                except (EOFError, OSError):  # exited or killed
                    self.pipes = {role: p for role, p in self.pipes.items() if p is not pipe}
                    continue
                if message[0] == "failed":
                    raise RuntimeError(f"{message[1]} failed:\n{message[2]}")
                if message[0] == kind:
                    return message
                self._early.append(message)
        raise SystemExit(f"no {kind!r} message from the members within {timeout} s; other messages: {self._early}")

    def close(self) -> None:
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def loss(kills: int) -> None:
    load = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    members = _Members()
    detect: dict[str, list[float]] = {"trainer": [], "engine1": []}
    reform: list[float] = []
    try:
        members.start("trainer", 0, "")
        address = members.next("address")[1]
        members.start("engine1", 1, address)
        for k in range(kills):
            members.start("engine2", 2, address)
            for _ in range(3):
                members.next("ready")
            for pipe in members.pipes.values():
                pipe.send("go")
            formed = [members.next("formed") for _ in range(3)]
            if k:  # the first formation is not a re-forming
                reform.append(max(m[3] for m in formed) - min(m[2] for m in formed))
            pid = members.next("entering")[1]
            time.sleep(0.02)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            for _ in range(2):
                _, role, when, member = members.next("lost")
                assert member == 2, member
                detect[role].append(when - killed)
            members.pipes.pop("engine2", None)  # killed: its pipe may have closed already
        for _ in members.pipes:
            members.next("ready")
        for pipe in members.pipes.values():
            pipe.send("stop")
    finally:
        members.close()
    print(
        f"{machine()}; a connected mode of 3 (gloo, 127.0.0.1), member 2 SIGKILLed during a 12 MiB transfer, {kills} "
        f"times; load before: {load}"
    )
    print()
    print("| what | median ms | min ms | max ms |")
    print("|---|---|---|---|")
    for role, samples in detect.items():
        print(
            f"| SIGKILL to PeerLostError on the {role} | {statistics.median(samples) * 1e3:.1f} | "
            f"{min(samples) * 1e3:.1f} | {max(samples) * 1e3:.1f} |"
        )
    print(
        f"| re-form (connect of the next generation) | {statistics.median(reform) * 1e3:.1f} | {min(reform) * 1e3:.1f} "
        f"| {max(reform) * 1e3:.1f} |"
    )
    print(f"\nload after: {os.getloadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--kills", type=int, default=11)
    parser.add_argument("--only", choices=("sync", "loss"))
    parser.add_argument(
        "--threads", type=int, default=0, help="torch's intra-op threads per rank in sync (0: torch's default)"
    )
    args = parser.parse_args()
    if args.only != "loss":
        sync(args.rounds, args.threads)
    if args.only != "sync":
        if args.only is None:
            print()
        loss(args.kills)


if __name__ == "__main__":
    main()
