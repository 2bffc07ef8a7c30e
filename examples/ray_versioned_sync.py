"""Versioned, all-or-nothing weight syncs to 3 engines on a local Ray instance: an engine dies mid-sync, the others
stay on the previous version, Ray restarts it, a peer seeds it, and the next sync brings all three to the new version.

A connected mode, ``WEIGHT_SYNC``, joins a trainer actor (member 0, which hosts the mode's store) and 3 engine actors
(members 1 to 3). Every step the trainer takes a step of its own and sends its weights as version ``step + 1`` with
``broadcast_state_dict(..., version=v, atomic=True)``: the engines relay them (the trainer sends one model's bytes,
counted from its report), stage them, verify each tensor's digest, and commit them all or none.

At ``--kill-step`` the middle engine (member 2, a relay) is killed while the sync is in flight (it enters it late, so
the others are inside theirs). The trainer and both survivors raise "version v not committed; live weights are version
v-1", and each survivor's live weights hash to version v-1's digests (as the trainer reported them for v-1). Ray
restarts the actor (``max_restarts=1``) as a fresh process with no weights of that version; the mode is re-formed
(generation 1); engine 0 seeds it over a connected mode of the two (``SEED``): it sends version v-1, which it holds,
with ``record_as="WEIGHT_SYNC"``, so the newcomer's record is the fleet's, and the trainer takes no part. Then the
trainer syncs version v again, and all three engines end on it, by digest. The script exits 1 if any check fails.

Everything stays on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before ``ray.init``, every address ``127.0.0.1``)
and every wait is bounded. Needs the ``ray`` extra (``pip install ".[ray]"``); from the repository root (``--steps N``
sets the number of steps, 3 by default, ``--kill-step K`` the step whose sync an engine dies in, 1 by default)::

    python examples/ray_versioned_sync.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODE = "WEIGHT_SYNC"
SEED = "SEED"
BOUND = 60  # seconds: the longest any step of the driver waits for its actors
ENGINES = 3


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))


class Member:
    """The trainer and the engines: a model, the connected mode, the sync."""

    def __init__(self) -> None:
        import torch

        self.model = _model()
        self.sent = 0  # bytes of tensor data this member sent, over every sync (from the reports)
        if not isinstance(self, Trainer):
            with torch.no_grad():
                for p in self.model.parameters():
                    p.zero_()  # an engine starts with no weights of any version

    def pid(self) -> int:
        return os.getpid()

    def connect(self, mode: str, member: int, size: int, address: str) -> int:
        from rlightning_comm import CommContext

        CommContext().connect(mode, rank=member, world_size=size, address=address, timeout=30)
        return CommContext().get_generation(mode)

    def listen(self) -> str:
        from rlightning_comm import CommContext

        return CommContext().listen("127.0.0.1:0")

    def digests(self) -> dict[str, int]:
        """Each live tensor's digest (what a verified sync reports for it), computed here."""
        from rlightning_comm.weights import tensor_digest

        return {name: tensor_digest(t) for name, t in self.model.state_dict().items()}

    def version(self) -> int | None:
        from rlightning_comm import CommContext

        return CommContext().get_weight_version(MODE)

    def sync(self, version: int, delay: float = 0.0) -> dict:
        """Send (the trainer) or receive version ``version``, atomically; a failure is reported, not raised."""
        from rlightning_comm import CommError, broadcast_state_dict

        time.sleep(delay)
        t0 = time.perf_counter()
        try:
            report = broadcast_state_dict(self.model, MODE, src=0, version=version, atomic=True)
        except CommError as err:
            return {"ok": False, "error": str(err).splitlines()[0]}
        self.sent += sum(report.sent.values())
        return {
            "ok": True,
            "ms": (time.perf_counter() - t0) * 1e3,
            "sent": sum(report.sent.values()),
            "digests": report.digests,
        }

    def seed(self, member: int) -> dict:
        """Over ``SEED``: member 0 (an engine) sends the version it holds; member 1 (the newcomer) receives it."""
        from rlightning_comm import CommContext, broadcast_state_dict, collective

        box = [CommContext().get_weight_version(MODE) if member == 0 else None]
        collective.broadcast_object_list(box, SEED, src=0)
        t0 = time.perf_counter()
        report = broadcast_state_dict(self.model, SEED, src=0, version=box[0], record_as=MODE, atomic=True)
        return {"version": box[0], "ms": (time.perf_counter() - t0) * 1e3, "sent": sum(report.sent.values())}

    def bytes_sent(self) -> int:
        return self.sent

    def leave(self) -> None:
        from rlightning_comm import CommContext

        CommContext().destroy()


class Trainer(Member):
    def train_step(self, step: int) -> None:
        """A made-up update: every weight moves."""
        import torch

        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(0.9).add_(0.01 * (step + 1))


class Engine(Member):
    pass


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
    """Run ``steps`` versioned syncs, killing engine 1 (member 2) during the one of ``kill_step``; the exit status."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray.init: a local instance on 127.0.0.1 only
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True)
    try:
        return _steps(ray, steps, kill_step)
    finally:
        ray.shutdown()


def _steps(ray, steps: int, kill_step: int) -> int:
    def get(calls):
        return ray.get(calls, timeout=BOUND)

    trainer = ray.remote(num_cpus=1)(Trainer).remote()
    engines = [ray.remote(num_cpus=1, max_restarts=1)(Engine).remote() for _ in range(ENGINES)]
    members = [trainer, *engines]
    address = get(trainer.listen.remote())
    generation = get([m.connect.remote(MODE, i, len(members), address) for i, m in enumerate(members)])[0]
    print(f"{MODE} at {address}: the trainer and {ENGINES} engines (generation {generation})")
    committed: dict[str, int] | None = None  # the digests of the last version every engine committed
    for step in range(steps):
        version = step + 1
        get(trainer.train_step.remote(step))
        if step == kill_step:
            victim = get(engines[1].pid.remote())
            calls = [m.sync.remote(version) for m in (trainer, engines[0], engines[2])]
            late = engines[1].sync.remote(version, delay=0.5)  # the others are inside their sync when it dies
            time.sleep(0.2)
            ray.kill(engines[1], no_restart=False)
            out = get(calls)
            del late
            if any(r["ok"] for r in out):
                print(f"step {step}: a member committed version {version} though an engine died: {out}")
                return 1
            held = get([engines[0].digests.remote(), engines[2].digests.remote()])
            versions = get([engines[0].version.remote(), engines[2].version.remote()])
            if held != [committed, committed] or versions != [version - 1, version - 1]:
                print(f"step {step}: the survivors are not on version {version - 1}: versions {versions}")
                return 1
            print(
                f"step {step}: engine 1 (pid {victim}) killed during the sync of version {version}; every member "
                f"raised: {out[1]['error'][:90]}...; both survivors hold version {version - 1}, by digest"
            )
            restarted = _when_restarted(ray, engines[1])
            generation = get([m.connect.remote(MODE, i, len(members), address) for i, m in enumerate(members)])[0]
            before = get(trainer.bytes_sent.remote())
            seed_address = get(engines[0].listen.remote())
            get([e.connect.remote(SEED, i, 2, seed_address) for i, e in enumerate(engines[:2])])
            seeded = get([engines[0].seed.remote(0), engines[1].seed.remote(1)])
            newcomer = get([engines[1].digests.remote(), engines[1].version.remote()])
            trainer_bytes = get(trainer.bytes_sent.remote()) - before
            if newcomer != [committed, version - 1] or seeded[0]["sent"] == 0 or trainer_bytes:
                print(f"step {step}: the newcomer is not on version {version - 1} after seeding: {newcomer[1]}")
                return 1
            print(
                f"step {step}: Ray restarted engine 1 as pid {restarted}; {MODE} re-formed (generation {generation}); "
                f"engine 0 seeded it with version {seeded[1]['version']} in {seeded[1]['ms']:.1f} ms, "
                f"{seeded[0]['sent']} bytes, {trainer_bytes} bytes from the trainer; bit-identical to engine 0"
            )
        out = get([m.sync.remote(version) for m in members])
        if not all(r["ok"] for r in out):
            print(f"step {step}: the sync of version {version} failed: {out}")
            return 1
        committed = out[0]["digests"]
        held = get([e.digests.remote() for e in engines])
        versions = get([e.version.remote() for e in engines])
        same = all(h == committed for h in held) and versions == [version] * ENGINES
        print(
            f"step {step}: version {version} committed on every engine in {out[0]['ms']:.1f} ms; trainer sent "
            f"{out[0]['sent']} bytes (one model); engines {'bit-identical to' if same else 'DIFFER from'} the trainer"
        )
        if not same:
            return 1
    get([m.leave.remote() for m in [trainer, *engines]])
    print("every engine holds exactly one committed version, known by number and digest")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--kill-step", type=int, default=1)
    args = parser.parse_args()
    sys.exit(run(args.steps, args.kill_step))


if __name__ == "__main__":
    main()
