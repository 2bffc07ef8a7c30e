"""``delta=True`` on both weight-sync calls, on 4 real gloo processes: bit-identical after every sync, the same decision
on every member, the bytes on the wire, and every option it meets (verify, atomic, async, relay and star, tied,
strided and lazy tensors, every dtype, newcomers, ``delta=False`` in between, bad input).

The oracle is raw torch.distributed: after each sync the source broadcasts its tensors (or the full model) with
``torch.distributed.broadcast``, and every destination compares its bytes with them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from digest_oracle import oracle, oracles
from world import init_world

MODE = "DELTA"


def _state(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One tensor of every dtype and layout a model may have (the source's ``w`` is a transposed view)."""
    emb = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    return {
        "emb": emb,
        "head": emb,  # tied to emb on the source
        "w": torch.randn(40, 48, generator=gen).t(),
        "h": torch.randn(33, generator=gen).to(torch.float16),
        "d": torch.randn(6, 5, generator=gen).to(torch.float64),
        "i8": torch.randint(-128, 127, (50,), generator=gen, dtype=torch.int8),
        "i32": torch.randint(-(2**31), 2**31 - 1, (20, 7), generator=gen, dtype=torch.int32),
        "i64": torch.randint(-(2**62), 2**62, (9,), generator=gen, dtype=torch.int64),
        "flag": torch.rand(17, generator=gen) > 0.5,
        "c": torch.randn(5, 6, generator=gen, dtype=torch.complex64),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(3.5),
    }


def _destination(rank: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A destination's own tensors, of the source's dtypes and shapes: rank 1 ties emb and head too, rank 2 holds w in a
    transposed layout, rank 3 holds c as a lazy conjugate."""
    out = {n: torch.zeros_like(t) for n, t in state.items()}
    if rank == 1:
        out["head"] = out["emb"]
    if rank == 2:
        out["w"] = torch.zeros(40, 48).t()
    if rank == 3:
        out["c"] = torch.zeros(5, 6, dtype=torch.complex64).conj()
    return out


def _words(t: torch.Tensor) -> torch.Tensor:
    t = t.resolve_conj().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).view(torch.uint8)


def _perturb(state: dict[str, torch.Tensor], fraction: float, gen: torch.Generator) -> None:
    """Flip one random bit of ``fraction`` of each tensor's elements (at least one), through its bytes."""
    seen = set()
    for t in state.values():
        if not t.numel() or id(t) in seen:
            continue
        seen.add(id(t))
        memory = t if t.is_contiguous() else t.t()  # (the transposed source tensor's memory is contiguous)
        flat = memory.reshape(-1).view(torch.uint8)
        k = max(1, round(t.numel() * fraction))
        elements = torch.randperm(t.numel(), generator=gen)[:k]
        byte = elements * t.element_size() + torch.randint(0, t.element_size(), (k,), generator=gen)
        flat[byte] ^= (1 << torch.randint(0, 8, (k,), generator=gen)).to(torch.uint8)
        if t.dtype == torch.bool:
            flat &= 1


def _same_as_source(mine: dict[str, torch.Tensor], rank: int) -> list[str]:
    """The names whose bytes differ from the source's, by the oracle: the source broadcasts each tensor raw."""
    wrong = []
    for name, t in sorted(mine.items()):
        theirs = _words(t).clone()
        dist.broadcast(theirs, src=0)
        if rank and not torch.equal(_words(t), theirs):
            wrong.append(name)
    return wrong


def _broadcast(rank: int, size: int, url: str) -> list[dict]:
    from rlightning_comm import broadcast_state_dict
    from rlightning_comm.weights import forget_delta
    from rlightning_comm.weights.core._memory import kept as kept_by

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], MODE)
    gen = torch.Generator().manual_seed(7)
    source = _state(gen)
    mine = source if rank == 0 else _destination(rank, source)
    out = []
    steps = [
        ("first", 0.02, {}),
        ("delta", 0.02, {}),
        ("verify", 0.02, {"verify": True}),
        ("async", 0.02, {"async_op": True}),
        ("atomic", 0.02, {"atomic": True}),
        ("star", 0.02, {"fanout": "star"}),
        ("everything changed", 1.0, {}),
        ("after a full sync", 0.05, {}),
        ("delta=False", 0.02, {"delta": False}),
        ("delta again", 0.02, {}),
        ("after it", 0.02, {}),
        ("a destination's new tensors", 0.02, {}),
        ("after the newcomer", 0.02, {"verify": True}),
        ("forget_delta on a destination", 0.02, {}),
        ("after forgetting", 0.02, {}),
        ("a destination written in place", 0.02, {}),
        ("after the write", 0.02, {}),
    ]
    for version, (label, fraction, options) in enumerate(steps, start=1):
        if rank == 0:
            _perturb(source, fraction, gen)
        if label == "a destination's new tensors" and rank == 3:
            mine = {n: t.clone() for n, t in mine.items()}  # other tensors, the same bytes: by content, its version
        if label == "forget_delta on a destination" and rank == 2:
            forget_delta(MODE)
        if label == "a destination written in place" and rank == 1:
            mine["d"][1:3].add_(1.0)  # through a view, no forget_delta: torch counted the write
        kwargs = {"delta": True, "version": version, **options}
        report = broadcast_state_dict(mine, MODE, src=0, **kwargs)
        if options.get("async_op"):
            report = report.wait()
        digests = report.digests
        kept = kept_by(ctx.get_communicator(MODE))
        out.append(
            {
                "label": label,
                "kinds": dict(report.kinds),
                "delivered": dict(report.delivered),
                "sent": dict(report.sent),
                "received": dict(report.received),
                "wrong": _same_as_source(mine, rank),
                "digests_ok": not digests or digests == oracles({n: t.resolve_conj() for n, t in mine.items()}),
                "version": ctx.get_weight_version(MODE),
                "keeps": (kept.snapshot is not None, kept.held is not None),
                "full_bytes": sum(t.numel() * t.element_size() for n, t in source.items() if n != "head"),
            }
        )
    return out


def test_broadcast_delta_is_bit_identical_and_full_only_where_it_must_be(world4) -> None:
    results = world4.run(_broadcast, timeout=120)
    expected_full = {
        "first",
        "everything changed",
        "delta=False",
        "delta again",
        "forget_delta on a destination",
        "a destination written in place",
    }
    for step in range(len(results[0])):
        rows = [r[step] for r in results]
        label = rows[0]["label"]
        for rank, row in enumerate(rows):
            assert row["wrong"] == [], (label, rank, row["wrong"])
            assert row["digests_ok"], (label, rank)
            assert row["version"] == (step + 1 if rank else None), (label, rank)  # a source records none
        kinds = rows[0]["kinds"]
        assert all(r["kinds"] == kinds for r in rows), label  # one decision, known on every member
        if label == "delta=False":  # nothing kept on any member: a delta=False sync costs nothing extra
            assert kinds == {} and rows[0]["delivered"] == {}, label
            assert all(r["keeps"] == (False, False) for r in rows), label
            continue
        assert rows[0]["keeps"] == (True, False) and all(r["keeps"] == (False, True) for r in rows[1:]), label
        assert set(kinds) == {1, 2, 3}
        kind = "full" if label in expected_full else "delta"
        assert set(kinds.values()) == {kind}, (label, kinds)
        full = rows[0]["full_bytes"]
        delivered = rows[0]["delivered"]
        for rank in (1, 2, 3):  # what each destination received on the wire is what the reports say it got
            assert sum(rows[rank]["received"].values()) == delivered[rank], label
        if kind == "full":
            assert set(delivered.values()) == {full}, (label, delivered)
        else:
            assert max(delivered.values()) < full / 4, (label, delivered, full)  # 2%: a small fraction of the bytes
        if label == "star":
            assert rows[0]["sent"] == delivered, label
        elif label != "star":
            assert list(rows[0]["sent"].values()) == [delivered[1]], label  # the relay: the source sends it once


def _bad_input(rank: int, size: int, url: str) -> list[str]:
    from rlightning_comm import broadcast_state_dict, reshard_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], MODE)
    state = {"w": torch.full((8,), float(rank))}
    seen = []

    def refused(call, *args, **kwargs) -> None:
        try:
            call(*args, **kwargs)
        except (TypeError, ValueError) as err:
            seen.append(f"{type(err).__name__}: {err}")
            return
        seen.append("no error")

    refused(broadcast_state_dict, state, MODE, src=0, version=1, delta="yes")
    refused(broadcast_state_dict, state, MODE, src=0, delta=True)
    refused(broadcast_state_dict, state, MODE, src=0, version=1, delta=rank != 2)
    target = (lambda named: None) if rank == 3 else state
    refused(broadcast_state_dict, state if rank == 0 else target, MODE, src=0, version=1, delta=True)
    held = {"w": state["w"]} if rank == 0 else None
    wanted = {"w": state["w"]} if rank else None
    refused(reshard_state_dict, held=held, wanted=wanted, comm_mode=MODE, version=1, delta=1)
    refused(reshard_state_dict, held=held, wanted=wanted, comm_mode=MODE, delta=True)
    # Nothing moved, and the mode is still usable.
    seen.append(f"untouched {bool((state['w'] == rank).all())}")
    broadcast_state_dict(state, MODE, src=0, version=1, delta=True)
    seen.append(f"synced {bool((state['w'] == 0).all())}")
    return seen


def test_bad_delta_input_is_refused_on_every_member_before_anything_moves(world4) -> None:
    results = world4.run(_bad_input, timeout=60)
    for rank, seen in enumerate(results):
        assert seen[0].startswith("TypeError") and "delta must be a bool; got str 'yes'" in seen[0], seen[0]
        assert seen[1].startswith("ValueError") and "delta=True needs a version" in seen[1], seen[1]
        assert seen[1].count("delta=True needs a version") == 1 and "ranks [0, 1, 2, 3]:" in seen[1], seen[1]
        assert seen[2].startswith("ValueError") and "different deltas" in seen[2], seen[2]
        assert seen[3].startswith("ValueError") and "rank 3: delta=True cannot go through a load callable" in seen[3]
        assert seen[4].startswith("TypeError") and "delta must be a bool; got int 1" in seen[4], seen[4]
        assert seen[5].startswith("ValueError") and "delta=True needs a version" in seen[5], seen[5]
        assert seen[6:] == ["untouched True", "synced True"], (rank, seen)


WIDTH = 24
NAMES = {"up": torch.float32, "down": torch.bfloat16, "norm": torch.float16, "ids": torch.int32}


def _full(gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for name, dtype in NAMES.items():
        shape = (WIDTH,) if name == "norm" else (WIDTH, WIDTH)
        out[name] = (torch.randn(shape, generator=gen) * 100).to(dtype)
    return out


def _alone(t: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """``t`` with every element outside ``block`` (a view of it) zeroed: a block's digest is that tensor's, by the
    digest's definition (a sum over global positions)."""
    out = torch.zeros_like(t)
    out.view(torch.uint8).reshape(-1)  # (a plain tensor: viewable)
    index = torch.zeros_like(t, dtype=torch.bool)
    index[tuple(slice(o, o + n) for o, n in zip(_offsets(t, block), block.shape))] = True
    out[index] = t[index]
    return out


def _offsets(t: torch.Tensor, block: torch.Tensor) -> tuple[int, ...]:
    at = (block.data_ptr() - t.data_ptr()) // t.element_size()
    out = []
    for stride in t.stride():
        out.append(at // stride)
        at %= stride
    return tuple(out)


def _reshard(rank: int, size: int, url: str) -> list[dict]:
    from rlightning_comm import TensorSlice, reshard_state_dict
    from rlightning_comm.weights import layouts

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], MODE)
    gen = torch.Generator().manual_seed(11)
    full = _full(gen)  # the same on every rank: the trainers' shards are cut from it, the oracle too
    half = WIDTH // 2

    def shard(t: torch.Tensor) -> torch.Tensor:
        return t[rank * half : (rank + 1) * half]

    held = wanted = None
    engine: dict[str, torch.Tensor] = {}

    def engine_tensors() -> None:
        nonlocal wanted
        tp = rank - 2
        engine.update(
            up=torch.zeros(half, WIDTH),  # column-parallel: a row block
            down=torch.zeros(WIDTH, WIDTH, dtype=torch.bfloat16)[:, tp * half : (tp + 1) * half],  # strided columns
            norm=torch.zeros(WIDTH, dtype=torch.float16),  # replicated
            ids=torch.zeros(WIDTH, half, dtype=torch.int32),  # row-parallel
        )
        wanted = {
            "up": layouts.column_parallel(engine["up"], tp, 2),
            "down": TensorSlice(engine["down"], (0, tp * half), (WIDTH, WIDTH)),
            "norm": layouts.replicated(engine["norm"]),
            "ids": layouts.row_parallel(engine["ids"], tp, 2),
        }

    if rank < 2:
        held = {
            n: TensorSlice(shard(t).clone(), (rank * half,) + (0,) * (t.dim() - 1), tuple(t.shape))
            for n, t in full.items()
        }
    else:
        engine_tensors()

    def expected(name: str) -> torch.Tensor:
        tp, t = rank - 2, full[name]
        if name in ("up",):
            return t[tp * half : (tp + 1) * half]
        if name in ("down", "ids"):
            return t[:, tp * half : (tp + 1) * half]
        return t

    steps = [
        ("first", 0.05, {}),
        ("delta", 0.05, {}),
        ("verify", 0.05, {"verify": True}),
        ("a newcomer", 0.05, {}),
        ("after it", 0.05, {"verify": True}),
        ("an engine written in place", 0.05, {}),
        ("after the write", 0.05, {}),
        ("atomic: staging of another layout", 0.05, {"atomic": True}),  # a contiguous staging of the strided down
        ("atomic", 0.05, {"atomic": True}),
        ("everything changed", 1.0, {"atomic": True}),
        ("delta=False", 0.05, {"delta": False}),
        ("delta again", 0.05, {}),
    ]
    out = []
    for version, (label, fraction, options) in enumerate(steps, start=1):
        _perturb(full, fraction, gen)  # every rank the same: the generator is seeded alike
        if rank < 2:
            for n, t in full.items():
                held[n].tensor.copy_(shard(t))
        if label == "a newcomer" and rank == 3:
            engine_tensors()  # new tensors (zeros): no version they hold
        if label == "an engine written in place" and rank == 2:
            engine["up"][0].mul_(2.0)  # through a view, no forget_delta: torch counted the write
        report = reshard_state_dict(
            held=held, wanted=wanted, comm_mode=MODE, **{"delta": True, "version": version, **options}
        )
        wrong = [n for n, t in engine.items() if not torch.equal(_words(t), _words(expected(n)))]
        digests_ok = not report.digests or report.digests == {n: oracle(_alone(full[n], expected(n))) for n in engine}
        out.append(
            {
                "label": label,
                "kinds": dict(report.kinds),
                "delivered": dict(report.delivered),
                "received": sum(report.received.values()),
                "wrong": wrong,
                "digests_ok": digests_ok,
                "wanted_bytes": sum(t.numel() * t.element_size() for t in engine.values()),
            }
        )
    return out


def test_reshard_delta_is_bit_identical_and_decided_per_destination(world4) -> None:
    results = world4.run(_reshard, timeout=120)
    expected = {
        "first": {2: "full", 3: "full"},
        "a newcomer": {2: "delta", 3: "full"},
        "an engine written in place": {2: "full", 3: "delta"},
        "atomic: staging of another layout": {2: "full", 3: "full"},  # a plan of new metadata: full
        "everything changed": {2: "full", 3: "full"},
        "delta=False": {},
        "delta again": {2: "full", 3: "full"},
    }
    for step in range(len(results[0])):
        rows = [r[step] for r in results]
        label = rows[0]["label"]
        for rank, row in enumerate(rows):
            assert row["wrong"] == [] and row["digests_ok"], (label, rank, row)
        kinds = rows[0]["kinds"]
        assert all(r["kinds"] == kinds for r in rows), label
        assert kinds == expected.get(label, {2: "delta", 3: "delta"}), (label, kinds)
        for rank in (2, 3):
            if rows[0]["delivered"]:  # known on every member once the plan was kept
                assert rows[0]["delivered"][rank] == rows[rank]["received"], label
            if kinds.get(rank) == "delta":
                assert rows[rank]["received"] < rows[rank]["wanted_bytes"] / 3, (label, rows[rank])


def _reshard_failure(rank: int, size: int, url: str) -> dict:
    """Two good delta syncs, then one in which engine rank 3's connections break as its delta moves."""
    import time

    from rlightning_comm import CommError, TensorSlice, reshard_state_dict
    from rlightning_comm.failures import close_gloo_group
    from rlightning_comm.weights.reshard import _delta_mover

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], MODE)
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(16, 8, generator=gen)
    held = {"w": TensorSlice(full[8 * rank : 8 * rank + 8].clone(), (8 * rank, 0), (16, 8))} if rank < 2 else None
    wanted = {"w": torch.zeros(16, 8)} if rank >= 2 else None
    for version in (1, 2):
        if held is not None:
            held["w"].tensor[0, version] += 1
        reshard_state_dict(held=held, wanted=wanted, comm_mode=MODE, version=version, delta=True)
    if rank == 3:
        original = _delta_mover.DeltaMover._run

        def broken(self):
            close_gloo_group(self._comm.group)  # as a dead member's peers see it: every connection closed
            return original(self)

        _delta_mover.DeltaMover._run = broken
    if held is not None:
        held["w"].tensor[1, 1] += 1
    start = time.monotonic()
    try:
        report = reshard_state_dict(held=held, wanted=wanted, comm_mode=MODE, version=3, delta=True)
        outcome = {"error": None, "kinds": dict(report.kinds)}
    except CommError as err:
        outcome = {"error": str(err)}
    outcome.update(elapsed=time.monotonic() - start, version=ctx.get_weight_version(MODE))
    return outcome


def test_a_delta_reshard_that_fails_midway_fails_every_member_fast_and_forgets_the_version(world4) -> None:
    results = world4.run(_reshard_failure, timeout=60)
    for rank, r in enumerate(results):
        assert r["elapsed"] < 10, (rank, r)
    assert results[3]["error"] is not None and "reshard_state_dict failed midway" in results[3]["error"], results[3]
    assert results[3]["version"] is None  # partly written or not, it holds no version: its next sync is full
    for rank in (0, 1):  # each trainer sends to rank 3: its transfer fails, and says which destinations it served
        assert results[rank]["error"] is not None and "may hold partial weights" in results[rank]["error"], results
    assert results[2]["error"] is not None or results[2]["version"] == 3, results[2]  # done before the break, or not
