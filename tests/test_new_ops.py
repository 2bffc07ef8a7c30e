"""reduce, reduce_scatter, all_gather_object, send and recv through ``collective``, against raw torch.distributed.

One task per world runs every case, on 4 gloo ranks: the whole world declared out of order (``[2, 0, 3, 1]``: global
rank 2 is group rank 0) and three ranks with rank 0 outside (``[3, 1, 2]``). The oracle is raw torch.distributed on the
sorted group of the same ranks, with chunks and lists permuted by hand from declared to sorted order. Every root of each
group is tried, so roots other than group rank 0 and global rank 0 are covered.
"""

from __future__ import annotations

from world import init_world

DECLARED = {"ALL": [2, 0, 3, 1], "THREE": [3, 1, 2]}


def _ops_task(rank: int, size: int, url: str) -> dict:
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    from rlightning_comm import CommError, ObjectRefusedError, collective

    ctx = init_world(rank, size, url)
    ctx.enable_stats()
    out: dict = {}
    for mode, declared in DECLARED.items():
        ctx.init_group(declared, mode)
        raw = dist.new_group(sorted(declared))
        if rank not in declared:
            results = [
                collective.reduce(torch.ones(1), mode),
                collective.send(torch.ones(1), mode, 1),
                collective.all_gather_object([None], 1, mode),
            ]
            out[mode] = {"non_member": results}
            continue
        n, order, me = len(declared), sorted(declared), declared.index(rank)
        got: dict = {}

        # reduce to every root, sync and async, SUM / MAX / a ReduceOp instance / complex SUM.
        for dst in declared:
            for op, dtype in (
                (ReduceOp.SUM, torch.float64),
                (ReduceOp.MAX, torch.float64),
                (ReduceOp(ReduceOp.MIN), torch.int64),
                (ReduceOp.SUM, torch.complex128),
            ):
                values = (torch.arange(3, dtype=torch.float64) * (rank + 1) + dst).to(dtype)
                if dtype.is_complex:
                    values = values * (1 + 1j * rank)
                ours, theirs = values.clone(), values.clone()
                work = collective.reduce(ours, mode, dst=dst, op=op, async_op=dst == declared[1])
                if work is not None:
                    work.wait()
                dist.reduce(theirs, dst, op=op, group=raw)
                if rank == dst:
                    got.setdefault("reduce", []).append(torch.equal(ours, theirs))

        # reduce_scatter through the facade: this rank's chunk is the declared order's, raw torch's the sorted order's.
        full = torch.arange(2.0 * n) + 100 * rank
        ours = torch.empty(2)
        collective.reduce_scatter(ours, full, mode)
        sorted_input = torch.cat([full[2 * declared.index(g) : 2 * declared.index(g) + 2] for g in order])
        theirs = torch.empty(2)
        dist.reduce_scatter_tensor(theirs, sorted_input, group=raw)
        got["reduce_scatter"] = torch.equal(ours, theirs)

        # all_gather_object: entry i is declared[i]'s object; raw torch's lists are by global rank.
        obj = {"rank": rank, "tensor": torch.full((2,), float(rank)), "text": "x" * rank}
        ours = [None] * n
        collective.all_gather_object(ours, obj, mode)
        theirs = [None] * n
        dist.all_gather_object(theirs, obj, group=raw)
        got["all_gather_object"] = [o["rank"] for o in ours] == declared and all(
            a["text"] == b["text"] and torch.equal(a["tensor"], b["tensor"])
            for a, b in zip(ours, [theirs[order.index(g)] for g in declared])
        )
        # Safe mode and max_bytes refuse a peer's object, all or none; the group stays usable.
        kept = ["kept"] * n
        sender = declared[-1]
        try:
            collective.all_gather_object(kept, {1, 2} if rank == sender else rank, mode, safe=True)
            got["safe"] = "accepted"
        except ObjectRefusedError as err:
            got["safe"] = ("refused", kept == ["kept"] * n, f"the object of rank {sender}" in str(err))
        try:
            collective.all_gather_object(kept, "y" * 4096 if rank == sender else rank, mode, max_bytes=1024)
            got["max_bytes"] = "accepted"
        except ObjectRefusedError as err:
            got["max_bytes"] = ("refused", f"from rank {sender}" in str(err))

        # send / recv between every ordered pair, blocking (the lower group rank sends first) and async, against raw
        # torch.
        pairs_ok = []
        for i, a in enumerate(declared):
            for b in declared[i + 1 :]:
                for async_op in (False, True):
                    data = torch.arange(4.0) + 10 * a + b
                    if rank in (a, b):
                        peer = b if rank == a else a
                        box, ref = torch.zeros(4), torch.zeros(4)
                        if rank == a:
                            work = collective.send(data, mode, dst=b, async_op=async_op)
                        else:
                            work = collective.recv(box, mode, src=a, async_op=async_op)
                        if work is not None:
                            work.wait()
                        if rank == a:
                            dist.send(data, peer, group=raw)
                        else:
                            dist.recv(ref, peer, group=raw)
                            pairs_ok.append(torch.equal(box, ref) and torch.equal(box, data))
        # Both directions posted before either is waited (a receive first on both sides): the async form allows it.
        peer = declared[(me + 1) % n] if me % 2 == 0 else declared[me - 1]
        if n % 2 == 0 or me < n - 1:
            box = torch.zeros(2)
            works = [
                collective.recv(box, mode, src=peer, async_op=True),
                collective.send(torch.full((2,), float(rank)), mode, dst=peer, async_op=True),
            ]
            for w in works:
                w.wait()
            pairs_ok.append(torch.equal(box, torch.full((2,), float(peer))))
        got["send_recv"] = pairs_ok
        try:
            collective.send(torch.ones(1), mode, dst=rank)
        except ValueError as err:
            got["self_send"] = str(err)
        got["bad_peer"] = []
        for bad in (0 if 0 not in declared else 7, 1.0):
            try:
                collective.recv(torch.ones(1), mode, src=bad)
            except (TypeError, ValueError) as err:
                got["bad_peer"].append(type(err).__name__)
        out[mode] = got

    # Inside torch's coalescing manager on two ranks: both all_reduces in one coalesced call, equal to raw torch.
    from torch.distributed.distributed_c10d import _coalescing_manager

    group = ctx.get_group("ALL")
    a, b = torch.arange(3.0) + rank, torch.arange(3.0) * rank
    ra, rb = a.clone(), b.clone()
    with _coalescing_manager(group):
        collective.all_reduce(a, "ALL")
        collective.all_reduce(b, "ALL")
    dist.all_reduce(ra, group=group)
    dist.all_reduce(rb, group=group)
    out["coalesced"] = torch.equal(a, ra) and torch.equal(b, rb)
    with _coalescing_manager(
        group
    ):  # the refusal is caught inside: torch's manager leaves its state behind on an exception
        try:
            collective.reduce(a, "ALL", dst=2)
        except CommError as err:
            out["coalesced_reduce"] = "torch's _coalescing_manager" in str(err)
    deadline = time.monotonic() + 10
    while True:  # async gloo works without a future are recorded by stats' watcher thread, shortly after they complete
        stats = ctx.stats().get("THREE", {})
        if not any(s["in_flight"] for s in stats.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    out["stats"] = {op: (s["count"], s["bytes"]) for op, s in stats.items() if op in ("reduce", "send", "recv")}
    return out


def _debug_task(rank: int, size: int, url: str) -> dict:
    """Debug mode on send/recv: each pair checks itself; the other ranks take no part."""
    import time

    import torch

    from rlightning_comm import CommMismatchError, CommTimeoutError, collective

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], "P", timeout=30)
    ctx.init_group([0, 1, 2, 3], "Q", timeout=1.5)  # for the skipped call only: what a check waits for a partner
    ctx.set_debug(True)
    out: dict = {}
    if rank in (0, 1):  # ranks 2 and 3 make no call here: a pair's check never waits for them
        peer = 1 - rank
        box = torch.zeros(3)
        if rank == 0:
            collective.send(torch.arange(3.0), "P", dst=1)
        else:
            collective.recv(box, "P", src=0)
        out["ok"] = box.tolist()
        try:  # the receiver expects 4 elements, the sender sends 3
            if rank == 0:
                collective.send(torch.arange(3.0), "P", dst=1)
            else:
                collective.recv(torch.zeros(4), "P", src=0)
        except CommMismatchError as err:
            out["mismatch"] = str(err)
        try:  # rank 1 refuses locally (a non-contiguous tensor): rank 0 learns it before anything is sent
            if rank == 0:
                collective.send(torch.arange(3.0), "P", dst=1)
            else:
                collective.recv(torch.zeros(6)[::2], "P", src=0)
        except ValueError as err:
            out["refused"] = str(err)
        # Both post a receive first, then a send, async: the checks complete in wait() and do not wait on each other.
        works = [
            collective.recv(box, "P", src=peer, async_op=True),
            collective.send(torch.full((3,), float(rank)), "P", dst=peer, async_op=True),
        ]
        for w in works:
            w.wait()
        out["exchange"] = box.tolist()
        start = time.monotonic()
        try:  # rank 1 skips the call: rank 0 times out naming it
            if rank == 0:
                collective.send(torch.ones(3), "Q", dst=1)
        except CommTimeoutError as err:
            out["timeout"] = (str(err), time.monotonic() - start)
    collective.barrier("P")  # the group is usable afterwards, on every rank
    t = torch.ones(2)
    collective.all_reduce(t, "P")
    out["after"] = t.tolist()
    return out


def test_reduce_reduce_scatter_all_gather_object_send_recv_equal_raw_torch(world4):
    # One task for every case (a spawned world per test would cost seconds each).
    results = world4.run(_ops_task, timeout=120)
    for rank, out in enumerate(results):
        for mode, declared in DECLARED.items():
            if rank not in declared:
                assert out[mode] == {"non_member": [None, None, None]}
                continue
            got = out[mode]
            # reduce to every root (sync and async, SUM / MAX / a ReduceOp instance / complex) equals raw torch on the
            # root.
            assert got["reduce"] and all(got["reduce"]), (rank, mode, got["reduce"])
            # reduce_scatter: this rank's chunk is the declared order's.
            assert got["reduce_scatter"], (rank, mode)
            # all_gather_object: entry i is declared[i]'s object, equal to raw torch's; the sender of a refused object
            # keeps its own, every other member refuses it and keeps its list.
            assert got["all_gather_object"], (rank, mode)
            if rank == declared[-1]:
                assert got["safe"] == "accepted" and got["max_bytes"] == "accepted"
            else:
                assert got["safe"] == ("refused", True, True) and got["max_bytes"] == ("refused", True), got
            # send / recv between every ordered pair, blocking and async, and an exchange posted receive-first.
            assert got["send_recv"] and all(got["send_recv"]), (rank, mode, got["send_recv"])
            assert f"dst={rank} is this rank: send needs another rank of mode {mode!r}" in got["self_send"]
            assert got["bad_peer"] == ["ValueError", "TypeError"]
    assert all(out["coalesced"] and out["coalesced_reduce"] for out in results)
    # Stats on THREE = [3, 1, 2]: 3 roots x 4 reduces of 3 elements (complex128 counts 48 bytes); pairs (3,1), (3,2),
    # (1,2) twice each, the lower declared position sending; the receive-first exchange pairs 3 with 1 (2 makes none).
    for rank, sends, receives in ((3, 4 + 1, 0 + 1), (1, 2 + 1, 2 + 1), (2, 0, 4)):
        stats = results[rank]["stats"]
        assert stats["reduce"] == (12, 3 * (24 + 24 + 24 + 48)), stats
        exchanges = 1 if rank != 2 else 0  # of 2 float32, the pairs' of 4
        assert (
            stats.get("send", (0, 0)) == (sends, 16 * (sends - exchanges) + 8 * exchanges)
            and stats.get("recv", (0, 0))[0] == receives
        ), stats


def test_debug_mode_checks_each_send_against_its_recv_by_the_pair_alone(world4):
    results = world4.run(_debug_task, timeout=120)
    for rank in (0, 1):
        out = results[rank]
        assert out["ok"] == ([0.0, 0.0, 0.0] if rank == 0 else [0.0, 1.0, 2.0])
        assert "the sender passes float32 x 3, the receiver float32 x 4" in out["mismatch"], out
        assert "the receiver refused the call: tensor must be contiguous" in out["refused"], out
        assert out["exchange"] == [float(1 - rank)] * 3
    message, elapsed = results[0]["timeout"]
    assert "global rank 1 did not reach the matching recv within 1.5 s" in message and elapsed < 1.5 + 4.0
    assert "timeout" not in results[1]
    assert all(out["after"] == [4.0, 4.0] for out in results)


def _bool_sum_task(rank, size, url):
    import torch

    from rlightning_comm import collective

    init_world(rank, size, url, timeout=30)
    flags = [torch.tensor([r == 0, r % 2 == 1, False, True, r == size - 1, r > 0, False, r == 1]) for r in range(size)]
    # The oracle: a logical or on this process (raw gloo adds the bytes, leaving bools that are neither True nor False).
    want = torch.stack(flags).any(0)

    def canonical(t):
        return set(t.view(torch.uint8).tolist()) <= {0, 1}

    t = flags[rank].clone()
    collective.all_reduce(t, "GLOBAL")
    root = flags[rank].clone()
    collective.reduce(root, "GLOBAL", dst=1)
    out = torch.zeros(2, dtype=torch.bool)
    collective.reduce_scatter(out, torch.cat([flags[rank]] * (size // 2)).reshape(-1)[: 2 * size].clone(), "GLOBAL")
    full = torch.stack([torch.cat([f] * (size // 2)).reshape(-1)[: 2 * size] for f in flags]).any(0)
    d = collective.all_reduce_dict({"flags": flags[rank].clone(), "any": rank == 1}, "GLOBAL", dtype=torch.bool)
    return {
        "all_reduce": torch.equal(t, want) and canonical(t),
        "reduce": rank != 1 or (torch.equal(root, want) and canonical(root)),
        "reduce_scatter": torch.equal(out, full[2 * rank : 2 * rank + 2]) and canonical(out),
        "all_reduce_dict": torch.equal(d["flags"], want) and canonical(d["flags"]) and d["any"] is True,
    }


def test_a_bool_sum_is_a_logical_or_as_on_nccl(world4):
    for result in world4.run(_bool_sum_task, timeout=60):
        assert result == dict.fromkeys(result, True), result
