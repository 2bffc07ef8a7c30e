"""The long run of a connected mode: many generations of kill-and-replace, each with a sync, on 3 processes.

Run as a program (``python -X dev tests/connect_long_run.py GENERATIONS``) by ``tests/test_connect_long_run.py``: its
members are forked from a fork server that inherits the interpreter's flags, so they run in development mode too, and
their stderr is this program's. It prints one JSON line: what the two long-lived members (the trainer, rank 0, and
engine 1) measured of themselves after every generation (open file descriptors, native threads, RSS), after
``destroy()``, and how a member ends on an uncaught ``PeerLostError``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback

MODE = "WEIGHT_SYNC"
BUCKET = 2 * 2**20  # two staging buffers of 2 MiB per generation and process: what a leak would keep
TIMEOUT = 60  # every wait of the members; a death reaches them in milliseconds


def _model(seed: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    # 4 MiB in pieces of 16 KiB: they travel coalesced, through the staging buffers
    return {f"w{i}": torch.randn(4096, generator=gen) for i in range(256)}


def _digest(state: dict) -> str:
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def _usage() -> tuple[int, int, int]:
    """This process's open file descriptors, native threads and resident memory (bytes)."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")), rss, len(gc.get_objects())


def _member(role: str, rank: int, address: str, generations: int, out) -> None:
    try:
        import torch

        from rlightning_comm import CommContext, PeerLostError, broadcast_state_dict
        from rlightning_comm.communicators.base import Communicator

        ctx = CommContext()
        before = _usage()
        if role == "trainer":
            address = ctx.listen("127.0.0.1:0")
            out.send(("address", address))
        for g in range(generations):
            comm = ctx.connect(MODE, rank=rank, world_size=3, address=address, timeout=TIMEOUT)
            state = _model(g) if rank == 0 else {k: torch.zeros_like(v) for k, v in _model(0).items()}
            broadcast_state_dict(state, MODE, src=0, bucket_bytes=BUCKET)
            out.send(("synced", role, g, ctx.get_generation(MODE), _digest(state)))
            if role == "engine2":  # the replacement of this generation: killed on the next sync's first bucket

                def load(named_tensors) -> None:
                    os.kill(os.getpid(), signal.SIGKILL)

                broadcast_state_dict(load, MODE, src=0, bucket_bytes=BUCKET)
                return
            try:
                broadcast_state_dict(state, MODE, src=0, bucket_bytes=BUCKET)  # fails midway on the trainer
                comm.barrier()  # engine 2 never calls it
                raise AssertionError("the barrier returned with engine 2 dead")
            except PeerLostError as err:
                lost = (err.generation, err.member)
            del comm, state
            out.send(("lost", role, g, lost, _usage()))
        ctx.destroy()
        gc.collect()
        alive = sum(isinstance(o, Communicator) for o in gc.get_objects())
        out.send(("destroyed", role, before, _usage(), alive))
        if role == "trainer":
            time.sleep(TIMEOUT)  # killed by the driver
            return
        # Engine 1: one more generation, whose host is killed; the PeerLostError is not caught.
        comm = ctx.connect(MODE, rank=rank, world_size=2, address=out_address(out), timeout=TIMEOUT)
        out.send(("ready", role))
        comm.barrier()
    except PeerLostError:
        raise  # the uncaught end, on purpose: its traceback goes to stderr
    except BaseException:  # noqa: BLE001 - every failure goes back to the driver
        out.send(("failed", role, traceback.format_exc()))


def out_address(out) -> str:
    out.send(("need-address",))
    return out.recv()


def _last_host(address_pipe) -> None:
    """Rank 0 of the final generation: hosts it, then is killed."""
    from rlightning_comm import CommContext

    ctx = CommContext()
    address_pipe.send(ctx.listen("127.0.0.1:0"))
    ctx.connect(MODE, rank=0, world_size=2, address=address_pipe.recv(), timeout=TIMEOUT)
    address_pipe.send("connected")
    time.sleep(TIMEOUT)


def main(generations: int) -> None:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "rlightning_comm"])
    readers, procs = {}, {}

    def start(role, *args, target=_member, duplex=False):
        reader, writer = ctx.Pipe(duplex=duplex)
        p = ctx.Process(target=target, args=(role, *args, writer) if target is _member else (writer,), daemon=True)
        p.start()
        if not duplex:
            writer.close()
        readers[role], procs[role] = reader, p
        return reader

    def next_message(role, kind, timeout=TIMEOUT):
        reader = readers[role]
        if not reader.poll(timeout):
            raise TimeoutError(f"no {kind!r} from {role} within {timeout} s")
        message = reader.recv()
        if message[0] == "failed":
            raise RuntimeError(f"{role} failed:\n{message[2]}")
        if message[0] != kind:
            raise RuntimeError(f"expected {kind!r} from {role}, got {message}")
        return message

    report = {"generations": [], "destroyed": {}}
    t0 = time.monotonic()
    try:
        start("trainer", 0, "", generations)
        _, address = next_message("trainer", "address")
        start("engine1", 1, address, generations, duplex=True)
        for _ in range(generations):
            start("engine2", 2, address, 1)
            synced = [next_message(role, "synced") for role in ("trainer", "engine1", "engine2")]
            procs["engine2"].join(TIMEOUT)  # it kills itself during the next sync
            lost = [next_message(role, "lost") for role in ("trainer", "engine1")]
            report["generations"].append(
                {
                    "generation": [m[3] for m in synced],
                    "digests": len({m[4] for m in synced}),
                    "lost": [m[3] for m in lost],
                    "usage": {m[1]: m[4] for m in lost},
                }
            )
        for role in ("trainer", "engine1"):
            _, _, before, after, alive = next_message(role, "destroyed")
            report["destroyed"][role] = {"before": before, "after": after, "communicators": alive}
        os.kill(procs["trainer"].pid, signal.SIGKILL)
        # The final generation: a fresh host, engine 1, the host killed, engine 1's PeerLostError uncaught.
        host = ctx.Pipe()
        last = ctx.Process(target=_last_host, args=(host[1],), daemon=True)
        last.start()
        host_address = host[0].recv() if host[0].poll(TIMEOUT) else None
        next_message("engine1", "need-address")
        readers["engine1"].send(host_address)
        host[0].send(host_address)
        next_message("engine1", "ready")
        if not host[0].poll(TIMEOUT):
            raise TimeoutError("the final host did not connect")
        os.kill(last.pid, signal.SIGKILL)
        procs["engine1"].join(TIMEOUT)
        report["uncaught_exitcode"] = procs["engine1"].exitcode
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
    report["seconds"] = time.monotonic() - t0
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
