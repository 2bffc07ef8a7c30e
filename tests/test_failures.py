"""Fault injection: a rank that skips a collective, a rank killed mid-loop; the survivors get the library's errors in
bounded time."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
import torch.distributed as dist
from world import WorldError, init_world

# Short group timeouts keep the timeout paths to seconds; the bound is what a loaded 2-core machine may add on top of
# the timeout.
GROUP_TIMEOUT = 2.0
BOUND = 4.0
KILL_TIMEOUT = 5.0


def _expect_failure(fn, kind):
    start = time.monotonic()
    try:
        fn()
    except kind as err:
        return {
            "type": type(err).__name__,
            "msg": str(err),
            "cause": type(err.__cause__).__name__,
            "elapsed": time.monotonic() - start,
        }
    return None


def _skip_task(rank, size, url):
    import torch

    from rlightning_comm import CommContext, CommError, CommTimeoutError, broadcast_state_dict, collective

    ctx = init_world(rank, size, url, timeout=30)
    ctx.init_group([0, 1], "SYNC", timeout=GROUP_TIMEOUT)
    ctx.init_group([0, 1], "ASYNC", timeout=GROUP_TIMEOUT)
    # A weight transfer each rank calls alone: the handshake's first hop (to group rank 0, then back) times out.
    ctx.init_group([0, 1], "WEIGHTS_0", timeout=GROUP_TIMEOUT)
    ctx.init_group([0, 1], "WEIGHTS_1", timeout=GROUP_TIMEOUT)
    t = torch.ones(4)
    collective.all_reduce(t, "SYNC")  # both ranks: the group works before the fault
    out = {"before": t.tolist()}
    weights = {"w": torch.full((3,), float(rank))}
    out["weights"] = _expect_failure(lambda: broadcast_state_dict(weights, f"WEIGHTS_{rank}", src=0), CommTimeoutError)
    out["weights_kept"] = weights["w"].tolist()
    if rank == 0:
        # Rank 1 skips both calls and goes on to the GLOBAL barrier below.
        out["sync"] = _expect_failure(lambda: collective.all_reduce(t, "SYNC"), CommTimeoutError)
        out["after"] = _expect_failure(lambda: collective.broadcast(t, "SYNC", src=0), CommError)
        work = CommContext().get_communicator("ASYNC").all_reduce(t, async_op=True)
        out["async"] = _expect_failure(work.wait, CommTimeoutError)
    collective.barrier()
    return out


def test_skipped_collective_raises_timeout_naming_mode_op_and_timeout(world2):
    results = world2.run(_skip_task, timeout=60)
    for rank, result in enumerate(results):  # the source (group rank 0) alone, then the destination alone
        got = result.pop("weights")
        assert got is not None, f"rank {rank}: no CommTimeoutError from broadcast_state_dict"
        assert f"broadcast_state_dict on mode 'WEIGHTS_{rank}' timed out after {GROUP_TIMEOUT:g} s" in got["msg"], got
        assert GROUP_TIMEOUT - 0.1 <= got["elapsed"] <= GROUP_TIMEOUT + BOUND, got
        assert result.pop("weights_kept") == [float(rank)] * 3
    assert results[1] == {"before": [2.0] * 4}
    r0 = results[0]
    assert r0["before"] == [2.0] * 4
    for key, op, mode in (("sync", "all_reduce", "SYNC"), ("async", "all_reduce", "ASYNC")):
        got = r0[key]
        assert got is not None, f"{key}: no CommTimeoutError"
        assert got["type"] == "CommTimeoutError" and got["cause"] == "RuntimeError"
        assert f"{op} on mode {mode!r} timed out after {GROUP_TIMEOUT:g} s" in got["msg"]
        assert GROUP_TIMEOUT - 0.1 <= got["elapsed"] <= GROUP_TIMEOUT + BOUND, got
    # The next call on the broken group fails at once, with the library's error, not gloo's.
    after = r0["after"]
    assert after is not None and after["type"] == "CommError" and "broadcast on mode 'SYNC' failed" in after["msg"]
    assert after["elapsed"] < BOUND


def _kill_task(rank, size, url, victim, out_dir):
    import torch

    from rlightning_comm import CommError, collective

    ctx = init_world(rank, size, url, timeout=KILL_TIMEOUT)
    t = torch.ones(8)
    report = {"iterations": 0}
    for i in range(1000):
        if rank == victim and i == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            collective.all_reduce(t, "GLOBAL")
        except CommError as err:
            report.update(
                error=type(err).__name__,
                msg=str(err),
                elapsed=time.monotonic() - start,
                cause=type(err.__cause__).__name__,
            )
            break
        report["iterations"] = i + 1
    start = time.monotonic()
    ctx.destroy()
    report["destroy_s"] = time.monotonic() - start
    report["initialised_after"] = ctx.is_initialized() or dist.is_initialized()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    return report


def test_rank_killed_mid_loop_survivors_raise_comm_error_and_destroy(world4, tmp_path):
    victim = 3
    with pytest.raises(WorldError) as info:
        world4.run(_kill_task, victim, str(tmp_path), timeout=60)
    text = str(info.value)
    assert re.search(rf"rank {victim}:\s*process died with exit code -{int(signal.SIGKILL)}\b", text), text
    for rank in range(4):
        if rank == victim:
            continue
        assert f"--- rank {rank}: ok" in text, text
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # The victim died before its 6th call: every survivor fails at or before that call, never later.
        assert report["iterations"] <= 5, report
        assert report["error"] in ("CommError", "CommTimeoutError") and report["cause"] == "RuntimeError", report
        assert "all_reduce on mode 'GLOBAL'" in report["msg"], report
        assert report["elapsed"] <= KILL_TIMEOUT + BOUND, report
        assert report["destroy_s"] < BOUND and report["initialised_after"] is False, report


def _local_enforce_task(rank, size, url):
    import torch

    from rlightning_comm import CommContext
    from rlightning_comm.failures import comm_failure

    ctx = init_world(rank, size, url, timeout=30)
    group = ctx.get_communicator("GLOBAL").group
    texts = {}
    # What the backend itself raises for arguments our checks refuse first (one rank, so no peer waits).
    for name, call in (
        ("rows", lambda: dist.all_to_all_single(torch.empty(4, 2), torch.ones(4, 3), group=group)),
        (
            "complex gather",
            lambda: dist.gather(
                torch.ones(2, dtype=torch.complex64), [torch.ones(2, dtype=torch.complex64)], dst=0, group=group
            ),
        ),
    ):
        try:
            call()
        except RuntimeError as err:
            texts[name] = str(comm_failure(err, "GLOBAL", name, 30.0))
    texts["reset"] = str(
        comm_failure(
            RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection reset by peer"), "GLOBAL", "all_reduce", 30.0
        )
    )
    t = torch.ones(2)
    CommContext().get_communicator("GLOBAL").all_reduce(t)  # the group does still work
    return {"texts": texts, "after": t.tolist()}


def test_a_local_backend_refusal_says_the_group_still_works_and_a_broken_group_says_it_is_gone(world1):
    (out,) = world1.run(_local_enforce_task, timeout=60)
    assert out["after"] == [1.0, 1.0]
    for name in ("rows", "complex gather"):
        assert (
            "was refused by the backend's own check on this rank" in out["texts"][name]
            and "the group still works here" in out["texts"][name]
        ), out
    assert "a peer is gone" in out["texts"]["reset"] and "still works" not in out["texts"]["reset"]
