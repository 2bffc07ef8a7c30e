"""Seeded bad-input fuzzing in debug mode: one random bad rank per case, every rank must end the same way.

All cases run in one task on one spawned world of 2 gloo ranks. After each case the ranks meet in a raw
torch.distributed barrier and run a good collective through the library, compared with raw torch.distributed on the same
values: the group must still be usable and in step. Run with ``-s`` to see the table of case kinds against outcomes.
"""

from __future__ import annotations

import random
import time
import warnings
from collections import Counter

from world import init_world

CASES = 64
# Group "F" runs the cases that must resolve at once (its timeout only bounds a hang), group "U" the ones where a rank
# never arrives: its short timeout is what a debug check waits for that rank.
TIMEOUT = 30.0
SHORT_TIMEOUT = 1.5  # short, yet long enough that a loaded host does not miss the good call after the case
BOUND = 6.0  # no case may take longer than this on any rank

# kind -> the outcome every rank must see
EXPECTED = {
    "shape": "mismatch",
    "dtype": "mismatch",
    "reduce op": "mismatch",
    "different op": "mismatch",
    "src/dst": "mismatch",
    "dict keys": "mismatch",
    "split sizes (peers)": "mismatch",
    "src/dst out of range": "refused",
    "non-tensor": "refused",
    "non-contiguous": "refused",
    "root list": "refused",
    "split sizes (local)": "refused",
    "dict value": "refused",
    "dict key order": "refused",
    "dict dtype": "refused",
    "unbound mode": "timeout",
    "numbers (valid)": "ok",
    "conj or neg view": "refused",
    "nested": "refused",
    "meta": "refused",
    "reduce op instance (valid)": "ok",
}
KINDS = list(EXPECTED)


def _call(kind, rng, me, bad, torch, coll, comm):
    """Run case ``kind`` as global rank ``me``; the bad rank deviates. Returns what to compare with raw torch, if
    anything."""
    from torch.distributed import ReduceOp

    is_bad = me == bad
    n = rng.randint(1, 5)
    if kind == "shape":
        coll.all_reduce(torch.ones(n + (rng.randint(1, 3) if is_bad else 0)), "F")
    elif kind == "dtype":
        coll.all_reduce(torch.ones(n, dtype=rng.choice([torch.float64, torch.int64]) if is_bad else torch.float32), "F")
    elif kind == "reduce op":
        coll.all_reduce(torch.ones(n), "F", op=rng.choice([ReduceOp.MAX, ReduceOp.MIN]) if is_bad else ReduceOp.SUM)
    elif kind == "different op":
        if is_bad:
            coll.broadcast(torch.ones(n), "F", src=0)
        else:
            coll.all_reduce(torch.ones(n), "F")
    elif kind == "src/dst":
        root = 1 - bad if is_bad else bad
        if rng.random() < 0.5:
            coll.broadcast(torch.ones(n), "F", src=root)
        else:
            coll.gather(torch.ones(n), "F", [torch.zeros(n) for _ in range(2)] if me == root else None, dst=root)
    elif kind == "src/dst out of range":
        coll.broadcast(torch.ones(n), "F", src=rng.choice([2, 7, -1, 1.0]) if is_bad else 0)
    elif kind == "dict keys":
        coll.all_reduce_dict({"loss": 1.0, ("acc" if is_bad else "accuracy"): 2.0}, "F")
    elif kind == "dict value":
        coll.all_reduce_dict({"loss": rng.choice([1j, "1.0", None, [1.0]]) if is_bad else 1.0}, "F")
    elif kind == "dict key order":
        coll.all_reduce_dict({"loss": 1.0, (frozenset({1}) if is_bad else "x"): 2.0}, "F")
    elif kind == "dict dtype":
        coll.all_reduce_dict(
            {"loss": 1.0}, "F", dtype=rng.choice(["float32", float, torch.complex64]) if is_bad else torch.float32
        )
    elif kind == "non-tensor":
        coll.all_reduce(rng.choice([[1.0] * n, 1.0, None]) if is_bad else torch.ones(n), "F")
    elif kind == "non-contiguous":
        n += 1  # a view with one element is contiguous
        views = [lambda: torch.ones(n, 2)[:, 0], lambda: torch.ones(2 * n)[::2], lambda: torch.ones(n, 2).t()]
        coll.all_reduce(rng.choice(views)() if is_bad else torch.ones(n), "F")
    elif kind == "root list":
        # Only the root reads its list: the bad rank is the root, and its list is wrong.
        wrong = rng.choice(
            [
                [torch.zeros(n)],
                [torch.zeros(n), torch.zeros(n + 1)],
                [torch.zeros(n), torch.zeros(n, dtype=torch.float64)],
            ]
        )
        if rng.random() < 0.5:
            coll.gather(torch.ones(n), "F", wrong if is_bad else None, dst=bad)
        else:
            coll.scatter(torch.zeros(n), "F", wrong if is_bad else None, src=bad)
    elif kind == "split sizes (local)":
        comm.all_to_all_single(
            torch.empty(4), torch.ones(4), [2, 2], rng.choice([[3, 3], [1, 1, 2], [2.0, 2.0]]) if is_bad else [2, 2]
        )
    elif kind == "split sizes (peers)":
        # Locally fine everywhere, but the bad rank expects 3 rows from its peer, which sends 2.
        comm.all_to_all_single(
            torch.empty(4), torch.ones(4), [1, 3] if is_bad and bad == 0 else ([3, 1] if is_bad else [2, 2]), [2, 2]
        )
    elif kind == "unbound mode":
        coll.all_reduce(torch.ones(n), "NOT_BOUND" if is_bad else "U")
    elif kind == "numbers (valid)":
        value = rng.choice([0, 3, 2.5, True]) if is_bad else 1.5
        return ("dict", coll.all_reduce_dict({"count": value, "n": 2**24 + 1}, "F"), [float(value), 2**24 + 1])
    elif kind == "conj or neg view":
        view = rng.choice([lambda: torch.ones(n, dtype=torch.complex64).conj(), lambda: torch._neg_view(torch.ones(n))])
        coll.all_reduce(view() if is_bad else torch.ones(n, dtype=view().dtype), "F")
    elif kind == "nested":
        with warnings.catch_warnings():  # the strided layout's "prototype" warning
            warnings.simplefilter("ignore")
            nested = torch.nested.nested_tensor(
                [torch.ones(n), torch.ones(n + 1)], layout=rng.choice([torch.strided, torch.jagged])
            )
        coll.all_reduce(nested if is_bad else torch.ones(2 * n + 1), "F")
    elif kind == "meta":
        coll.broadcast(torch.empty(n, device="meta") if is_bad else torch.ones(n), "F", src=0)
    elif kind == "reduce op instance (valid)":
        values = [rng.random() * (me + 1) for _ in range(n)]
        op = ReduceOp(ReduceOp.MAX) if is_bad else ReduceOp.MAX  # torch takes both; the fingerprints must agree
        t = torch.tensor(values, dtype=torch.float64)
        coll.all_reduce(t, "F", op=op)
        return ("max", t.tolist(), values)
    return None


def _fuzz_task(rank, size, url, seed):
    import numpy as np  # noqa: F401 - imported up front, like the case code's torch
    import torch
    import torch.distributed as dist

    from rlightning_comm import collective

    torch.nested.nested_tensor(
        [torch.ones(1)], layout=torch.jagged
    )  # its first use imports the jagged layout: seconds, not part of any case
    ctx = init_world(rank, size, url, timeout=30)
    ctx.init_group([0, 1], "F", timeout=TIMEOUT)
    ctx.init_group([0, 1], "U", timeout=SHORT_TIMEOUT)
    ctx.set_debug(True)
    comm = ctx.get_communicator("F")
    records = []
    began = time.monotonic()
    for case in range(CASES):
        rng = random.Random(seed * 1000 + case)  # the same on every rank
        kind, bad = KINDS[case % len(KINDS)], rng.randrange(size)
        mode = "U" if kind == "unbound mode" else "F"
        group = ctx.get_group("F")  # raw torch's answers come from the long-timeout group (same ranks)
        start = time.monotonic()
        try:
            result, error = _call(kind, rng, rank, bad, torch, collective, comm), None
        except Exception as err:  # noqa: BLE001 - the outcome is what the test compares
            result, error = None, (type(err).__name__, str(err))
        elapsed = time.monotonic() - start
        correct = None
        if result is not None:
            tag, got, values = result
            raw = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(raw, group=group, op=dist.ReduceOp.MAX if tag == "max" else dist.ReduceOp.SUM)
            correct = (list(got.values()) if tag == "dict" else got) == raw.tolist()
        dist.barrier()  # raw torch: a rank that failed locally waits here while its peer's check times out
        t = torch.tensor([rng.random() for _ in range(3)]) * (rank + 1)
        expected = t.clone()
        dist.all_reduce(expected, group=group)
        collective.all_reduce(t, mode)  # debug-checked, after whatever the case left behind
        records.append((kind, bad, error, elapsed, correct, torch.equal(t, expected)))
    return records, time.monotonic() - began


def _outcome(kind, bad, per_rank):
    errors = [r[2] for r in per_rank]
    if any(r[3] > BOUND for r in per_rank):
        return "HANG"
    if not all(r[5] for r in per_rank):
        return "GROUP UNUSABLE"
    if all(e is None for e in errors):
        return "ok" if all(r[4] for r in per_rank) else "WRONG RESULT"
    if all(e is not None and e[0] == "CommMismatchError" for e in errors):
        return "mismatch"
    if all(
        e is not None and e[0] == errors[bad][0] != "CommTimeoutError" and f"global rank {bad} refused the call" in e[1]
        for e in errors
    ):
        return "refused"
    others = [e for r, e in enumerate(errors) if r != bad]
    if (
        errors[bad] is not None
        and errors[bad][0] == "ModeNotBoundError"
        and all(e is not None and e[0] == "CommTimeoutError" and f"[{bad}]" in e[1] for e in others)
    ):
        return "timeout"
    return "INCONSISTENT: " + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors))


def test_fuzz_every_rank_ends_the_same_way(world2):
    reports = world2.run(_fuzz_task, 11, timeout=CASES * BOUND)
    results = [records for records, _ in reports]
    table: dict[str, Counter] = {kind: Counter() for kind in KINDS}
    failures = []
    for case, per_rank in enumerate(zip(*results)):
        kind, bad = per_rank[0][0], per_rank[0][1]
        outcome = _outcome(kind, bad, per_rank)
        table[kind][outcome if outcome == EXPECTED[kind] else "unexpected"] += 1
        if outcome != EXPECTED[kind]:
            failures.append(f"case {case} ({kind}, bad rank {bad}): expected {EXPECTED[kind]}, got {outcome}")
    columns = ["mismatch", "refused", "timeout", "ok", "unexpected"]
    lines = [f"{'case kind':<22} {'expected':<9} " + " ".join(f"{c:>10}" for c in columns)]
    lines += [f"{kind:<22} {EXPECTED[kind]:<9} " + " ".join(f"{table[kind][c]:>10}" for c in columns) for kind in KINDS]
    slowest = max(r[3] for rank in results for r in rank)
    seconds = max(s for _, s in reports)
    lines.append(f"{CASES} cases on 2 gloo ranks in {seconds:.1f} s; slowest case {slowest:.2f} s (bound {BOUND:g} s)")
    print("\n" + "\n".join(lines))
    assert not failures, "\n".join(failures)
    assert all(len(table[kind]) > 0 for kind in KINDS)
