"""A trainer world and an engine world on a local Ray instance, weights synced over a connected mode; an engine dies and
comes back.

Two worlds, as in RL post-training with an inference engine of its own:

* the trainer world: 2 trainer actors (their own gloo world), which average their gradients over it every step;
* the engine world: 2 engine actors (another gloo world, like an engine's tensor-parallel group), which all-reduce over
  it every step.

A connected mode, ``WEIGHT_SYNC``, joins trainer rank 0 (its member 0, which hosts the mode's store) and both engines
(members 1 and 2): every step the trainer sends its weights to both engines with ``broadcast_state_dict``.

Mid-run, engine 1 is killed while a sync is in flight (``ray.kill(actor, no_restart=False)``). The trainer's and engine
0's sync raise ``PeerLostError`` within milliseconds, naming member 2. Ray restarts the actor (``max_restarts=1``); the
engine world is re-formed with it, the connected mode is re-formed by every member calling ``connect`` again (generation
1), and the next sync is bit-identical. The trainer world is never touched. The script exits 1 if any engine's weights
differ from the trainer's after a sync, or if the trainer world restarted.

Everything stays on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before ``ray.init``, every address ``127.0.0.1``,
gloo pinned to ``lo``) and every wait is bounded. Needs the ``ray`` extra (``pip install ".[ray]"``); from the
repository root (``--steps N`` sets the number of steps, 4 by default, and
``--kill-step K`` the step whose sync engine 1 dies in, 2 by default)::

    python examples/ray_engine_sync.py
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODE = "WEIGHT_SYNC"
BOUND = 60  # seconds: the longest any step of the driver waits for its actors
HIDDEN = 256


def _model(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 8))


def _digest(model) -> str:
    import torch

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Member:
    """What trainers and engines share: a world of their own, the connected mode, the sync."""

    def __init__(self, seed: int) -> None:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo on loopback only
        self.model = _model(seed)

    def pid(self) -> int:
        return os.getpid()

    def init_world(self, rank: int, world_size: int, port: int) -> None:
        from rlightning_comm import CommContext

        CommContext().init_distributed_env(
            world_size=world_size, rank=rank, backend="gloo", dist_url=f"tcp://127.0.0.1:{port}", timeout=60
        )

    def connect(self, member: int, address: str) -> int:
        """Join the connected mode as ``member``; returns the generation formed."""
        from rlightning_comm import CommContext

        ctx = CommContext()
        ctx.connect(MODE, rank=member, world_size=3, address=address, timeout=30)
        return ctx.get_generation(MODE)

    def sync(self, delay: float = 0.0) -> dict:
        """Send (member 0) or receive the weights; a lost member is reported, not raised."""
        from rlightning_comm import PeerLostError, broadcast_state_dict

        time.sleep(delay)
        t0 = time.perf_counter()
        try:
            broadcast_state_dict(self.model, MODE, src=0)
        except PeerLostError as err:
            return {
                "lost": True,
                "at": time.time(),
                "member": err.member,
                "generation": err.generation,
                "error": str(err),
            }
        return {"lost": False, "ms": (time.perf_counter() - t0) * 1e3, "digest": _digest(self.model)}

    def leave(self) -> None:
        from rlightning_comm import CommContext

        CommContext().destroy()


class Trainer(Member):
    def listen(self) -> str:
        from rlightning_comm import CommContext

        return CommContext().listen("127.0.0.1:0")

    def train_step(self, step: int) -> float:
        """A made-up loss on this trainer's own batch; gradients averaged over the trainer world."""
        import torch
        from torch.distributed import ReduceOp

        from rlightning_comm import CommContext, CommMode, collective

        gen = torch.Generator().manual_seed(1000 * step + CommContext().get_global_rank())
        obs, target = torch.randn(32, 64, generator=gen), torch.randn(32, 8, generator=gen)
        loss = torch.nn.functional.mse_loss(self.model(obs), target)
        self.model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in self.model.parameters():
                collective.all_reduce(p.grad, CommMode.GLOBAL, op=ReduceOp.AVG)
                p.add_(p.grad, alpha=-0.05)
        return loss.item()


class Engine(Member):
    def rollout_step(self, step: int) -> float:
        """The engine world's own collective of every step (an all-reduce over its tensor-parallel group)."""
        import torch

        from rlightning_comm import CommMode, collective

        t = torch.full((4,), float(step))
        collective.all_reduce(t, CommMode.GLOBAL)
        return t[0].item()


def _when_restarted(ray, actor) -> int:
    """The pid of ``actor`` once Ray has restarted it (calls made while it restarts are refused)."""
    deadline = time.monotonic() + BOUND
    while True:
        try:
            return ray.get(actor.pid.remote(), timeout=BOUND)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def run(steps: int, kill_step: int) -> int:
    """Run ``steps`` steps, killing engine 1 during the sync of ``kill_step``; returns the exit status."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = (
        "0"  # before ray.init: a local instance binds and talks on 127.0.0.1 only
    )
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )  # the actors import this checkout
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True)
    try:
        trainers = [ray.remote(num_cpus=1)(Trainer).remote(0) for _ in range(2)]
        engines = [ray.remote(num_cpus=1, max_restarts=1)(Engine).remote(100 + i) for i in range(2)]
        trainer_pids = ray.get([t.pid.remote() for t in trainers], timeout=BOUND)
        port_a, port_b = _free_port(), _free_port()
        ray.get(
            [t.init_world.remote(r, 2, port_a) for r, t in enumerate(trainers)]
            + [e.init_world.remote(r, 2, port_b) for r, e in enumerate(engines)],
            timeout=BOUND,
        )
        address = ray.get(trainers[0].listen.remote(), timeout=BOUND)
        members = [trainers[0], *engines]
        generation = ray.get([m.connect.remote(i, address) for i, m in enumerate(members)], timeout=BOUND)[0]
        print(
            f"trainer world: 2 actors; engine world: 2 actors; {MODE} at {address}: trainer 0 and both engines "
            f"(generation {generation})"
        )
        failed = False
        for step in range(steps):
            losses = ray.get(
                [t.train_step.remote(step) for t in trainers] + [e.rollout_step.remote(step) for e in engines],
                timeout=BOUND,
            )
            if step == kill_step:
                victim = ray.get(engines[1].pid.remote(), timeout=BOUND)
                # Engine 1 enters the sync late, so the trainer and engine 0 are inside theirs when it dies.
                calls = [trainers[0].sync.remote(), engines[0].sync.remote(), engines[1].sync.remote(delay=0.5)]
                time.sleep(0.2)
                ray.kill(engines[1], no_restart=False)
                killed = time.time()
                survivors = ray.get(calls[:2], timeout=BOUND)
                if not all(r["lost"] and r["member"] == 2 for r in survivors):
                    print(f"step {step}: the survivors did not see member 2 lost: {survivors}", file=sys.stderr)
                    return 1
                print(
                    f"step {step}: engine 1 (pid {victim}) killed during the sync; PeerLostError on the trainer "
                    f"{(survivors[0]['at'] - killed) * 1e3:.0f} ms and on engine 0 "
                    f"{(survivors[1]['at'] - killed) * 1e3:.0f} ms after the kill, "
                    f"naming member 2 of generation {survivors[0]['generation']}"
                )
                t0 = time.perf_counter()
                restarted = _when_restarted(ray, engines[1])
                print(f"step {step}: Ray restarted engine 1 as pid {restarted} in {time.perf_counter() - t0:.1f} s")
                t0 = time.perf_counter()
                ray.get(
                    engines[0].leave.remote(), timeout=BOUND
                )  # the engine world lost a member: its survivor leaves it...
                port_b = _free_port()
                ray.get(
                    [e.init_world.remote(r, 2, port_b) for r, e in enumerate(engines)], timeout=BOUND
                )  # ...and forms it again
                generation = ray.get([m.connect.remote(i, address) for i, m in enumerate(members)], timeout=BOUND)[0]
                print(
                    f"step {step}: engine world and {MODE} re-formed (generation {generation}) in "
                    f"{(time.perf_counter() - t0) * 1e3:.0f} ms"
                )
            results = ray.get([m.sync.remote() for m in members], timeout=BOUND)
            digests = {r.get("digest") for r in results}
            same = len(digests) == 1 and None not in digests
            failed |= not same
            print(
                f"step {step}: trainer loss {losses[0]:.4f}, engine all-reduce {losses[2]:.0f}, weight sync "
                f"{results[0]['ms']:.1f} ms, "
                f"engines {'bit-identical to' if same else 'DIFFER from'} the trainer"
            )
        pids = ray.get([t.pid.remote() for t in trainers], timeout=BOUND)
        ray.get([m.leave.remote() for m in [*trainers, *engines]], timeout=BOUND)
    finally:
        ray.shutdown()
    if pids != trainer_pids:
        print(f"the trainer world restarted: pids {trainer_pids} -> {pids}", file=sys.stderr)
        return 1
    if failed:
        print("an engine's weights differ from the trainer's after a sync", file=sys.stderr)
        return 1
    print("every sync left both engines bit-identical to the trainer; the trainer world never restarted")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--kill-step", type=int, default=2)
    args = parser.parse_args()
    sys.exit(run(args.steps, args.kill_step))


if __name__ == "__main__":
    main()
