"""The delta encoding (rlightning_comm/weights/_delta.py) against an oracle: the whole tensors compared in one process.

The oracle reads the raw bytes of both tensors with numpy, element by element, and never calls the library: which
elements differ, and what the tensor must be after a delta is applied. Every dtype, 0-d and empty tensors, strided
views, NaN payloads and signed zeros, and every kind of record (same, sparse, mask, dense).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlightning_comm.weights import _changes, _delta

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
    into = _changes.writable(target)
    words = _changes.words(into)
    _changes.apply([[words]], [words.numel()], decoded)
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
