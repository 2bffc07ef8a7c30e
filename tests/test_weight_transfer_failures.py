"""broadcast_state_dict failing midway: every member's error says what it left (partly written tensors, buckets loaded,
partial destinations)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch
from world import init_world

GROUP_TIMEOUT = 2.0
BOUND = 6.0  # what a loaded 2-core machine may add on top of the group timeout
KILL_TIMEOUT = 30.0  # the killed-destination test's group timeout: its members must raise long before it
TENSORS, ELEMENTS, BUCKET = 24, 512, 4096  # 24 tensors of 2 KiB in buckets of 4 KiB: 12 staged units


def _state(rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    # Two tensors a layer: a load callable gets whole layers, one bucket each.
    return {f"layers.{i // 2}.w{i % 2}": torch.randn(ELEMENTS, generator=gen) for i in range(TENSORS)}


def _outcome(run) -> dict:
    start = time.monotonic()
    try:
        run()
    except RuntimeError as err:
        return {"type": type(err).__name__, "msg": str(err), "elapsed": time.monotonic() - start}
    return {"type": None, "elapsed": time.monotonic() - start}


def _injected(rank: int, size: int, url: str) -> dict:
    from rlightning_comm import CommError, broadcast_state_dict
    from rlightning_comm.weights.broadcast._pipeline import Pipeline

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], "FAULT", timeout=GROUP_TIMEOUT)
    state = _state(rank)
    if rank == 3:  # the third unit to arrive here fails once its data is in: the connection "broke"
        original, moved = Pipeline._move, []

        class Broken:
            def __init__(self, work) -> None:
                self._work = work

            def wait(self) -> None:
                self._work.wait()
                raise CommError("injected: the connection to the source broke")

        def move(self, data):
            moved.append(1)
            works = original(self, data)
            return [Broken(w) for w in works] if len(moved) == 3 else works

        Pipeline._move = move
    try:
        loaded = []
        arg = (lambda named: loaded.extend(n for n, _ in named)) if rank == 2 else state
        return _outcome(lambda: broadcast_state_dict(arg, "FAULT", src=0, bucket_bytes=BUCKET, fanout="star"))
    finally:
        if rank == 3:
            Pipeline._move = original  # the world's processes outlive this test


# What a destination says it holds after a failure midway: some units arrived, or none had completed while receives were
# posted straight into its tensors.
PARTLY_WRITTEN = (
    r"this destination's tensors were partly written \([1-9]\d* of 12 units had arrived\)"
    r"|this destination's tensors may be partly written: receives were posted straight into them, and none of the 12 "
    r"units had completed"
)


def test_a_failure_midway_says_what_each_member_holds(world4) -> None:
    source, in_place, loader, faulty = world4.run(_injected, timeout=60)
    assert faulty["type"] == "CommError" and "injected: the connection to the source broke" in faulty["msg"], faulty
    units = re.search(
        r"this destination's tensors were partly written \((\d+) of (\d+) units had arrived\)", faulty["msg"]
    )
    assert units and int(units[1]) == 2 and int(units[2]) == TENSORS // 2, faulty["msg"]
    # The source waits for the faulty destination, which stopped receiving; the others wait for the source: all fail in
    # bounded time.
    for r in (source, in_place, loader):
        assert r["type"] in ("CommError", "CommTimeoutError") and r["elapsed"] <= GROUP_TIMEOUT + BOUND, r
        assert "broadcast_state_dict failed midway: " in r["msg"], r
    assert re.search(
        r"the source had launched \d+ of 12 units: destinations at ranks \[1, 2, 3\] may hold partial weights",
        source["msg"],
    ), source
    assert "the transfer to rank 3 failed" in source["msg"], source
    assert re.search(PARTLY_WRITTEN, in_place["msg"]), in_place
    given = re.search(r"load had been given (\d+) of 12 buckets", loader["msg"])
    assert given and 0 < int(given[1]) < 12, loader


def _sync_group(rank: int, url: str):
    """A 3-member gloo group outside any world (a file store of its own): the trainer, the engine that dies, a survivor.

    The members first meet in the store (the engine process may still be starting torch), then build the group with the
    timeout the transfer runs under (long: nobody may wait it out).
    """
    import torch.distributed as dist

    from rlightning_comm import GlooCommunicator

    store = dist.FileStore(url.removeprefix("file://") + ".sync", 3)
    store.set(f"ready/{rank}", "1")
    store.wait([f"ready/{r}" for r in range(3)], timedelta(seconds=120))
    group = dist.ProcessGroupGloo(dist.PrefixStore("group", store), rank, 3, timedelta(seconds=KILL_TIMEOUT))
    return GlooCommunicator(
        group, range(3), "SYNC", timeout=KILL_TIMEOUT, rank=rank
    )  # rank: in the group's own numbering


def _victim(url: str) -> None:
    """The engine process (group rank 1, in no world): it dies on its second bucket, the transfer in flight."""
    from rlightning_comm.weights.broadcast._call import transfer

    calls = []

    def load(named) -> None:
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    transfer(_sync_group(1, url), load, 0, BUCKET, False)


def _killed(rank: int, size: int, url: str) -> dict:
    from rlightning_comm.weights.broadcast._call import transfer

    victim = None
    if rank == 0:  # its own process, started here (a world's process cannot die without the world being respawned)
        code = f"import sys; sys.path[:0] = {sys.path!r}; import test_weight_transfer_failures as t; t._victim({url!r})"
        victim = subprocess.Popen([sys.executable, "-c", code])
    try:
        comm = _sync_group(0 if rank == 0 else 2, url)
        report = _outcome(lambda: transfer(comm, _state(rank), 0, BUCKET, False))
    finally:
        if victim is not None:
            try:
                victim.wait(timeout=30)
            except subprocess.TimeoutExpired:
                victim.kill()  # by its pid: ours
                victim.wait(timeout=10)
    if victim is not None:
        report["victim"] = victim.returncode
    return report


def test_a_destination_killed_midway_its_peers_raise_saying_so(world2) -> None:
    source, survivor = world2.run(_killed, timeout=120)
    assert source["victim"] == -signal.SIGKILL, source
    # The source learns at once (the receipts); the surviving destination too (the source closes the group), never at
    # the group's timeout, which a receive from a live source that stopped sending would otherwise wait out.
    for r in (source, survivor):
        assert r["type"] == "CommError" and r["elapsed"] <= BOUND < KILL_TIMEOUT, r
    assert re.search(r"destinations at ranks \[1, 2\] may hold partial weights", source["msg"]), source
    assert re.search(PARTLY_WRITTEN, survivor["msg"]), survivor
