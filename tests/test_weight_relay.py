"""A relay that dies mid-transfer, in a gloo group with no watch (no connected mode): every member fails within seconds.

The group: the source (group rank 0, world rank 0), the victim (group rank 1, a process of its own, first in the chain),
and two engines downstream of it (group ranks 2 and 3, world ranks 1 and 2). The group's timeout is long: nobody may
wait it out.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch
from world import init_world

TIMEOUT = 30.0
BOUND = 8.0  # what a member may take on this loaded 2-core machine, far below the group's timeout
TENSORS, ELEMENTS, BUCKET = 24, 512, 4096
UNITS = 12  # 24 tensors of 2 KiB in buckets of 4 KiB


def _options(version: int):
    from rlightning_comm.weights._versions import SyncOptions

    return SyncOptions(version, False, False, None, None, "RELAY")


def _state(rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return {f"w{i}": torch.randn(ELEMENTS, generator=gen) for i in range(TENSORS)}


def _group(rank: int, url: str):
    import torch.distributed as dist

    from rlightning_comm import GlooCommunicator

    store = dist.FileStore(url.removeprefix("file://") + ".relay", 4)
    store.set(f"ready/{rank}", "1")
    store.wait([f"ready/{r}" for r in range(4)], timedelta(seconds=120))
    group = dist.ProcessGroupGloo(dist.PrefixStore("group", store), rank, 4, timedelta(seconds=TIMEOUT))
    return GlooCommunicator(group, range(4), "RELAY", timeout=TIMEOUT, rank=rank)


def _victim(url: str) -> None:
    """Group rank 1, the first relay: takes version 1 whole, then dies once the third unit of version 2 has arrived,
    before forwarding it."""
    from rlightning_comm.weights import _pipeline
    from rlightning_comm.weights._broadcast import transfer

    original, seen = _pipeline.Pipeline._complete, []

    def complete(self, entry):
        seen.append(1)
        if len(seen) == UNITS + 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, entry)

    _pipeline.Pipeline._complete = complete
    comm = _group(1, url)
    for version in (1, 2):
        transfer(comm, _state(1), 0, BUCKET, False, _options(version), "chain")


def _run(rank: int, size: int, url: str) -> dict:
    from rlightning_comm.weights._broadcast import transfer

    ctx = init_world(rank, size, url)
    if rank == 3:
        return {}
    victim = None
    if rank == 0:
        code = f"import sys; sys.path[:0] = {sys.path!r}; import {__name__} as t; t._victim({url!r})"
        victim = subprocess.Popen([sys.executable, "-c", code])
    start, out = time.monotonic(), {}
    try:
        comm = _group({0: 0, 1: 2, 2: 3}[rank], url)
        transfer(comm, _state(rank), 0, BUCKET, False, _options(1), "chain")
        out = {"before": ctx.get_weight_version("RELAY")}
        start = time.monotonic()
        transfer(comm, _state(rank), 0, BUCKET, False, _options(2), "chain")
        out["type"] = None
    except RuntimeError as err:
        out.update(type=type(err).__name__, msg=str(err))
    finally:
        out_elapsed = time.monotonic() - start
        if victim is not None:
            try:
                victim.wait(timeout=60)
            except subprocess.TimeoutExpired:
                victim.kill()  # by its pid: ours
                victim.wait(timeout=10)
    out["elapsed"], out["after"] = out_elapsed, ctx.get_weight_version("RELAY")
    if victim is not None:
        out["victim"] = victim.returncode
    return out


def test_a_relay_killed_midway_fails_every_member_within_seconds(world4) -> None:
    source, second, third, _ = world4.run(_run, timeout=120)
    assert source["victim"] == -signal.SIGKILL, source
    for r in (source, second, third):
        assert r["type"] in ("CommError", "CommTimeoutError") and r["elapsed"] < BOUND < TIMEOUT, r
        assert "broadcast_state_dict failed midway" in r["msg"], r
    assert "the transfer to rank 1 failed" in source["msg"], source
    for r in (second, third):
        assert "units had arrived" in r["msg"] or "units had completed" in r["msg"], r
        # Partly written, not atomic: the version it held is forgotten (its weights are no one version now).
        assert r["before"] == 1 and r["after"] is None, r
