"""The schedule of reshard_state_dict in one process: every wanted element covered exactly once by pieces its holders
hold, replicas' load spread, at most two buffers per member per chunk; and the engine layouts of weights.layouts
against explicit row and column ranges."""

from __future__ import annotations

import random

import pytest
import torch

from rlightning_comm import TensorSlice
from rlightning_comm.weights import layouts
from rlightning_comm.weights.reshard._schedule import build_schedule


def _strides(shape):
    out, n = [], 1
    for s in reversed(shape):
        out.append(n)
        n *= s
    return list(reversed(out))


def _block(off, shape, strides=None):
    return [list(off), list(shape), strides or _strides(shape), True]


def _meta(name, shape, held, wanted, dtype="torch.float32"):
    return [name, dtype, list(shape), held, wanted]


def _random_blocks(rng, shape, parts):
    """``parts`` disjoint row-and-column blocks tiling ``shape``."""
    rows = sorted(rng.sample(range(1, shape[0]), parts[0] - 1))
    cols = sorted(rng.sample(range(1, shape[1]), parts[1] - 1))
    r, c = [0, *rows, shape[0]], [0, *cols, shape[1]]
    return [((r[i], c[j]), (r[i + 1] - r[i], c[j + 1] - c[j])) for i in range(len(r) - 1) for j in range(len(c) - 1)]


@pytest.mark.parametrize("seed", range(6))
def test_every_wanted_element_comes_exactly_once_from_a_member_that_holds_it(seed):
    rng = random.Random(seed)
    shape = (rng.randint(8, 40), rng.randint(8, 40))
    members = 6
    holds = {m: [] for m in range(members)}
    # Member 0 the whole tensor, members 1-2 one tiling, members 3-4 another (overlapping, not lined up), 5 nothing.
    holds[0] = [((0, 0), shape)]
    for group, parts in (((1, 2), (2, 3)), ((3, 4), (3, 2))):
        for k, block in enumerate(_random_blocks(rng, shape, parts)):
            holds[group[k % 2]].append(block)
    wants = {m: [b for b in _random_blocks(rng, shape, (2, 2)) if rng.random() < 0.7] for m in range(members)}
    metas = [
        [_meta("t", shape, [_block(*b) for b in holds[m]], [_block(*b) for b in wants[m]])]
        if holds[m] or wants[m]
        else []
        for m in range(members)
    ]
    schedules = [build_schedule(metas, 256, list(range(members)), m) for m in range(members)]
    sent = [0] * members
    for me, s in enumerate(schedules):
        count = torch.zeros(shape, dtype=torch.int64)
        pieces = [
            *s.copies,
            *(p for p in s.direct if p.dst == me),
            *(p for c in s.chunks for b in c if b.dst == me for p in b.pieces),
        ]
        for p in pieces:
            (off, size) = holds[p.src][p.src_block]
            assert all(o <= lo and hi <= o + n for o, n, lo, hi in zip(off, size, p.lo, p.hi)), (p, holds[p.src])
            (woff, wsize) = wants[me][p.dst_block]
            assert all(o <= lo and hi <= o + n for o, n, lo, hi in zip(woff, wsize, p.lo, p.hi))
            count[p.lo[0] : p.hi[0], p.lo[1] : p.hi[1]] += 1
            if p.src != me:
                sent[p.src] += p.nbytes
        expected = torch.zeros(shape, dtype=torch.int64)
        for (r, c), (h, w) in wants[me]:
            expected[r : r + h, c : c + w] = 1
        assert torch.equal(count, expected), (seed, me)
        assert sum(s.received.values()) == sum(p.nbytes for p in pieces if p.src != me)
        for chunk in s.chunks:
            assert max((b.at(me) + b.nbytes for b in chunk if b.staged(me)), default=0) <= 256
    assert sent == [sum(s.sent.values()) for s in schedules]


def test_replicas_spread_the_load_and_a_member_copies_what_it_holds():
    shape, holders, wanters = (64, 8), 4, 8
    metas = [[_meta("t", shape, [_block((0, 0), shape)], [])] for _ in range(holders)]
    metas += [[_meta("t", shape, [], [_block((8 * w, 0), (8, 8))])] for w in range(wanters)]
    metas[0][0][4] = [_block((0, 0), (8, 8))]  # holder 0 also wants rows 0:8: it copies them
    schedules = [build_schedule(metas, 1 << 20, list(range(12)), m) for m in range(12)]
    assert [sum(s.sent.values()) for s in schedules[:holders]] == [2 * 8 * 8 * 4] * holders
    assert len(schedules[0].copies) == 1 and schedules[0].received == {}


def test_a_wanted_region_no_one_holds_is_named():
    metas = [[_meta("t", (10, 4), [_block((0, 0), (8, 4))], [])], [_meta("t", (10, 4), [], [_block((0, 0), (10, 4))])]]
    with pytest.raises(ValueError, match=r"'t': elements \[8:10, 0:4\] wanted by rank 7 are held by no member"):
        build_schedule(metas, 1024, [3, 7], 0)


def test_strided_destinations_are_staged_and_contiguous_ones_move_in_place():
    # A row block contiguous on both sides moves in place; a column block of a row-major tensor is staged.
    metas = [
        [
            _meta("rows", (512, 256), [_block((0, 0), (512, 256))], []),
            _meta("cols", (512, 256), [_block((0, 0), (512, 256))], []),
        ],
        [
            _meta("rows", (512, 256), [], [_block((256, 0), (256, 256))]),
            _meta("cols", (512, 256), [], [_block((0, 128), (512, 128))]),
        ],
    ]
    s = build_schedule(metas, 64 * 1024, [0, 1], 1)
    assert [p.name for p in s.direct] == ["rows"]
    assert {p.name for c in s.chunks for b in c for p in b.pieces} == {"cols"}
    assert s.slot_bytes <= 64 * 1024 and s.received == {0: (256 * 256 + 512 * 128) * 4}


def test_one_receipt_per_pair_and_chunk_and_none_in_a_sources_last_two_chunks():
    # Row halves to column halves of 8 fp32 tensors 512 x 512, in buckets of 1 MiB: each piece (256 KiB, strided on
    # its holder, contiguous where it goes) is staged by its holder only, four to a chunk, two of each pair.
    names = [f"t{i}" for i in range(8)]
    holders = [[_meta(n, (512, 512), [_block((256 * h, 0), (256, 512))], []) for n in names] for h in range(2)]
    wanters = [[_meta(n, (512, 512), [], [_block((0, 256 * w), (512, 256))]) for n in names] for w in range(2)]
    metas = [*holders, *wanters]
    schedules = [build_schedule(metas, 1 << 20, [0, 1, 2, 3], m) for m in range(4)]
    for src in (0, 1):
        chunks = schedules[src].chunks
        owed = []
        for k, chunk in enumerate(chunks):
            for dst in (2, 3):
                pair = [b for b in chunk if (b.src, b.dst) == (src, dst)]
                acknowledged = [i for i, b in enumerate(pair) if b.receipt]
                if k + 2 >= len(chunks):
                    assert acknowledged == [], (src, k)  # the receipt of the whole transfer covers them
                elif pair:
                    assert acknowledged == [len(pair) - 1], (src, k, dst)  # the pair's last bucket, alone
                    owed.append(len(pair))
        assert max(owed) > 1  # the plan does put several buckets of one pair in a chunk
        # The destinations' schedules say the same of every bucket they receive.
        mine = {(b.src, b.dst, b.pieces): b.receipt for c in chunks for b in c}
        theirs = {(b.src, b.dst, b.pieces): b.receipt for d in (2, 3) for c in schedules[d].chunks for b in c}
        assert {k: v for k, v in theirs.items() if k[0] == src} == mine


# ----------------------------------------------------------------------------------- layouts
def test_column_row_and_replicated():
    t = torch.zeros(3, 5)
    for made, expected in (
        (layouts.column_parallel(t, 2, 4), ((6, 0), (12, 5))),
        (layouts.row_parallel(t, 1, 2), ((0, 5), (3, 10))),
        (layouts.replicated(t), ((0, 0), (3, 5))),
    ):
        assert isinstance(made, TensorSlice) and made.tensor is t and (made.offsets, made.global_shape) == expected
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\); got 2"):
        layouts.column_parallel(t, 2, 2)


def test_fused_gate_up_views_the_engine_parameter():
    local = torch.arange(10 * 3).reshape(10, 3)
    out = layouts.fused(local, {"gate": 12, "up": 8}, 1, 2)
    assert out["gate"].offsets == (6, 0) and out["gate"].global_shape == (12, 3)
    assert out["up"].offsets == (4, 0) and out["up"].global_shape == (8, 3)
    assert out["gate"].tensor.data_ptr() == local.data_ptr() and torch.equal(out["up"].tensor, local[6:])
    with pytest.raises(ValueError, match="expected 10 rows"):
        layouts.fused(torch.zeros(9, 3), {"gate": 12, "up": 8}, 1, 2)
    with pytest.raises(ValueError, match="not divisible"):
        layouts.fused(local, {"gate": 13, "up": 7}, 1, 2)


@pytest.mark.parametrize(("world", "kv", "heads"), [(2, 4, 8), (4, 2, 8), (8, 1, 8), (4, 4, 4)])
def test_qkv_rows_match_vllm_partitioning(world, kv, heads):
    hd = 2
    for rank in range(world):
        kv_local = max(1, kv // world)
        local = torch.zeros((heads // world + 2 * kv_local) * hd, 5)
        out = layouts.qkv(local, rank, world, names=("q", "k", "v"), num_heads=heads, num_kv_heads=kv, head_dim=hd)
        # vLLM: with fewer K/V heads than ranks, each is replicated on world / kv ranks: rank r holds r // (world / kv).
        first_kv = rank * kv // world if kv >= world else rank // (world // kv)
        assert out["q"].offsets == (rank * heads // world * hd, 0) and out["q"].global_shape == (heads * hd, 5)
        assert out["k"].offsets == out["v"].offsets == (first_kv * hd, 0)
        assert out["k"].tensor.shape[0] == kv_local * hd and out["v"].global_shape == (kv * hd, 5)


@pytest.mark.parametrize(("world", "vocab", "padding"), [(2, 1000, 64), (4, 100, 64), (2, 128, 64), (3, 90, 10)])
def test_vocab_parallel_rows_match_vllm_padding(world, vocab, padding):
    padded = -(-vocab // padding) * padding
    rows = padded // world
    covered = []
    for rank in range(world):
        local = torch.zeros(rows, 3)
        out = layouts.vocab_parallel(local, rank, world, vocab, padding=padding)
        # vLLM's VocabParallelEmbedding: rank r's org rows are [r * rows, min((r + 1) * rows, vocab)), padding after.
        start, end = min(rank * rows, vocab), min((rank + 1) * rows, vocab)
        assert out.offsets == (start, 0) and out.global_shape == (vocab, 3)
        assert out.tensor.shape == (end - start, 3) and out.tensor.data_ptr() == local.data_ptr()
        covered += range(start, end)
    assert covered == list(range(vocab))
    with pytest.raises(ValueError, match="expected 512 rows"):
        layouts.vocab_parallel(torch.zeros(500, 3), 0, 2, 1000)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 3"):
        layouts.vocab_parallel(torch.zeros(5, 3), 0, 3, 1000)
