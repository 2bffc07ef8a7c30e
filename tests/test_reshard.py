"""reshard_state_dict on 4 spawned gloo ranks, against an oracle that is not the library: the full tensors, made in
every process from one seed, sliced by hand (``torch.chunk``, explicit row and column ranges); bit-identical.

One spawned run holds many cases (starting ranks is the slow part): FSDP2 to a tensor-parallel engine, trainer TP2
``Shard(1)`` to engine TP4 ``Shard(0)``, 2 K/V heads on TP4, tied embeddings, data-parallel x FSDP replicas, members
that hold and want; the cached plan, counted; every refusal, on every member, destinations untouched.
"""

from __future__ import annotations

import pytest
import torch
from world import init_world

MODE = "RESHARD"


def _full(seed: int, shapes: dict) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in shapes.items():
        t = torch.randn(shape, generator=gen, dtype=torch.float64) * 100
        out[name] = t.to(dtype)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (``torch.equal`` calls -0.0 and 0.0 equal)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def _garbage(shape, dtype) -> torch.Tensor:
    return torch.full(shape, -7, dtype=dtype)


class _Counter:
    """Counts the exchanges of the handshake (the fingerprint round and the metadata rounds)."""

    def __init__(self) -> None:
        from rlightning_comm.weights.reshard import _call as _reshard

        self.module, self.rounds, self.words, self.texts = _reshard, 0, [], 0
        self.exchange, self.exchange_texts = _reshard.exchange, _reshard.exchange_texts

        def exchange(comm, words, memory, op):
            self.rounds += 1
            self.words.append(len(words))
            return self.exchange(comm, words, memory, op)

        def texts(comm, text, memory, op):
            self.texts += 1
            return self.exchange_texts(comm, text, memory, op)

        _reshard.exchange, _reshard.exchange_texts = exchange, texts

    def reset(self) -> None:
        self.rounds, self.words, self.texts = 0, [], 0

    def close(self) -> None:
        self.module.exchange, self.module.exchange_texts = self.exchange, self.exchange_texts


# ----------------------------------------------------------------------------------- the geometries
DIM, HEADS, KV, HEAD = 16, 4, 2, 4
FFN, VOCAB = 22, 37  # 37 rows: uneven FSDP shards (19 and 18)
SHAPES_A = {
    "embed": ((VOCAB, DIM), torch.float32),
    "q": ((HEADS * HEAD, DIM), torch.float32),
    "k": ((KV * HEAD, DIM), torch.float32),
    "v": ((KV * HEAD, DIM), torch.float32),
    "q_b": ((HEADS * HEAD,), torch.float32),
    "k_b": ((KV * HEAD,), torch.float32),
    "v_b": ((KV * HEAD,), torch.float32),
    "o": ((DIM, HEADS * HEAD), torch.float32),
    "gate": ((FFN, DIM), torch.float32),
    "up": ((FFN, DIM), torch.float32),
    "down": ((DIM, FFN), torch.float32),
    "norm": ((DIM,), torch.bfloat16),
}


def _fsdp_to_tp(rank: int, full: dict, trainer_mesh, counter: _Counter, wrong: list, out: dict) -> None:
    """FSDP2 Shard(0) on ranks 0, 1 (real DTensors from fully_shard) to a TP=2 engine on ranks 2, 3: fused qkv and
    gate/up, row-parallel o and down, the rest replicated. Twice, the second after an update: the plan is kept."""
    from torch.distributed.fsdp import fully_shard

    from rlightning_comm import reshard_state_dict
    from rlightning_comm.weights import layouts

    held = wanted = None
    if rank < 2:
        model = torch.nn.Module()
        for name, t in full.items():
            model.register_parameter(name, torch.nn.Parameter(t.clone()))
        fully_shard(model, mesh=trainer_mesh)
        held = dict(model.named_parameters())
    else:
        r = rank - 2
        engine = {
            "embed": _garbage((VOCAB, DIM), torch.float32),
            "qkv": _garbage(((HEADS // 2 + 2 * (KV // 2)) * HEAD, DIM), torch.float32),
            "qkv_b": _garbage(((HEADS // 2 + 2 * (KV // 2)) * HEAD,), torch.float32),
            "o": _garbage((DIM, HEADS * HEAD // 2), torch.float32),
            "gate_up": _garbage((FFN, DIM), torch.float32),
            "down": _garbage((DIM, FFN // 2), torch.float32),
            "norm": _garbage((DIM,), torch.bfloat16),
        }
        wanted = {
            "embed": layouts.replicated(engine["embed"]),
            **layouts.qkv(engine["qkv"], r, 2, names=("q", "k", "v"), num_heads=HEADS, num_kv_heads=KV, head_dim=HEAD),
            **layouts.qkv(
                engine["qkv_b"], r, 2, names=("q_b", "k_b", "v_b"), num_heads=HEADS, num_kv_heads=KV, head_dim=HEAD
            ),
            "o": layouts.row_parallel(engine["o"], r, 2),
            **layouts.fused(engine["gate_up"], {"gate": FFN, "up": FFN}, r, 2),
            "down": layouts.row_parallel(engine["down"], r, 2),
            "norm": layouts.replicated(engine["norm"]),
        }
    for step in range(2):
        counter.reset()
        report = reshard_state_dict(held=held, wanted=wanted, comm_mode=MODE, bucket_bytes=1024)
        out[f"fsdp_tp{step}"] = (
            dict(report.sent),
            dict(report.received),
            report.plan_cached,
            counter.rounds,
            list(counter.words),
            counter.texts,
        )
        if rank >= 2:
            q, k, v, h, f = HEADS * HEAD // 2, KV * HEAD // 2, KV * HEAD // 2, HEADS * HEAD // 2, FFN // 2
            rows = slice(r * q, (r + 1) * q)
            expected = {
                "embed": full["embed"],
                "qkv": torch.cat([full["q"][rows], full["k"][r * k : (r + 1) * k], full["v"][r * v : (r + 1) * v]]),
                "qkv_b": torch.cat(
                    [full["q_b"][rows], full["k_b"][r * k : (r + 1) * k], full["v_b"][r * v : (r + 1) * v]]
                ),
                "o": full["o"][:, r * h : (r + 1) * h],
                "gate_up": torch.cat([full["gate"][r * f : (r + 1) * f], full["up"][r * f : (r + 1) * f]]),
                "down": full["down"][:, r * f : (r + 1) * f],
                "norm": full["norm"],
            }
            wrong += [f"fsdp->tp step {step}: {n}" for n, t in expected.items() if not _same(engine[n], t)]
        else:  # an optimizer-like update of the trainer's shards, in place; the oracle follows it
            with torch.no_grad():
                for p in held.values():
                    p.to_local().add_(1)
        full = {n: (t.double() + 1).to(t.dtype) for n, t in full.items()}
    out["fsdp_tp_bytes"] = sum(math_prod(s) * dt.itemsize for s, dt in SHAPES_A.values())


def math_prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _tp2_to_tp4(rank: int, mesh, wrong: list, out: dict) -> None:
    """Trainer TP2 Shard(1) DTensors (ranks 0, 1; 7 columns: uneven) to engine TP4 Shard(0) on all four ranks: ranks 0
    and 1 hold and want."""
    from torch.distributed.tensor import DTensor, Shard

    from rlightning_comm import reshard_state_dict
    from rlightning_comm.weights import layouts

    full = _full(2, {"w": ((12, 10), torch.float32), "x": ((8, 7), torch.float64)})
    held = None
    if rank < 2:
        held = {}
        for name, t in full.items():
            local = torch.chunk(t, 2, dim=1)[rank].clone()
            held[name] = DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=t.shape, stride=t.stride())
    mine = {"w": _garbage((3, 10), torch.float32), "x": _garbage((2, 7), torch.float64)}
    wanted = {n: layouts.column_parallel(t, rank, 4) for n, t in mine.items()}
    report = reshard_state_dict(held=held, wanted=wanted, comm_mode=MODE, bucket_bytes=64)
    out["tp2_tp4"] = (dict(report.sent), dict(report.received))
    for n, t in mine.items():
        rows = t.shape[0]
        if not _same(t, full[n][rank * rows : (rank + 1) * rows]):
            wrong.append(f"tp2->tp4: {n}")


def _few_kv_heads(rank: int, wrong: list, out: dict) -> None:
    """2 K/V heads on an engine of TP=4 (each K/V head on two ranks); ranks 0 and 1 hold full replicas."""
    from rlightning_comm import reshard_state_dict
    from rlightning_comm.weights import layouts

    heads, kv, hd, dim = 8, 2, 4, 8
    full = _full(
        3,
        {
            "q": ((heads * hd, dim), torch.float32),
            "k": ((kv * hd, dim), torch.float32),
            "v": ((kv * hd, dim), torch.float32),
        },
    )
    held = {n: t.clone() for n, t in full.items()} if rank < 2 else None
    fused = _garbage(((heads // 4 + 2) * hd, dim), torch.float32)
    wanted = layouts.qkv(fused, rank, 4, names=("q", "k", "v"), num_heads=heads, num_kv_heads=kv, head_dim=hd)
    report = reshard_state_dict(held=held, wanted=wanted, comm_mode=MODE, bucket_bytes=4096)
    out["kv"] = (dict(report.sent), dict(report.received))
    q_rows = heads // 4 * hd
    head = rank // 2  # ranks 0, 1: K/V head 0; ranks 2, 3: head 1
    expected = torch.cat(
        [
            full["q"][rank * q_rows : (rank + 1) * q_rows],
            full["k"][head * hd : (head + 1) * hd],
            full["v"][head * hd : (head + 1) * hd],
        ]
    )
    if not _same(fused, expected):
        wrong.append("few kv heads")


def _tied(rank: int, wrong: list, out: dict) -> None:
    """Tied embeddings: rank 0 holds one tensor under two names; rank 1 wants both into one tensor, rank 2 only the
    embedding (its head shares it), rank 3 both into two tensors."""
    from rlightning_comm import TensorSlice, reshard_state_dict

    full = _full(4, {"embed": ((11, 6), torch.bfloat16)})["embed"]
    held = {"embed": full.clone()} if rank == 0 else None
    if held:
        held["lm_head"] = held["embed"]
    mine = [_garbage((11, 6), torch.bfloat16) for _ in range(2)]
    if rank == 0:
        wanted = None
    elif rank == 1:
        wanted = {"embed": mine[0], "lm_head": TensorSlice(mine[0], (0, 0), (11, 6))}
    elif rank == 2:
        wanted = {"embed": mine[0]}
    else:
        wanted = {"embed": mine[0], "lm_head": mine[1]}
    report = reshard_state_dict(held=held, wanted=wanted, comm_mode=MODE, bucket_bytes=256)
    out["tied"] = (dict(report.sent), dict(report.received))
    if rank and not _same(mine[0], full):
        wrong.append("tied: embed")
    if rank == 3 and not _same(mine[1], full):
        wrong.append("tied: lm_head")


def _replicas(rank: int, wrong: list, out: dict) -> None:
    """Data-parallel x FSDP: replica A on ranks 0, 1 and replica B on ranks 2, 3, each Shard(0) over its two ranks;
    every rank wants rows of a TP4 layout and the whole of a small tensor."""
    from rlightning_comm import TensorSlice, reshard_state_dict

    full = _full(5, {"p": ((20, 6), torch.float64), "n": ((9,), torch.float32)})
    shard = rank % 2
    held = {}
    for name, t in full.items():
        rows = torch.chunk(t, 2)
        offset = sum(c.shape[0] for c in rows[:shard])
        held[name] = TensorSlice(rows[shard].clone(), (offset,) + (0,) * (t.dim() - 1), tuple(t.shape))
    mine = {"p": _garbage((5, 6), torch.float64), "n": _garbage((9,), torch.float32)}
    wanted = {"p": TensorSlice(mine["p"], (5 * rank, 0), (20, 6)), "n": TensorSlice(mine["n"], (0,), (9,))}
    report = reshard_state_dict(held=held, wanted=wanted, comm_mode=MODE, bucket_bytes=128)
    out["replicas"] = (dict(report.sent), dict(report.received))
    if not _same(mine["p"], full["p"][5 * rank : 5 * rank + 5]) or not _same(mine["n"], full["n"]):
        wrong.append("replicas")
    # What this rank holds of what it wants is copied here, not sent: rows [10 * shard, 10 * shard + 10) of p, and n's
    # first 5 (shard 0) or last 4 (shard 1) elements.
    own_p = max(0, min(5 * rank + 5, 10 * shard + 10) - max(5 * rank, 10 * shard)) * 6 * 8
    own_n = (5 if shard == 0 else 4) * 4
    out["replicas_remote"] = 5 * 6 * 8 + 9 * 4 - own_p - own_n


def _geometries(rank: int, size: int, url: str) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], MODE, timeout=30)
    trainer_mesh = DeviceMesh("cpu", torch.tensor([0, 1]))  # every rank of the world builds it (its group's creation)
    counter = _Counter()
    wrong: list[str] = []
    out: dict = {}
    try:
        _fsdp_to_tp(rank, _full(1, SHAPES_A), trainer_mesh, counter, wrong, out)
        _tp2_to_tp4(rank, trainer_mesh, wrong, out)
        _few_kv_heads(rank, wrong, out)
        _tied(rank, wrong, out)
        _replicas(rank, wrong, out)
        # The grouped path other backends (NCCL) take, run here on gloo: batch_isend_irecv per phase.
        from rlightning_comm.weights.reshard import _mover

        _mover.point_to_point, plain_p2p = (lambda comm: False), _mover.point_to_point
        try:
            batched: list[str] = []
            _tp2_to_tp4(rank, trainer_mesh, batched, {})
            _few_kv_heads(rank, batched, {})
            _replicas(rank, batched, {})
            wrong += [f"batched: {w}" for w in batched]
        finally:
            _mover.point_to_point = plain_p2p
    finally:
        counter.close()
    out["wrong"] = wrong
    return out


def test_geometries_are_bit_identical_to_the_sliced_full_tensors(world4) -> None:
    reports = world4.run(_geometries, timeout=120)
    for rank, r in enumerate(reports):
        assert r["wrong"] == [], (rank, r["wrong"])
    # FSDP -> TP: the trainers send exactly what the engines want, and no engine receives a byte it does not keep. Each
    # engine wants the replicated tensors whole and half of every split one.
    replicated = sum(math_prod(SHAPES_A[n][0]) * SHAPES_A[n][1].itemsize for n in ("embed", "norm"))
    wanted_by_engines = 2 * replicated + (reports[0]["fsdp_tp_bytes"] - replicated)
    for step in (0, 1):
        sent = [reports[r][f"fsdp_tp{step}"][0] for r in range(4)]
        received = [reports[r][f"fsdp_tp{step}"][1] for r in range(4)]
        assert sum(sum(s.values()) for s in sent) == wanted_by_engines
        assert [sum(x.values()) for x in received[:2]] == [0, 0] and [sum(x.values()) for x in sent[2:]] == [0, 0]
        assert sum(sum(x.values()) for x in received) == wanted_by_engines
        assert set(sent[0]) == set(sent[1]) == {2, 3}
    # The plan: made on the first call (the fingerprint round, then the metadata), kept on the second (the fingerprint
    # round of 17 words: 6 for the plan, whether the member wants and holds, 9 for versions, verification and deltas;
    # nothing else).
    for r in reports:
        cached0, rounds0, texts0 = r["fsdp_tp0"][2:4] + (r["fsdp_tp0"][5],)
        assert (cached0, rounds0, texts0) == (False, 1, 1), r["fsdp_tp0"]
        assert r["fsdp_tp1"][2:] == (True, 1, [17], 0), r["fsdp_tp1"]
    # TP2 -> TP4: ranks 0, 1 hold and want: each copies its own columns and receives the other half of its rows.
    for rank in range(4):
        sent, received = reports[rank]["tp2_tp4"]
        rows_bytes = 3 * 10 * 4 + 2 * 7 * 8
        if rank < 2:
            own = 3 * 5 * 4 + 2 * (4 if rank == 0 else 3) * 8
            assert sum(received.values()) == rows_bytes - own and rank not in received
        else:
            assert sum(received.values()) == rows_bytes and sent == {}
    # Replicas: every element sent once in all, by one of its two holders; every holder sends some of it.
    total_sent = sum(sum(reports[r]["replicas"][0].values()) for r in range(4))
    total_received = sum(sum(reports[r]["replicas"][1].values()) for r in range(4))
    assert total_sent == total_received == sum(reports[r]["replicas_remote"] for r in range(4))
    assert all(sum(reports[r]["replicas"][0].values()) > 0 for r in range(4)), [
        reports[r]["replicas"] for r in range(4)
    ]
    # Few K/V heads: ranks 0 and 1 hold everything and copy; 2 and 3 receive their rows once.
    assert sum(reports[2]["kv"][1].values()) == sum(reports[3]["kv"][1].values()) == (2 + 1 + 1) * 4 * 8 * 4
    assert reports[0]["kv"][1] == reports[1]["kv"][1] == {}
    # Tied: rank 0 sends the tensor once per wanted name.
    assert sum(reports[0]["tied"][0].values()) == (2 + 1 + 2) * 11 * 6 * 2


# ----------------------------------------------------------------------------------- refusals
def _refusals(rank: int, size: int, url: str) -> dict:
    """Each bad input on one or two members: every member raises the same error, no destination changes, and the mode
    then works."""
    from rlightning_comm import TensorSlice, reshard_state_dict

    ctx = init_world(rank, size, url)
    ctx.init_group([0, 1, 2, 3], MODE, timeout=30)
    full = _full(6, {"a": ((10, 4), torch.float32)})["a"]
    dst = _garbage((10, 4), torch.float32)
    small = [_garbage((2, 4), torch.float32) for _ in range(2)]
    before = [t.clone() for t in (dst, *small)]
    rows = lambda lo, hi: TensorSlice(full[lo:hi].clone(), (lo, 0), (10, 4))  # noqa: E731
    cases = {
        "uncovered": ({0: {"a": rows(0, 4)}, 1: {"a": rows(4, 8)}}, {2: {"a": TensorSlice(dst, (0, 0), (10, 4))}}, {}),
        "dtype": ({0: {"a": full.clone()}}, {2: {"a": TensorSlice(dst.view(torch.int32), (0, 0), (10, 4))}}, {}),
        "shape": ({0: {"a": full.clone()}}, {3: {"a": TensorSlice(small[0], (0, 0), (12, 4))}}, {}),
        "bounds": ({0: {"a": full.clone()}}, {2: {"a": TensorSlice(small[0], (9, 0), (10, 4))}}, {}),
        "overlap": (
            {0: {"a": full.clone()}},
            {1: {"a": [TensorSlice(small[0], (0, 0), (10, 4)), TensorSlice(small[1], (1, 0), (10, 4))]}},
            {},
        ),
        "type": ({0: {"a": full.clone()}, 3: {"a": 3}}, {2: {"a": TensorSlice(dst, (0, 0), (10, 4))}}, {}),
        "bucket": ({0: {"a": full.clone()}}, {2: {"a": TensorSlice(dst, (0, 0), (10, 4))}}, {0: 0}),
    }
    out: dict = {}
    for case, (held, wanted, buckets) in cases.items():
        try:
            reshard_state_dict(
                held=held.get(rank), wanted=wanted.get(rank), comm_mode=MODE, bucket_bytes=buckets.get(rank, 4096)
            )
            out[case] = (None, "", True)
        except (TypeError, ValueError) as err:
            untouched = all(_same(a, b) for a, b in zip((dst, *small), before))
            out[case] = (type(err).__name__, str(err), untouched)
    # The mode still works: the last refusal's transfer, as it should have been.
    report = reshard_state_dict(
        held={"a": full.clone()} if rank == 0 else None, wanted={"a": dst} if rank == 2 else None, comm_mode=MODE
    )
    out["after"] = _same(dst, full) if rank == 2 else report.sent == ({2: full.numel() * 4} if rank == 0 else {})
    return out


REFUSALS = {
    "uncovered": ("ValueError", r"'a': elements \[8:10, 0:4\] wanted by rank 2 are held by no member"),
    "dtype": (
        "ValueError",
        r"'a': the members disagree on its dtype or global shape "
        r"\(rank 0: torch.float32 \(10, 4\); rank 2: torch.int32 \(10, 4\)\)",
    ),
    "shape": ("ValueError", r"rank 3: torch.float32 \(12, 4\)"),
    "bounds": (
        "ValueError",
        r"rank 2: wanted\['a'\]: the slice is out of bounds in dimension 0: elements 9 to 11 of a global size of 10",
    ),
    "overlap": ("ValueError", r"rank 1: wanted\['a'\]: two wanted slices overlap .*region \[1:2, 0:4\]"),
    "type": ("TypeError", r"rank 3: held\['a'\]: expected a Tensor, DTensor or TensorSlice .*; got int"),
    "bucket": ("ValueError", r"rank 0: bucket_bytes must be a positive int; got 0"),
}


def test_refusals_reach_every_member_before_any_byte_moves(world4) -> None:
    import re

    reports = world4.run(_refusals, timeout=90)
    for case, (kind, pattern) in REFUSALS.items():
        seen = [r[case] for r in reports]
        assert all(s[0] == kind for s in seen), (case, seen)
        assert len({s[1] for s in seen}) == 1, (case, "the members' messages differ", seen)
        assert seen[0][1].startswith("reshard_state_dict: nothing was transferred; "), seen[0]
        assert re.search(pattern, seen[0][1]), (case, seen[0][1])
        assert all(s[2] for s in seen), (case, "a destination changed")
    assert all(r["after"] for r in reports), reports


# ----------------------------------------------------------------------------------- a member killed midway
KILL_TIMEOUT = 30.0  # the group's timeout: every survivor must raise long before it
BOUND = 6.0  # what a loaded 2-core machine may add
KILL_SHAPES = {f"w{i}": ((256, 64), torch.float32) for i in range(8)}


def _kill_group(rank: int, url: str, connected: bool):
    """4 members in a gloo group outside any world, or in a connected mode: holders 0 and 1 (row halves), wanters 2 (the
    victim) and 3 (column halves: blocks of 4 KiB)."""
    from datetime import timedelta

    import torch.distributed as dist

    from rlightning_comm import CommContext, GlooCommunicator

    if connected:  # member 0 hosts the mode's store and publishes its address
        import os
        import time
        from pathlib import Path

        path = Path(url.removeprefix("file://") + ".address")
        ctx = CommContext()
        if rank == 0:
            address = ctx.listen("127.0.0.1:0")
            Path(f"{path}.tmp").write_text(address)
            os.replace(f"{path}.tmp", path)
        else:
            deadline = time.monotonic() + 120
            while not path.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("member 0 did not publish the mode's address")
                time.sleep(0.01)
            address = path.read_text()
        return ctx.connect("KILL", rank=rank, world_size=4, address=address, timeout=KILL_TIMEOUT)
    store = dist.FileStore(url.removeprefix("file://") + ".kill", 4)
    store.set(f"ready/{rank}", "1")
    store.wait([f"ready/{r}" for r in range(4)], timedelta(seconds=120))
    group = dist.ProcessGroupGloo(dist.PrefixStore("group", store), rank, 4, timedelta(seconds=KILL_TIMEOUT))
    return GlooCommunicator(group, range(4), "KILL", timeout=KILL_TIMEOUT, rank=rank)


def _kill_args(member: int):
    from rlightning_comm import TensorSlice

    full = _full(7, KILL_SHAPES)
    held = wanted = None
    if member < 2:
        held = {
            n: TensorSlice(t[member * 128 : (member + 1) * 128].clone(), (member * 128, 0), (256, 64))
            for n, t in full.items()
        }
    else:
        c = member - 2
        wanted = {n: TensorSlice(_garbage((256, 32), torch.float32), (0, c * 32), (256, 64)) for n in full}
    return held, wanted


def _victim(url: str, connected: bool, point: str) -> None:
    """Member 2, in no world: it dies as it waits for its third chunk, the transfer in flight (``"midway"``), or once
    every byte it wants has arrived, before its receipts of the whole transfer (``"before-its-receipts"``)."""
    import os
    import signal

    from rlightning_comm.weights.reshard._call import reshard
    from rlightning_comm.weights.reshard._mover import Mover

    original, completed, receipt = Mover._complete_chunk, [], Mover._receipt

    def complete(self, chunk, launched):
        if point == "midway" and len(completed) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        original(self, chunk, launched)
        completed.append(1)

    def final_receipt(self, peer):
        if point != "midway" and len(completed) == len(self._s.chunks):  # after the last chunk: a receipt of the whole
            os.kill(os.getpid(), signal.SIGKILL)
        return receipt(self, peer)

    Mover._complete_chunk = complete
    Mover._receipt = final_receipt
    held, wanted = _kill_args(2)
    reshard(_kill_group(2, url, connected), held, wanted, 4096)


def _killed(rank: int, size: int, url: str, connected: bool, point: str) -> dict | None:
    import subprocess
    import sys
    import time

    from rlightning_comm.weights.reshard._call import reshard

    if rank == 3:
        return None
    member = {0: 0, 1: 1, 2: 3}[rank]
    victim = None
    if rank == 0:
        code = (
            f"import sys; sys.path[:0] = {sys.path!r}; import test_reshard as t; "
            f"t._victim({url!r}, {connected!r}, {point!r})"
        )
        victim = subprocess.Popen([sys.executable, "-c", code])
    try:
        comm = _kill_group(member, url, connected)
        held, wanted = _kill_args(member)
        start = time.monotonic()
        try:
            reshard(comm, held, wanted, 4096)
            report = {"type": None}
        except RuntimeError as err:
            report = {"type": type(err).__name__, "msg": str(err)}
        report["elapsed"] = time.monotonic() - start
    finally:
        if victim is not None:
            try:
                victim.wait(timeout=60)
            except subprocess.TimeoutExpired:
                victim.kill()  # by its pid: ours
                victim.wait(timeout=10)
    if victim is not None:
        report["victim"] = victim.returncode
    return report


@pytest.mark.parametrize(
    ("connected", "point"),
    [(False, "midway"), (True, "midway"), (False, "before-its-receipts")],
    ids=["group", "connected-mode", "group-before-its-receipts"],
)
def test_a_member_killed_midway_fails_every_survivor_fast_saying_what_it_left(world4, connected, point) -> None:
    import re
    import signal

    env = {"GLOO_SOCKET_IFNAME": "lo"} if connected else {}
    holder0, holder1, survivor, _ = world4.run(_killed, connected, point, timeout=150, env=env)
    assert holder0["victim"] == -signal.SIGKILL, holder0
    # A connected mode's watch names the lost member (PeerLostError); a plain group says a peer is gone (CommError).
    expected = "PeerLostError" if connected else "CommError"
    # No member forwards in a reshard: every source waits for each destination's own receipt of the whole transfer, so
    # a source never returns while a destination it sent to died before confirming, even with every byte delivered.
    for r in (holder0, holder1):
        assert r["type"] == expected and r["elapsed"] <= BOUND < KILL_TIMEOUT, r
        assert "reshard_state_dict failed midway: " in r["msg"], r
        assert "the transfer with rank 2 failed; destinations at ranks [2, 3] may hold partial weights" in r["msg"], r
    if point == "before-its-receipts":  # the survivor had everything it wants, and said so: it may return
        assert survivor["type"] in (None, expected) and survivor["elapsed"] <= BOUND, survivor
        return
    assert survivor["type"] == expected and survivor["elapsed"] <= BOUND, survivor
    assert "reshard_state_dict failed midway: " in survivor["msg"], survivor
    # The survivor had unpacked some buckets: it names what it partly wrote and what it did not touch.
    assert re.search(r"this member's wanted tensors \[.*'w0'.*\] may be partly written", survivor["msg"]), survivor


# ----------------------------------------------------------------------------------- a connected mode across worlds
def _connected(rank: int, size: int, url: str) -> dict:
    """Ranks 0, 1: a trainer world; 2, 3: an engine world; a connected mode of all four. The trainer holds row halves,
    the engine wants a column-parallel fused pair and a row-parallel weight; twice (the second reuses the plan)."""
    import os
    import time
    from pathlib import Path

    from rlightning_comm import CommContext, TensorSlice, reshard_state_dict
    from rlightning_comm.weights import layouts

    world, local = divmod(rank, 2)
    init_world(local, 2, f"{url}-{'trainer' if world == 0 else 'engine'}")
    ctx = CommContext()
    path = url.removeprefix("file://") + ".address"
    if rank == 0:
        address = ctx.listen("127.0.0.1:0")
        Path(path + ".tmp").write_text(address)
        os.replace(path + ".tmp", path)
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 did not publish its address")
            time.sleep(0.01)
        address = Path(path).read_text()
    ctx.connect("SYNC", rank=rank, world_size=4, address=address, timeout=60)
    wrong, reports = [], []
    for step in range(2):
        full = _full(
            10 + step,
            {"gate": ((12, 8), torch.float32), "up": ((12, 8), torch.float32), "down": ((8, 12), torch.float32)},
        )
        held = wanted = None
        if world == 0:
            held = {
                n: TensorSlice(
                    t[local * (t.shape[0] // 2) : (local + 1) * (t.shape[0] // 2)].clone(),
                    (local * (t.shape[0] // 2), 0),
                    tuple(t.shape),
                )
                for n, t in full.items()
            }
        else:
            gate_up, down = _garbage((12, 8), torch.float32), _garbage((8, 6), torch.float32)
            wanted = {
                **layouts.fused(gate_up, {"gate": 12, "up": 12}, local, 2),
                "down": layouts.row_parallel(down, local, 2),
            }
        report = reshard_state_dict(held=held, wanted=wanted, comm_mode="SYNC", bucket_bytes=128)
        reports.append((dict(report.sent), dict(report.received), report.plan_cached))
        if world == 1:
            rows = slice(local * 6, local * 6 + 6)
            if not _same(gate_up, torch.cat([full["gate"][rows], full["up"][rows]])):
                wrong.append(f"step {step}: gate_up")
            if not _same(down, full["down"][:, local * 6 : local * 6 + 6]):
                wrong.append(f"step {step}: down")
    return {"wrong": wrong, "reports": reports}


def test_a_connected_mode_across_two_worlds(world4) -> None:
    results = world4.run(_connected, env={"GLOO_SOCKET_IFNAME": "lo"}, timeout=120)
    for rank, r in enumerate(results):
        assert r["wrong"] == [], (rank, r["wrong"])
        assert [cached for _, _, cached in r["reports"]] == [False, True], r
    # Each engine wants 6 + 6 rows of 8 and 8 rows of 6 (float32): 480 bytes, from both trainers.
    for rank in (2, 3):
        for _, received, _ in results[rank]["reports"]:
            assert sorted(received) == [0, 1] and sum(received.values()) == (12 * 8 + 8 * 6) * 4
