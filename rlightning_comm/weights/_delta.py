"""Lossless deltas: which words of a tensor changed since a snapshot, and the bytes that carry them.

A tensor is compared as its integer *words* (the integer dtype of its element size: ``int16`` for ``bfloat16``,
``int32`` for ``float32``, ``uint8`` for ``bool``; two ``int64`` per 16-byte element), so the comparison is of bits:
NaN payloads, ``-0.0`` and ``+0.0`` differ as their bytes do, never as their values. Small tensors of one word size are
grouped into one *record* (one set of torch ops for many of them); a record's words are compared with its snapshot in
one pass, and its changed words are encoded in the smallest of four kinds:

* ``same``: nothing changed (the header alone);
* ``sparse``: the record cut in blocks of 65,536 words, the number of changed words per block (``int32``), each changed
  word's position within its block (16 bits), then the changed words;
* ``mask``: one bit per word (set where it changed), then the changed words;
* ``dense``: every word.

A record's bytes: a header of four ``int64`` (kind, changed words, words, the record's bytes), then its sections, each
padded to 8 bytes. On the host the bit work goes through numpy (``packbits``, ``flatnonzero``: a pass at several GB/s,
where torch's ``nonzero`` is several times slower); on a device, torch ops.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np
import torch

BLOCK_BITS = 16
BLOCK = 1 << BLOCK_BITS  # words per block of a sparse record: a position within its block fits 16 bits
SMALL = 1 << 16  # a tensor of fewer words is grouped with its neighbours of the same word size
HEADER = 32  # bytes: kind, changed words, words, the record's bytes (int64 each)
SAME, SPARSE, MASK, DENSE = 0, 1, 2, 3
KINDS = ("same", "sparse", "mask", "dense")
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def word_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype a tensor of ``dtype`` is compared as (16-byte elements: two ``int64`` each)."""
    return _WORDS.get(dtype.itemsize, torch.int64)


def word_count(dtype: torch.dtype, numel: int) -> int:
    """How many words a tensor of ``dtype`` and ``numel`` elements has."""
    return numel * max(1, dtype.itemsize // 8) if dtype.itemsize > 8 else numel


def words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as integer words, of ``t``'s shape (a 0-d tensor as one word; 16-byte elements: the last dimension
    doubled), sharing its memory where its layout allows (a tensor with a lazy conjugate or negation is resolved first,
    into a copy: its words are its values')."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.dim() == 0:
        t = t.reshape(1)
    word = word_dtype(t.dtype)
    if t.element_size() > 8 and t.stride(-1) != 1:
        t = t.contiguous()
    return t.view(word)


def _align(n: int) -> int:
    return -(-n // 8) * 8


class Record(NamedTuple):
    """One unit of comparison: consecutive pieces of one word dtype, compared and encoded as one flat run of words."""

    pieces: tuple[int, ...]  # the caller's indices of its pieces, in order
    sizes: tuple[int, ...]  # words per piece
    word: torch.dtype

    @property
    def words(self) -> int:
        """Its words, every piece together."""
        return sum(self.sizes)


def records(pieces: Sequence[tuple[torch.dtype, int, Hashable]]) -> list[Record]:
    """The records of ``pieces`` (``(dtype, numel, key)`` per piece; pieces of no element skipped): a piece of at least
    :data:`SMALL` words alone, smaller ones grouped, in order, with the others of the same word dtype and ``key`` (the
    destinations they go to, say) up to :data:`SMALL` words. A pure function: every member computes the same."""
    out: list[Record] = []
    groups: dict[tuple[torch.dtype, Hashable], list[tuple[int, int]]] = {}  # (piece, words) of each open group
    filled: dict[tuple[torch.dtype, Hashable], int] = {}
    for i, (dtype, numel, key) in enumerate(pieces):
        n = word_count(dtype, numel)
        if n == 0:
            continue
        word = word_dtype(dtype)
        if n >= SMALL:
            out.append(Record((i,), (n,), word))
            continue
        mark = (word, key)
        group = groups.setdefault(mark, [])
        if group and filled[mark] + n > SMALL:
            out.append(Record(tuple(p for p, _ in group), tuple(m for _, m in group), word))
            group = groups[mark] = []
        filled[mark] = (filled[mark] if group else 0) + n
        group.append((i, n))
    for (word, _), group in groups.items():
        if group:
            out.append(Record(tuple(p for p, _ in group), tuple(m for _, m in group), word))
    return out


def flat(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """The words of ``views`` (word views, in order) as one flat tensor: the memory itself for one contiguous view, a
    copy otherwise."""
    if len(views) == 1:
        v = views[0]
        return v.view(-1) if v.is_contiguous() else v.reshape(-1)
    return torch.cat([v.reshape(-1) for v in views])


class Change(NamedTuple):
    """What changed in one record: the positions of its changed words (``None``: every word) and their new values."""

    kind: int
    pos: torch.Tensor | None
    vals: torch.Tensor


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS.get(device)
    if s is None:
        s = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return s


def _set_bits(bits: np.ndarray) -> np.ndarray:
    """The positions of the set bits of ``bits`` (little bit order), ascending, as int64.

    numpy's ``nonzero`` of a bool array writes its indices without a branch; of other dtypes it branches per element
    (several times slower where a few percent are set): the bytes are searched as bools, then only the nonzero ones
    unpacked (into 0 or 1 per bit: bools as they are).
    """
    nz = np.flatnonzero(bits != 0)
    j = np.flatnonzero(np.unpackbits(bits[nz], bitorder="little").view(np.bool_))
    return (nz[j >> 3] << 3) | (j & 7)


def _pack(m: torch.Tensor) -> torch.Tensor:
    """``m`` (bool, 1-D) as bits, little bit order, padded with zeros: ``ceil(len / 8)`` bytes."""
    if m.is_cpu:
        return torch.from_numpy(np.packbits(m.numpy(), bitorder="little"))
    n = m.numel()
    padded = torch.zeros(_align(n) if n % 8 else n, dtype=torch.uint8, device=m.device)
    padded[:n] = m
    return (padded.view(-1, 8) << _shifts(m.device)).sum(1, dtype=torch.uint8)


def _unpack(bits: torch.Tensor) -> torch.Tensor:
    """The positions of the set bits of ``bits`` (uint8, little bit order), ascending, as int64 on its device."""
    if bits.is_cpu:
        return torch.from_numpy(_set_bits(bits.numpy()))
    return ((bits.unsqueeze(1) >> _shifts(bits.device)) & 1).view(-1).nonzero().view(-1)


def record_words(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """The words of a record's pieces (word views) to compare: one piece as it is where its rows are contiguous (a
    strided block is compared where it lies, not copied), else the pieces' words flat (a copy)."""
    if len(views) == 1:
        v = views[0]
        if v.is_contiguous():
            return v.view(-1)
        if v.dim() > 1 and v.stride(-1) == 1:
            return v
    return flat(views)


def take(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The words of ``t`` (any strides) at its flat (row-major) positions ``pos``."""
    if t.is_contiguous():
        return t.reshape(-1).index_select(0, pos)
    index = torch.unravel_index(pos, t.shape)
    offsets = sum(i * s for i, s in zip(index, t.stride()))
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    return t.as_strided((span,), (1,)).index_select(0, offsets)


def _wide(t: torch.Tensor) -> int:
    """How many of ``t``'s words make an 8-byte word, where its rows and their starts allow (else 1)."""
    item = t.element_size()
    if item >= 8 or t.dim() == 0 or (t.shape[-1] * item) % 8:
        return 1
    if (t.storage_offset() * item) % 8 or any((s * item) % 8 for s in t.stride()[:-1]) or t.stride(-1) != 1:
        return 1
    return 8 // item


def diff(cur: torch.Tensor, snap: torch.Tensor) -> torch.Tensor:
    """The flat (row-major) positions of the words of ``cur`` that differ from ``snap``, ascending, as int64 on
    ``cur``'s device. ``cur`` is a record's words (:func:`record_words`), ``snap`` its snapshot (flat, contiguous).

    Words narrower than 8 bytes are compared 8 bytes at a time (a wider compare is faster, and leaves fewer flags to
    search); only the 8-byte words that differ are then told apart word by word.
    """
    snap = snap.view(cur.shape)
    wide = min(_wide(cur), _wide(snap))
    if wide == 1:
        return _changed(torch.ne(cur, snap))
    c64, s64 = cur.view(torch.int64), snap.view(torch.int64)
    at = _changed(torch.ne(c64, s64))
    changed = take(c64, at) ^ take(s64, at)
    j = _changed(changed.view(cur.dtype) != 0)
    shift = wide.bit_length() - 1
    return (at.index_select(0, j >> shift) << shift) | (j & (wide - 1))


def _changed(m: torch.Tensor) -> torch.Tensor:
    """The flat positions of the set flags of ``m`` (bool), ascending, as int64: on the host through their bits
    (numpy's ``packbits`` and a search of the nonzero bytes), on a device with ``nonzero``."""
    if m.is_cpu:
        return torch.from_numpy(_set_bits(np.packbits(m.numpy().reshape(-1), bitorder="little")))
    return m.reshape(-1).nonzero().view(-1)


def bitmap(pos: torch.Tensor, n: int) -> torch.Tensor:
    """The bits (little bit order, ``ceil(n / 8)`` bytes) of the positions ``pos`` among ``n``."""
    if pos.is_cpu:
        m = np.zeros(n, dtype=np.bool_)
        m[pos.numpy()] = True
        return torch.from_numpy(np.packbits(m, bitorder="little"))
    m = torch.zeros(n, dtype=torch.bool, device=pos.device)
    m[pos] = True
    return _pack(m)


def sizes(n: int, k: int, itemsize: int) -> tuple[int, int, int]:
    """The bytes of a record of ``n`` words with ``k`` changed, encoded ``sparse``, ``mask`` and ``dense``."""
    values = _align(k * itemsize)
    blocks = -(-n // BLOCK)
    return (
        HEADER + _align(4 * blocks) + _align(2 * k) + values,
        HEADER + _align(-(-n // 8)) + values,
        HEADER + _align(n * itemsize),
    )


def encode(cur: torch.Tensor, snap: torch.Tensor) -> tuple[list[torch.Tensor], Change]:
    """The bytes of ``cur``'s changes against ``snap`` (a record's words and their snapshot), as sections to
    concatenate, and the change itself (what the snapshot takes on once the sync succeeded)."""
    change = choose(cur, diff(cur, snap))
    return sections(cur, change), change


def choose(cur: torch.Tensor, pos: torch.Tensor) -> Change:
    """The change of a record whose changed words are at ``pos`` (ascending): its smallest kind, and the changed
    words' values (every word, for ``dense``)."""
    n, item, k = cur.numel(), cur.element_size(), pos.numel()
    if k == 0:
        return Change(SAME, pos, cur.new_empty(0))
    sparse, mask, dense = sizes(n, k, item)
    best = min(sparse, mask, dense)
    if best == dense:
        return Change(DENSE, None, cur.reshape(-1))
    if pos.device != cur.device:
        pos = pos.to(cur.device)
    return Change(SPARSE if best == sparse else MASK, pos, take(cur, pos))


def nbytes(change: Change, n: int, item: int) -> int:
    """The bytes of a record of ``n`` words of ``item`` bytes encoded as ``change``."""
    return HEADER if change.kind == SAME else sizes(n, change.vals.numel(), item)[change.kind - 1]


def sections(cur: torch.Tensor, change: Change) -> list[torch.Tensor]:
    """The bytes of ``change`` (of the record whose words are ``cur``), as sections to concatenate."""
    n, device = cur.numel(), cur.device
    size = nbytes(change, n, cur.element_size())
    if change.kind == SAME:
        return [_header(SAME, 0, n, size, device)]
    if change.kind == DENSE:
        return [_header(DENSE, n, n, size, device), _padded(change.vals)]
    pos, vals, k = change.pos, change.vals, change.vals.numel()
    if change.kind == MASK:
        return [_header(MASK, k, n, size, device), _padded(bitmap(pos, n)), _padded(vals)]
    blocks = -(-n // BLOCK)
    if pos.is_cpu:  # numpy's casts wrap: the low 16 bits
        p = pos.numpy()
        counts = torch.from_numpy(np.bincount(p >> BLOCK_BITS, minlength=blocks).astype(np.int32))
        offsets = torch.from_numpy(p.astype(np.uint16))
    else:
        counts = torch.bincount(pos >> BLOCK_BITS, minlength=blocks).to(torch.int32)
        low = pos & (BLOCK - 1)
        offsets = (low - ((low >> 15) << 16)).to(torch.int16)
    return [_header(SPARSE, k, n, size, device), _padded(counts), _padded(offsets), _padded(vals)]


def dense(cur: torch.Tensor) -> list[torch.Tensor]:
    """The sections of a record of ``cur``'s words (flat) sent whole: what a full sync of it carries in a delta's
    format."""
    n = cur.numel()
    return [_header(DENSE, n, n, sizes(n, n, cur.element_size())[2], cur.device), _padded(cur)]


def _header(kind: int, k: int, n: int, nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([kind, k, n, nbytes], dtype=torch.int64).view(torch.uint8).to(device)


def _padded(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, padded with zeros to a multiple of 8."""
    b = t.reshape(-1).view(torch.uint8)
    pad = _align(b.numel()) - b.numel()
    return b if not pad else torch.cat([b, b.new_zeros(pad)])


_NUMPY: dict[torch.dtype, np.dtype] = {}


def _np(word: torch.dtype) -> np.dtype:
    d = _NUMPY.get(word)
    if d is None:
        d = _NUMPY[word] = torch.empty(0, dtype=word).numpy().dtype
    return d


def decode(payload: torch.Tensor, at: int, n: int, word: torch.dtype) -> tuple[Change, int]:
    """The change of a record of ``n`` words of ``word`` encoded at byte ``at`` of ``payload`` (uint8), and where the
    next record starts. On the host the bytes are read through numpy (a dozen small torch calls per record cost more
    than the record).

    Raises:
        ValueError: the bytes there are not a record of ``n`` words (another sync's, or damaged).
    """
    size = payload.numel()
    if at % 8 or at + HEADER > size:
        raise ValueError(f"a delta record at byte {at} of {size}: out of range")
    host = payload.is_cpu
    raw = payload.numpy() if host else None
    head = (
        raw[at : at + HEADER].view(np.int64).tolist() if host else payload[at : at + HEADER].view(torch.int64).tolist()
    )
    kind, k, got, nbytes = head
    item = word.itemsize
    fits = got == n and kind in (SAME, SPARSE, MASK, DENSE) and 0 <= k <= n and at + nbytes <= size
    if not fits or (kind == SAME) != (k == 0) or (kind == DENSE and nbytes != sizes(n, n, item)[2]):
        raise ValueError(f"a delta record at byte {at}: kind {kind}, {k} of {got} words changed; expected {n} words")
    if kind in (SPARSE, MASK) and nbytes != sizes(n, k, item)[kind - 1]:
        raise ValueError(f"a delta record at byte {at}: {nbytes} bytes, not those of {k} changed words of {n}")
    body, end = at + HEADER, at + nbytes

    def read(a: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        if host:
            return torch.from_numpy(raw[a : a + count * dtype.itemsize].view(_np(dtype)))
        return payload[a : a + count * dtype.itemsize].view(dtype)

    if kind == SAME:
        return Change(SAME, payload.new_empty(0, dtype=torch.int64), payload.new_empty(0, dtype=word)), end
    if kind == DENSE:
        return Change(DENSE, None, read(body, n, word)), end
    values = read(end - _align(k * item), k, word)
    blocks = -(-n // BLOCK)
    if kind == MASK:
        pos = _unpack(read(body, -(-n // 8), torch.uint8))
    elif host:
        counts = raw[body : body + 4 * blocks].view(np.int32)
        low = raw[body + _align(4 * blocks) : body + _align(4 * blocks) + 2 * k].view(np.uint16)
        if counts.min(initial=0) < 0 or int(counts.sum()) != k:
            raise ValueError(f"a delta record at byte {at}: its blocks do not hold {k} changed words")
        pos = torch.from_numpy(np.repeat(np.arange(blocks, dtype=np.int64) << BLOCK_BITS, counts) + low)
    else:
        counts = read(body, blocks, torch.int32).long()
        low = read(body + _align(4 * blocks), k, torch.int16).long() & (BLOCK - 1)
        pos = torch.repeat_interleave(torch.arange(blocks, device=payload.device) << BLOCK_BITS, counts) + low
    if pos.numel() != k or (k and int(pos[-1]) >= n):
        raise ValueError(f"a delta record at byte {at}: its positions do not fit {k} changed words of {n}")
    return Change(kind, pos, values), end


def apply(targets: Sequence[Sequence[torch.Tensor]], record_sizes: Sequence[int], change: Change) -> None:
    """Write ``change`` (of one record) into the word views of its pieces (any strides), in place: ``targets[i]`` are
    the views that each take piece ``i``'s words (a tensor and the tensors tied to it)."""
    if change.kind == SAME:
        return
    if change.pos is None:  # dense: every word
        at = 0
        for views, n in zip(targets, record_sizes):
            for target in views:
                target.copy_(change.vals[at : at + n].view(target.shape))
            at += n
        return
    pos, vals = change.pos, change.vals
    if len(targets) == 1:
        for target in targets[0]:
            _scatter(target, pos, vals)
        return
    bounds = torch.tensor(_cumulative(record_sizes), dtype=torch.int64, device=pos.device)
    cuts = [0, *torch.searchsorted(pos, bounds).tolist()]
    start = 0
    for views, n, a, b in zip(targets, record_sizes, cuts, cuts[1:]):
        if b > a:
            for target in views:
                _scatter(target, pos[a:b] - start, vals[a:b])
        start += n


def writable(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose words (:func:`words`) share memory with it and hold ``t``'s values: ``t`` itself, or (a lazy
    conjugate or negation, a 16-byte element whose last dimension is strided) a copy to write into and copy back."""
    if t.is_conj() or t.is_neg() or (t.element_size() > 8 and t.dim() and t.stride(-1) != 1):
        return t.resolve_conj().resolve_neg().contiguous()
    return t


def _cumulative(values: Sequence[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def _scatter(target: torch.Tensor, pos: torch.Tensor, vals: torch.Tensor) -> None:
    """``target``'s words at flat (row-major) positions ``pos`` set to ``vals``, in place, whatever its strides."""
    if pos.device != target.device:
        pos, vals = pos.to(target.device), vals.to(target.device)
    if target.is_contiguous():
        target.view(-1).index_copy_(0, pos, vals)
    else:
        target.index_put_(torch.unravel_index(pos, target.shape), vals)
