"""The delta encoding (rlightning_comm/weights/_delta.py) against an oracle: the whole tensors compared in one process.

The oracle reads the raw bytes of both tensors with numpy, element by element, and never calls the library: which
elements differ, and what the tensor must be after a delta is applied. Every dtype, 0-d and empty tensors, strided
views, NaN payloads and signed zeros, and every kind of record (same, sparse, mask, dense).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from rlightning_comm.weights.delta import _changes, _writes
from rlightning_comm.weights.delta import _encoding as _delta

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def _bytes(t: torch.Tensor) -> np.ndarray:
    """The oracle's view: each element's raw bytes, one row per element in row-major order."""
    t = t.resolve_conj().resolve_neg().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, dtype=np.uint8)
    return raw.reshape(t.numel(), t.element_size())


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of random bytes (any bit pattern: NaNs with payloads, signed zeros, subnormals)."""
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def _changed(snap: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """``snap`` with ``fraction`` of its elements given other random bytes (at least one, if any)."""
    cur = snap.clone()
    n = cur.numel()
    k = min(n, max(1, round(n * fraction))) if fraction and n else 0
    if k:
        flat = cur.view(-1) if cur.is_contiguous() else None
        idx = torch.randperm(n, generator=gen)[:k]
        fresh = _random((k,), cur.dtype, gen)
        assert flat is not None
        flat[idx] = fresh
    return cur


def _roundtrip(cur_view: torch.Tensor, snap: torch.Tensor, target: torch.Tensor) -> tuple[list, _changes.Change]:
    """Encode ``cur_view`` against ``snap`` (its words, flat), decode, apply to ``target`` (holding ``snap``'s
    values)."""
    cur = _changes.record_words([_changes.words(cur_view)])  # a strided piece compared where it lies
    base = _changes.flat([_changes.words(snap)])
    sections, change = _delta.encode(cur, base)
    payload = torch.cat(sections)
    decoded, end = _delta.decode(payload, 0, cur.numel(), cur.dtype)
    assert end == payload.numel()
    into = _writes.writable(target)
    words = _changes.words(into)
    _writes.apply([[words]], [words.numel()], decoded)
    if into is not target:
        target.copy_(into)
    return sections, change


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fraction", [0.0, 1e-4, 0.02, 0.3, 1.0])
def test_a_delta_applied_to_the_snapshot_gives_the_tensor_bit_for_bit(dtype: torch.dtype, fraction: float) -> None:
    gen = torch.Generator().manual_seed(hash((str(dtype), fraction)) % 2**31)
    for shape in [(), (0,), (7,), (3, 5), (2, 3, 4), (70_001,)]:
        snap = _random(shape, dtype, gen)
        cur = _changed(snap, fraction, gen)
        target = snap.clone()
        _roundtrip(cur, snap, target)
        assert np.array_equal(_bytes(target), _bytes(cur)), (shape, fraction)
        # The positions the library found are the oracle's (in words: two per 16-byte element).
        differs = np.flatnonzero((_bytes(cur) != _bytes(snap)).any(axis=1)) if cur.numel() else np.zeros(0)
        pos = _changes.diff(_changes.flat([_changes.words(cur)]), _changes.flat([_changes.words(snap)])).numpy()
        per = max(1, cur.element_size() // 8)
        assert np.array_equal(np.unique(pos // per), differs), (shape, fraction)


def test_bits_not_values_decide_what_changed() -> None:
    """-0.0 against +0.0, and NaNs of different payloads, are changes; the same NaN bits are not."""
    snap = torch.tensor([0.0, 1.0, float("nan"), float("nan"), 2.0], dtype=torch.float32)
    cur = snap.clone()
    cur[0] = -0.0
    words = cur.view(torch.int32)
    words[2] = words[2] | 1  # another NaN payload
    cur_w, snap_w = _changes.words(cur), _changes.words(snap)
    assert _changes.diff(cur_w, snap_w).tolist() == [0, 2]
    target = snap.clone()
    _roundtrip(cur, snap, target)
    assert torch.equal(target.view(torch.int32), cur.view(torch.int32))
    bf = torch.tensor([-0.0, 0.0], dtype=torch.bfloat16)
    assert _changes.diff(_changes.words(bf), _changes.words(torch.zeros(2, dtype=torch.bfloat16))).tolist() == [0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex128, torch.int8], ids=str)
def test_strided_lazy_and_tied_targets_are_written_in_place(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    base = _random((40, 30), dtype, gen)
    snap = base.t()  # a transposed view: strided
    cur = _changed(snap.contiguous(), 0.1, gen).t().contiguous().t()  # the new values, strided as well
    storage = base.clone()
    target = storage.t()
    _roundtrip(cur, snap, target)
    assert np.array_equal(_bytes(target), _bytes(cur))
    if dtype.is_complex:  # a lazy conjugate: written through its values
        lazy_base = snap.conj().resolve_conj().conj()  # memory holds conj(snap); reads as snap
        assert lazy_base.is_conj()
        _roundtrip(cur, snap, lazy_base)
        assert np.array_equal(_bytes(lazy_base), _bytes(cur))
    if dtype.is_floating_point:  # a lazy negation (finite values: torch negates a bfloat16 NaN through float32)
        snap = torch.randn(30, 40, generator=gen).to(dtype)
        cur = snap.clone()
        cur[::3, ::7] += 1
        neg = torch._neg_view(-snap)  # memory holds -snap; reads as snap
        _roundtrip(cur, snap, neg)
        assert np.array_equal(_bytes(neg), _bytes(cur))


def test_each_record_takes_its_smallest_kind_and_the_bytes_say_so() -> None:
    gen = torch.Generator().manual_seed(5)
    n = 3 * _changes.BLOCK + 11
    snap = _random((n,), torch.bfloat16, gen)
    for fraction, kind in [(0.0, _changes.SAME), (0.01, _changes.SPARSE), (0.4, _changes.MASK), (1.0, _changes.DENSE)]:
        cur = _changed(snap, fraction, gen)
        sections, change = _delta.encode(_changes.words(cur), _changes.words(snap))
        assert change.kind == kind, fraction
        nbytes = sum(s.numel() for s in sections)
        k = int((_bytes(cur) != _bytes(snap)).any(axis=1).sum())
        assert nbytes == (_changes.HEADER if kind == _changes.SAME else min(_changes.sizes(n, k, 2))), fraction
        if kind == _changes.SPARSE:  # values and 16-bit positions, a count per block: within 1.2x of the changed bytes
            assert nbytes <= 1.2 * (k * 2 + k * 2) + 64, (nbytes, k)


def test_a_record_of_another_length_or_damaged_bytes_is_refused() -> None:
    snap = torch.zeros(1000, dtype=torch.float32)
    cur = snap.clone()
    cur[::7] = 1.0
    payload = torch.cat(_delta.encode(_changes.words(cur), _changes.words(snap))[0])
    with pytest.raises(ValueError, match="expected 999 words"):
        _delta.decode(payload, 0, 999, torch.int32)
    with pytest.raises(ValueError, match="out of range"):
        _delta.decode(payload[:16], 0, 1000, torch.int32)
    bad = payload.clone()
    bad[8:16].view(torch.int64)[0] = 5000  # more changed words than the record has
    with pytest.raises(ValueError):
        _delta.decode(bad, 0, 1000, torch.int32)


def test_small_tensors_share_records_by_word_size_and_key() -> None:
    small, big = _delta.SMALL // 4, _delta.SMALL
    pieces = [
        (torch.float32, small, None),
        (torch.float32, big, None),
        (torch.bfloat16, small, None),
        (torch.float32, small, None),
        (torch.float32, 0, None),
        (torch.int32, small, None),  # the same word size as float32: one record
        (torch.float32, small, "other"),
    ]
    recs = _delta.records(pieces)
    assert [r.pieces for r in recs] == [(1,), (0, 3, 5), (2,), (6,)]
    assert all(r.words == sum(r.sizes) for r in recs)
    many = _delta.records([(torch.float32, small, None)] * 9)  # a record holds at most SMALL words
    assert [len(r.pieces) for r in many] == [4, 4, 1]


def test_words_at_any_offset_compare_alike() -> None:
    """Records whose memory does not start on 8 bytes (a slice of a larger tensor) are compared word by word."""
    gen = torch.Generator().manual_seed(9)
    for dtype in (torch.bfloat16, torch.int8, torch.float32):
        base = _random((203,), dtype, gen)
        snap = base.clone()
        cur = _changed(snap, 0.1, gen)
        for lo, hi in [(1, 201), (3, 19), (0, 200)]:
            target = snap.clone()
            _roundtrip(cur[lo:hi], snap[lo:hi], target[lo:hi])
            assert np.array_equal(_bytes(target[lo:hi]), _bytes(cur[lo:hi])), (dtype, lo, hi)
            assert np.array_equal(_bytes(target[:lo]), _bytes(snap[:lo])), (dtype, lo, hi)  # nothing else written


@pytest.mark.parametrize("fraction", [0.0, 0.02, 0.3, 1.0])
def test_without_numpy_the_host_takes_torch_ops_alike(monkeypatch, fraction: float) -> None:
    """The library runs without numpy: the bit work then goes through torch ops on the host, with the same bytes."""
    gen = torch.Generator().manual_seed(13)
    cases = []
    for dtype in (torch.bfloat16, torch.float32, torch.int8, torch.complex64):
        snap = _random((3, 70_001), dtype, gen)
        cases.append((snap, _changed(snap, fraction, gen)))
    with_numpy = [torch.cat(_delta.encode(_changes.words(c).view(-1), _changes.words(s).view(-1))[0]) for s, c in cases]
    monkeypatch.setattr(_changes, "np", None)
    for (snap, cur), expected in zip(cases, with_numpy):
        target = snap.clone()
        sections, _ = _roundtrip(cur, snap, target)
        assert np.array_equal(_bytes(target), _bytes(cur)), (cur.dtype, fraction)
        assert torch.equal(torch.cat(sections), expected), (cur.dtype, fraction)  # the same bytes either way


def _oracle_kind(n: int, k: int, item: int) -> int:
    """The kind of fewest bytes for ``k`` changed words of ``n`` (dense on a tie with either, then sparse)."""
    if k == 0:
        return _changes.SAME
    sparse, mask, dense = _changes.sizes(n, k, item)
    if dense <= min(sparse, mask):
        return _changes.DENSE
    return _changes.SPARSE if sparse <= mask else _changes.MASK


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float64, torch.complex64], ids=str)
@pytest.mark.parametrize("fraction", [0.0, 0.005, 0.02, 0.07, 0.3, 0.9, 1.0])
def test_the_one_pass_finds_the_exact_changes_and_the_kind_of_fewest_bytes(dtype: torch.dtype, fraction: float) -> None:
    """Against numpy's comparison of the whole words: the positions, the new words, the kind, a mask's bits; with one
    scratch shared by every record, as a snapshot shares it (a record's flags never leak into another's change)."""
    gen = torch.Generator().manual_seed(hash((str(dtype), fraction)) % 2**31)
    scratch = _changes.Scratch()
    base = _random((96, 64), dtype, gen)
    layouts = [lambda t: t, lambda t: t[:, 16:48], lambda t: t.view(-1)[3:-5]]  # contiguous, a column block, unaligned
    found = []
    for layout in layouts:
        cur = layout(_changed(base, fraction, gen))
        snap = _changes.flat([_changes.words(layout(base))])
        words = _changes.record_words([_changes.words(cur)])
        found.append((cur, snap, _changes.change_of(words, snap, scratch)))
    for cur, snap, change in found:  # checked once every record shared the scratch
        now = _changes.flat([_changes.words(cur)]).numpy()
        flags = now != snap.numpy()
        pos = np.flatnonzero(flags)
        n, item = now.size, now.itemsize
        assert change.kind == _oracle_kind(n, pos.size, item), (fraction, pos.size, n)
        if change.kind == _changes.DENSE:
            assert np.array_equal(change.vals.numpy(), now)
            continue
        assert np.array_equal(change.pos.numpy(), pos)
        assert np.array_equal(change.vals.numpy(), now[pos])
        if change.kind == _changes.MASK:
            assert np.array_equal(change.bits.numpy(), np.packbits(flags, bitorder="little"))


@pytest.mark.parametrize("host", ["numpy", "torch"])
def test_a_mask_packed_from_its_positions_is_the_packed_flags(monkeypatch, host: str) -> None:
    if host == "torch":
        monkeypatch.setattr(_changes, "np", None)
    rng = np.random.default_rng(3)
    for n in (1, 7, 8, 9, 1000, 4099):
        for p in (0.0, 0.1, 0.6, 1.0):
            flags = rng.random(n) < p
            bits = _changes.bits_at(torch.from_numpy(np.flatnonzero(flags)), n)
            assert np.array_equal(bits.numpy(), np.packbits(flags, bitorder="little")), (n, p)


def test_the_snapshot_takes_on_changes_only_once_the_sync_succeeded() -> None:
    """The comparison writes a record's scattered changes into the snapshot at once: they stand after ``advance``, and
    are undone before the snapshot is next used when the sync did not succeed (its version and words as they were)."""
    from rlightning_comm.weights.delta._snapshots import Snapshot

    gen = torch.Generator().manual_seed(21)
    tensors = [_random((300, 256), torch.float32, gen), _random((70_000,), torch.bfloat16, gen)]
    recs = _delta.records([(t.dtype, t.numel(), None) for t in tensors])
    snap = Snapshot("k", recs)

    def views(record):
        return [_changes.words(tensors[i]) for i in record.pieces]

    def words_of() -> list[np.ndarray]:
        return [f.numpy().copy() for f in snap.flats]

    snap.take(views, 1)
    v1 = words_of()
    for t in tensors:
        t.copy_(_changed(t, 0.02, gen))
    offer = snap.offer(views, torch.device("cpu"), 2**62)
    assert offer.base == 1 and {c.kind for c in offer.changes} == {_changes.SPARSE}
    assert snap.base("k") == 1  # the sync failed: the snapshot is version 1 again, bit for bit
    assert all(np.array_equal(a, b) for a, b in zip(words_of(), v1))
    offer = snap.offer(views, torch.device("cpu"), 2**62)  # the retry, then success
    snap.advance(offer.changes, 2)
    assert snap.base("k") == 2
    now = [_changes.flat([_changes.words(t)]).numpy() for t in tensors]
    assert all(np.array_equal(a, b) for a, b in zip(words_of(), now))
    assert snap.scratch.nbytes > 0


def test_forgetting_the_deltas_frees_the_snapshot_and_its_scratch() -> None:
    from rlightning_comm.weights.core._memory import Kept
    from rlightning_comm.weights.delta._snapshots import Snapshot

    memory = Kept()
    memory.snapshot = Snapshot("k", [])
    scratch = memory.snapshot.scratch
    scratch.flags(torch.Size([1000]), torch.device("cpu"))
    memory.drop_delta()
    assert memory.snapshot is None and memory.held is None and memory.inbox is None
    assert sys.getrefcount(scratch) == 2  # this test's name and getrefcount's argument: nothing else holds it
