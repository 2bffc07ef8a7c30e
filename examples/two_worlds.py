"""Two worlds joined by a connected mode, with plain processes and no Ray: an engine is killed and the mode re-formed.

* The trainer world: 2 processes in a gloo world of their own, which all-reduce over it every step.
* The engines: 2 processes, each in no world at all (an inference engine that runs alone, or in a world of its own, is
  the same to the mode).

A connected mode, ``WEIGHT_SYNC``, joins trainer rank 0 (member 0, which hosts the mode's store) and both engines
(members 1 and 2); every step the trainer sends its weights to both engines with ``broadcast_state_dict``.

How the address reaches the other world: trainer rank 0 calls ``listen()``, which returns ``"127.0.0.1:PORT/SECRET"``,
and writes it to a file that only this user can read; each engine reads it and passes it to ``connect`` as it is. The
file stands for whatever your launcher shares (a key-value store, an environment variable, a Ray object): the string
carries the mode's secret, so share it only with the members.

After the first sync engine 2 hangs (alive, but it never calls again), and this script, the supervisor, SIGKILLs it. The
trainer's and engine 1's sync in flight raises ``PeerLostError`` naming member 2; the supervisor starts a replacement;
every member calls ``connect`` again, which forms generation 1, and the next sync is bit-identical. The trainer world is
never touched. A launcher that ends every process when one dies (torchrun without restarts, ``rlightning_comm.run``)
cannot do this: start the engines as processes of their own, as here. The script exits 1 if an engine's weights differ
from the trainer's after a sync.

From the repository root (``--steps N``, 3 by default)::

    python examples/two_worlds.py
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time

MODE = "WEIGHT_SYNC"
BOUND = 60  # seconds: the longest any wait of this script or of its processes lasts


def _weights(step: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(step)
    return {"embed": torch.randn(512, 64, generator=gen), **{f"layer{i}": torch.randn(64, 64) for i in range(4)}}


def _digest(state: dict) -> str:
    h = hashlib.sha256()
    for name, tensor in state.items():
        h.update(name.encode() + tensor.numpy().tobytes())
    return h.hexdigest()[:12]


def _publish(path: str, address: str) -> None:
    """Write the address (with its secret) where only this user can read it, atomically."""
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(address)
    os.replace(path + ".tmp", path)


def _read(path: str) -> str:
    deadline = time.monotonic() + BOUND
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no address at {path} after {BOUND} s")
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


def trainer(rank: int, folder: str, steps: int, report) -> None:
    """A trainer rank: its own world with the other trainer; rank 0 is also member 0 of the connected mode."""
    import torch

    from rlightning_comm import CommContext, CommMode, PeerLostError, broadcast_state_dict, collective

    ctx = CommContext()
    ctx.init_distributed_env(
        world_size=2, rank=rank, dist_url=f"file://{folder}/trainer-world", backend="gloo", timeout=BOUND
    )
    if rank == 0:
        address = ctx.listen("127.0.0.1:0")
        _publish(os.path.join(folder, "address"), address)
        ctx.connect(MODE, rank=0, world_size=3, address=address, timeout=BOUND)
    for step in range(steps):
        grad = torch.full((4,), float(rank + 1))
        collective.all_reduce(grad, CommMode.GLOBAL)  # the trainer world, untouched by what happens to the engines
        if rank != 0:
            continue
        state = _weights(step)
        while True:
            try:
                broadcast_state_dict(state, MODE, src=0)
                break
            except PeerLostError as err:
                report.send(("lost", "trainer", err.member, err.generation))
                ctx.connect(MODE, rank=0, world_size=3, address=address, timeout=BOUND)  # the next generation
                report.send(("re-formed", "trainer", ctx.get_generation(MODE)))
        report.send(("synced", "trainer", step, _digest(state)))
    if rank == 0:
        # Leave together: a member that leaves while another still waits for it is a loss to the others. Whoever returns
        # from the barrier first may leave at once: the others' barrier in flight still completes.
        ctx.get_communicator(MODE).barrier()
    ctx.destroy()


def engine(member: int, first_step: int, folder: str, steps: int, report) -> None:
    """An engine: no world; member ``member`` of the connected mode, from step ``first_step`` on."""
    import torch

    from rlightning_comm import CommContext, PeerLostError, broadcast_state_dict

    ctx = CommContext()
    address = _read(os.path.join(folder, "address"))
    ctx.connect(MODE, rank=member, world_size=3, address=address, timeout=BOUND)
    report.send(("connected", f"engine {member}", os.getpid(), ctx.get_generation(MODE)))
    state = {name: torch.zeros_like(t) for name, t in _weights(0).items()}
    for step in range(first_step, steps):
        while True:
            try:
                broadcast_state_dict(state, MODE, src=0)
                break
            except PeerLostError as err:
                report.send(("lost", f"engine {member}", err.member, err.generation))
                ctx.connect(MODE, rank=member, world_size=3, address=address, timeout=BOUND)
        report.send(("synced", f"engine {member}", step, _digest(state)))
        if member == 2 and first_step == 0:
            report.send(("hung", f"engine {member}"))
            time.sleep(BOUND)  # hangs (alive, answering heartbeats, never calling): the supervisor kills it
    ctx.get_communicator(MODE).barrier()
    ctx.destroy()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    steps = parser.parse_args().steps
    mp_ctx = mp.get_context("forkserver" if sys.platform == "linux" else "spawn")
    if sys.platform == "linux":
        mp_ctx.set_forkserver_preload(["torch", "rlightning_comm"])  # a replacement starts in milliseconds
    folder = tempfile.mkdtemp(prefix="two-worlds-")
    reader, writer = mp_ctx.Pipe(duplex=False)
    procs = {f"trainer {r}": mp_ctx.Process(target=trainer, args=(r, folder, steps, writer)) for r in (0, 1)}
    procs.update({f"engine {m}": mp_ctx.Process(target=engine, args=(m, 0, folder, steps, writer)) for m in (1, 2)})
    for p in procs.values():
        p.start()
    digests: dict[int, dict[str, str]] = {}
    wrong = 0
    try:
        while not all(len(digests.get(s, {})) == 3 for s in range(steps)):
            quiet_since = time.monotonic()
            while not reader.poll(0.5):
                failed = {n: p.exitcode for n, p in procs.items() if p.exitcode}
                if failed or time.monotonic() - quiet_since > BOUND:
                    print(f"stopped: exit codes {failed}; alive: {[n for n, p in procs.items() if p.is_alive()]}")
                    return 1
            kind, who, *rest = reader.recv()
            if kind == "connected":
                print(f"{who} (pid {rest[0]}) connected: generation {rest[1]}")
            elif kind == "lost":
                print(f"{who}: PeerLostError naming member {rest[0]} of generation {rest[1]}")
            elif kind == "re-formed":
                print(f"{who}: re-formed (generation {rest[0]})")
            elif kind == "hung":
                victim = procs["engine 2"]
                os.kill(victim.pid, signal.SIGKILL)
                victim.join(BOUND)
                print(f"engine 2 (pid {victim.pid}) hung after step 0: killed; starting a replacement")
                procs["engine 2"] = mp_ctx.Process(target=engine, args=(2, 1, folder, steps, writer))
                procs["engine 2"].start()
            elif kind == "synced":
                step, digest = rest
                digests.setdefault(step, {})[who] = digest
                if len(digests[step]) == 3:
                    same = len(set(digests[step].values())) == 1
                    wrong += not same
                    print(
                        f"step {step}: engines {'bit-identical to' if same else 'DIFFER from'} the trainer ({digest})"
                    )
        for p in procs.values():
            p.join(BOUND)
        failed = {n: p.exitcode for n, p in procs.items() if p.exitcode != 0}
        print("every process exited cleanly" if not failed else f"exit codes: {failed}")
        return 1 if wrong or failed else 0
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
