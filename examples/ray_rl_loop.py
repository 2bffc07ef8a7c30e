"""An RL loop on a local Ray instance: 2 trainer actors and 2 rollout actors in one gloo world, weights synced every
step.

The world is built the way RLightning's ``DistributedMixin`` builds it: the driver picks the rank of every actor and one
master address and port, and each actor sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` in its own environment, then calls ``initialize_distributed_env(...,
dist_url="env://")``. Groups are built the way its ``PolicyGroup`` builds them: one ``init_group`` call per group, each
call sent to every actor at once (``INTRA_NODE`` for the node, one ``WEIGHT_TRANSFER`` group per trainer and its
rollout, ``TRAIN_DATA_PARALLEL`` for the trainers).

Each step the trainers average their gradients over ``TRAIN_DATA_PARALLEL``, reduce their metrics with
``all_reduce_dict`` and send their weights to their rollout with ``broadcast_state_dict``. Rollout 0 is a plain actor;
rollout 1 is a threaded actor (``max_concurrency`` > 1, as RLightning's async rollouts are) that receives in its own
weight-updater thread. The script prints each step's sync time and bytes, and exits 1 if any rollout's weights differ
from its trainer's (or the trainers' from each other).

Everything stays on loopback: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before ``ray.init`` keeps a local Ray instance on
127.0.0.1, and gloo is pinned to ``lo`` in the actors. Needs the ``ray`` extra (``pip install ".[ray]"``); from the
repository root (``--steps N``
sets the number of steps, 5 by default)::

    python examples/ray_rl_loop.py
"""

from __future__ import annotations

import argparse
import hashlib
import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINERS = 2
ROLLOUTS = 2
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


class Worker:
    """What every actor does: join the world and the groups as RLightning's mixins do."""

    def init_distributed_env(
        self, rank: int, world_size: int, local_rank: int, local_world_size: int, master_addr: str, master_port: int
    ) -> None:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(local_world_size),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            GLOO_SOCKET_IFNAME="lo",  # gloo on loopback only
        )
        from rlightning_comm import initialize_distributed_env

        initialize_distributed_env(rank, world_size, backend="gloo", dist_url="env://", timeout=120)
        self.rank = rank
        # The trainers start equal (data parallel); each rollout starts different: only the sync makes it equal to its
        # trainer.
        self.model = _model(0 if rank < TRAINERS else 1000 + rank)

    def init_group(self, ranks: list[int], mode: str) -> None:
        from rlightning_comm import CommContext

        CommContext().init_group(ranks, mode, backend="gloo")

    def digest(self) -> str:
        return _digest(self.model)

    def shutdown(self) -> None:
        from rlightning_comm import CommContext

        CommContext().destroy()


class Trainer(Worker):
    def train_step(self, step: int) -> dict:
        import torch
        from torch.distributed import ReduceOp

        from rlightning_comm import CommContext, ParallelMode, broadcast_state_dict, collective

        # A made-up policy-gradient-like loss on this trainer's own batch.
        gen = torch.Generator().manual_seed(1000 * step + self.rank)
        obs, target = torch.randn(32, 64, generator=gen), torch.randn(32, 8, generator=gen)
        loss = torch.nn.functional.mse_loss(self.model(obs), target)
        self.model.zero_grad()
        loss.backward()
        grads = [p.grad for p in self.model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        collective.all_reduce(flat, ParallelMode.TRAIN_DATA_PARALLEL, op=ReduceOp.AVG)  # data-parallel gradient average
        offset = 0
        with torch.no_grad():
            for p, g in zip(self.model.parameters(), grads):
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
                p.add_(g, alpha=-0.05)
        metrics = collective.all_reduce_dict(
            {"loss": loss.item(), "grad_norm": flat.norm().item()}, ParallelMode.TRAIN_DATA_PARALLEL, op=ReduceOp.AVG
        )
        sender = CommContext().get_ranks_in_group(ParallelMode.WEIGHT_TRANSFER)[
            0
        ]  # the trainer, as RLightning takes it
        t0 = time.perf_counter()
        broadcast_state_dict(self.model, ParallelMode.WEIGHT_TRANSFER, src=sender)
        sync = time.perf_counter() - t0
        nbytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        return {"rank": self.rank, "metrics": metrics, "sync_s": sync, "bytes": nbytes}


class Rollout(Worker):
    def receive_weights(self) -> None:
        from rlightning_comm import CommContext, ParallelMode, broadcast_state_dict

        broadcast_state_dict(
            self.model,
            ParallelMode.WEIGHT_TRANSFER,
            src=CommContext().get_ranks_in_group(ParallelMode.WEIGHT_TRANSFER)[0],
        )


class ThreadedRollout(Rollout):
    """A rollout whose method calls run on a pool of threads, with a weight-updater thread that does the receiving."""

    def start_updater(self) -> str:
        self._requests: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._updater = threading.Thread(target=self._update_loop, name="weight-updater", daemon=True)
        self._updater.start()
        return self._updater.name

    def _update_loop(self) -> None:
        while self._requests.get() is not None:
            try:
                self.receive_weights()
                self._done.put(None)
            except BaseException as err:  # noqa: BLE001 - handed back to the caller of update_weights
                self._done.put(err)

    def update_weights(self) -> None:
        self._requests.put("update")
        err = self._done.get(timeout=120)
        if err is not None:
            raise err

    def shutdown(self) -> None:
        self._requests.put(None)
        self._updater.join(timeout=10)
        super().shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(steps: int) -> int:
    """Build the world, run ``steps`` steps; returns the exit status (1 when weights differ)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = (
        "0"  # before ray.init: a local instance binds and talks on 127.0.0.1 only
    )
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )  # the actors import this checkout
    import ray

    ray.init(address="local", num_cpus=TRAINERS + ROLLOUTS, include_dashboard=False, log_to_driver=True)
    try:
        trainers = [ray.remote(num_cpus=1)(Trainer).remote() for _ in range(TRAINERS)]
        rollouts = [
            ray.remote(num_cpus=1)(Rollout).remote(),
            ray.remote(num_cpus=1, max_concurrency=4)(ThreadedRollout).remote(),
        ]
        actors = trainers + rollouts  # global ranks: trainers 0..1, rollouts 2..3
        world, port = len(actors), _free_port()
        ray.get([a.init_distributed_env.remote(r, world, r, world, "127.0.0.1", port) for r, a in enumerate(actors)])
        # One call per group, sent to every actor at once (torch needs every rank in every new_group).
        groups = [(list(range(world)), "INTRA_NODE")]
        groups += [([t, TRAINERS + t], "WEIGHT_TRANSFER") for t in range(TRAINERS)]  # [sender] + receivers
        groups += [(list(range(TRAINERS)), "TRAIN_DATA_PARALLEL")]
        for ranks, mode in groups:
            ray.get([a.init_group.remote(ranks, mode) for a in actors])
        updater = ray.get(rollouts[1].start_updater.remote())
        print(
            f"world of {world} actors: trainers {list(range(TRAINERS))}, rollouts {list(range(TRAINERS, world))} (rank "
            f"3 receives in thread {updater!r})"
        )
        for step in range(steps):
            done = [t.train_step.remote(step) for t in trainers] + [
                rollouts[0].receive_weights.remote(),
                rollouts[1].update_weights.remote(),
            ]
            results = ray.get(done, timeout=120)
            sync = max(r["sync_s"] for r in results[:TRAINERS])
            print(
                f"step {step}: loss {results[0]['metrics']['loss']:.4f}, weight sync {sync * 1e3:.1f} ms for "
                f"{results[0]['bytes'] / 2**20:.2f} MiB per trainer to its rollout ({TRAINERS} trainers)"
            )
        digests = ray.get([a.digest.remote() for a in actors])
        ray.get([a.shutdown.remote() for a in actors])
    finally:
        ray.shutdown()
    differ = [TRAINERS + t for t in range(TRAINERS) if digests[TRAINERS + t] != digests[t]]
    if len(set(digests[:TRAINERS])) != 1:
        print("the trainers' weights differ from each other", file=sys.stderr)
        return 1
    if differ:
        print(f"rollouts {differ} hold weights that differ from their trainer's", file=sys.stderr)
        return 1
    print(f"every rollout holds its trainer's weights, bit for bit (sha256 {digests[0][:16]}...)")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    sys.exit(run(parser.parse_args().steps))


if __name__ == "__main__":
    main()
