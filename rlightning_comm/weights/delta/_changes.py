"""Which words of a tensor changed since its snapshot: the comparing half of a delta sync's bit work (:mod:`._writes`
writes the changes).

A tensor is compared as its integer *words* (the integer dtype of its element size: ``int16`` for ``bfloat16``,
``int32`` for ``float32``, ``uint8`` for ``bool``; two ``int64`` per 16-byte element), so the comparison is of bits:
NaN payloads, ``-0.0`` and ``+0.0`` differ as their bytes do, never as their values. A record's change (:class:`Change`)
is the cheapest of: nothing (``same``), the positions of the few changed words (``sparse``), a flag per word (``mask``),
or every word (``dense``); :mod:`._delta` says how each is laid out in bytes.

Finding it costs one pass over the words and their snapshot: 4 bytes at a time where the layout allows (a wider compare
is faster and leaves fewer flags; 8 bytes cost more in the scattered reads after it), into flags kept between calls
(:class:`Scratch`: fresh pages cost more to fault in than the pass). The flags are counted, so that a record that is
mostly changed is taken whole without a search; else the flagged wider words alone are gathered and compared word by
word, which gives the exact count (the kind is chosen from it), the positions and the new words at once, in time of the
changes, not of the record (a record of many changes, not surely sparse, is compared word by word in a second pass
instead). The changes' positions are searched on the host through numpy's ``packbits`` and a branch-free search of the
nonzero bytes (torch's ``nonzero`` and numpy's boolean indexing, which branch per element, are several times slower
there at a few percent and more), on a device with torch ops; their words are then gathered by position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

try:  # the host's fast path; without numpy (the library runs without it) torch ops on the host too
    import numpy as np
except ImportError:  # pragma: no cover - exercised by the suite's test without numpy
    np = None

BLOCK_BITS = 16
BLOCK = 1 << BLOCK_BITS  # words per block of a sparse record: a position within its block fits 16 bits
HEADER = 32  # bytes of a record's header: kind, changed words, words, the record's bytes (int64 each)
SAME, SPARSE, MASK, DENSE = 0, 1, 2, 3
KINDS = ("same", "sparse", "mask", "dense")
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def word_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype a tensor of ``dtype`` is compared as (16-byte elements: two ``int64`` each)."""
    return _WORDS.get(dtype.itemsize, torch.int64)


def word_count(dtype: torch.dtype, numel: int) -> int:
    """How many words a tensor of ``dtype`` and ``numel`` elements has."""
    return numel * (dtype.itemsize // 8) if dtype.itemsize > 8 else numel


def words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as integer words, of ``t``'s shape (a 0-d tensor as one word; 16-byte elements: the last dimension
    doubled), sharing its memory where its layout allows (a tensor with a lazy conjugate or negation is resolved first,
    into a copy: its words are its values')."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.dim() == 0:
        t = t.reshape(1)
    if t.element_size() > 8 and t.stride(-1) != 1:
        t = t.contiguous()
    return t.view(word_dtype(t.dtype))


def flat(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """The words of ``views`` (word views, in order) as one flat tensor: the memory itself for one contiguous view, a
    copy otherwise."""
    if len(views) == 1:
        v = views[0]
        return v.view(-1) if v.is_contiguous() else v.reshape(-1)
    return torch.cat([v.reshape(-1) for v in views])


def record_words(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """The words of a record's pieces to compare: one piece as it is where its rows are contiguous (a strided block is
    compared where it lies, not copied), else the pieces' words flat (a copy)."""
    if len(views) == 1:
        v = views[0]
        if v.is_contiguous():
            return v.view(-1)
        if v.dim() > 1 and v.stride(-1) == 1:
            return v
    return flat(views)


class Change(NamedTuple):
    """What changed in one record: its kind, the positions of its changed words (``None`` for ``dense``), their new
    words (every word for ``dense``) in row-major order, and for ``mask`` its flags packed (:func:`pack`) if at
    hand."""

    kind: int
    pos: torch.Tensor | None
    vals: torch.Tensor
    bits: torch.Tensor | None = None


class Scratch:
    """The flags of a comparison, kept between calls (one buffer per device, grown to the largest record's words): a
    fresh buffer per record costs more to fault in than the pass that fills it. What it holds is valid until its next
    use."""

    def __init__(self) -> None:
        self._flags: dict[torch.device, torch.Tensor] = {}

    def flags(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """A bool buffer of ``shape`` on ``device`` (its contents any)."""
        n = shape.numel()
        buf = self._flags.get(device)
        if buf is None or buf.numel() < n:
            self._flags[device] = None  # the old one goes first
            buf = self._flags[device] = torch.empty(max(n, 1), dtype=torch.bool, device=device)
        return buf[:n].view(shape)

    @property
    def nbytes(self) -> int:
        """The bytes it holds."""
        return sum(b.numel() for b in self._flags.values() if b is not None)


def sizes(n: int, k: int, itemsize: int) -> tuple[int, int, int]:
    """The bytes of a record of ``n`` words with ``k`` changed, encoded ``sparse``, ``mask`` and ``dense``."""
    values = _align(k * itemsize)
    return (
        HEADER + _align(4 * -(-n // BLOCK)) + _align(2 * k) + values,
        HEADER + _align(-(-n // 8)) + values,
        HEADER + _align(n * itemsize),
    )


def _align(n: int) -> int:
    return -(-n // 8) * 8


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS.get(device)
    if s is None:
        s = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return s


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s bit work goes through numpy (a host tensor, numpy importable)."""
    return t.is_cpu and np is not None


def _set_bits(bits: Any) -> Any:
    """The positions of the set bits of ``bits`` (little bit order), ascending, as int64.

    numpy's ``nonzero`` of a bool array writes its indices without a branch; of other dtypes it branches per element
    (several times slower where a few percent are set): the bytes are searched as bools, then only the nonzero ones
    unpacked (into 0 or 1 per bit: bools as they are).
    """
    nz = np.flatnonzero(bits != 0)
    j = np.flatnonzero(np.unpackbits(bits[nz], bitorder="little").view(np.bool_))
    return (nz[j >> 3] << 3) | (j & 7)


def pack(m: torch.Tensor) -> torch.Tensor:
    """``m`` (bool) as bits in row-major order, little bit order, padded with zeros: ``ceil(numel / 8)`` bytes."""
    if on_host(m):
        return torch.from_numpy(np.packbits(m.numpy().reshape(-1), bitorder="little"))
    n = m.numel()
    padded = torch.zeros(_align(n), dtype=torch.uint8, device=m.device)
    padded[:n] = m.reshape(-1)
    return (padded.view(-1, 8) << _shifts(m.device)).sum(1, dtype=torch.uint8)


def positions(bits: torch.Tensor) -> torch.Tensor:
    """The positions of the set bits of ``bits`` (uint8, little bit order), ascending, as int64 on its device."""
    if on_host(bits):
        return torch.from_numpy(_set_bits(bits.numpy()))
    return ((bits.unsqueeze(1) >> _shifts(bits.device)) & 1).view(-1).nonzero().view(-1)


def bits_at(pos: torch.Tensor, n: int) -> torch.Tensor:
    """The flags of a record of ``n`` words set at ``pos`` (ascending, distinct), packed as :func:`pack` packs them;
    in time of ``pos``, not of ``n``, but for the zeros."""
    nbytes = -(-n // 8)
    if on_host(pos):
        p = pos.numpy()
        out = np.zeros(nbytes, dtype=np.uint8)
        if p.size:
            at = p >> 3
            starts = np.flatnonzero(np.diff(at, prepend=-1))  # the first change in each byte
            out[at[starts]] = np.bitwise_or.reduceat(np.left_shift(1, p & 7).astype(np.uint8), starts)
        return torch.from_numpy(out)
    out = torch.zeros(nbytes, dtype=torch.int64, device=pos.device)
    return out.index_add_(0, pos >> 3, torch.ones_like(pos) << (pos & 7)).to(torch.uint8)


def _positions(m: torch.Tensor) -> torch.Tensor:
    """The flat positions of the set flags of ``m`` (bool), ascending, as int64."""
    if on_host(m):
        return torch.from_numpy(_set_bits(np.packbits(m.numpy().reshape(-1), bitorder="little")))
    return m.reshape(-1).nonzero().view(-1)


def _count(m: torch.Tensor) -> int:
    return int(np.count_nonzero(m.numpy())) if on_host(m) else int(m.sum())


def take(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The words of ``t`` (any strides) at its flat (row-major) positions ``pos``."""
    if t.is_contiguous():
        return t.reshape(-1).index_select(0, pos)
    return span(t).index_select(0, offsets(t, pos))


def span(t: torch.Tensor) -> torch.Tensor:
    """The memory ``t`` spans, flat, from its first element (writing into it writes into ``t``'s storage)."""
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    return t.as_strided((span,), (1,))


def offsets(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The offsets in :func:`span` of ``t``'s flat (row-major) positions ``pos`` (a block of rows: two integer ops)."""
    if t.dim() == 2 and t.stride(1) == 1:  # row r, column c: at r * stride + c = pos + r * (stride - columns)
        return pos + pos.div(t.shape[1], rounding_mode="floor") * (t.stride(0) - t.shape[1])
    index = torch.unravel_index(pos, t.shape)
    return sum(i * s for i, s in zip(index, t.stride()))


WIDTH = 4  # bytes compared at a time, at most: narrower words are compared in groups of this many bytes


def _wide(t: torch.Tensor) -> int:
    """How many of ``t``'s words make a :data:`WIDTH`-byte word, where its rows and their starts allow (else 1)."""
    item = t.element_size()
    if item >= WIDTH or t.dim() == 0 or (t.shape[-1] * item) % WIDTH:
        return 1
    if (t.storage_offset() * item) % WIDTH or any((s * item) % WIDTH for s in t.stride()[:-1]) or t.stride(-1) != 1:
        return 1
    return WIDTH // item


def diff(cur: torch.Tensor, snap: torch.Tensor) -> torch.Tensor:
    """The flat (row-major) positions of the words of ``cur`` that differ from ``snap``, ascending, as int64 on
    ``cur``'s device. ``cur`` is a record's words (:func:`record_words`), ``snap`` its snapshot (flat, contiguous)."""
    snap = snap.view(cur.shape)
    wide = min(_wide(cur), _wide(snap))
    if wide == 1:
        return _positions(torch.ne(cur, snap))
    wider = _WORDS[WIDTH]
    return _refine(cur, snap, wide, torch.ne(cur.view(wider), snap.view(wider)))[0]


def _refine(cur: torch.Tensor, snap: torch.Tensor, wide: int, flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of the changed words and their words now, from the flags of the changed wider words: only those
    are gathered and compared word by word, and the new words come from the same gather."""
    wider = _WORDS[wide * cur.element_size()]
    at = _positions(flags)
    now = take(cur.view(wider), at)
    j = _positions((now ^ take(snap.view(wider), at)).view(cur.dtype) != 0)
    shift = wide.bit_length() - 1
    return (at.index_select(0, j >> shift) << shift) | (j & (wide - 1)), now.view(cur.dtype).index_select(0, j)


def _ne(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` set where ``a`` and ``b`` (words of one shape) differ; on the host through numpy, whose loops take a
    strided block (a column block of a shard) at about the speed of a contiguous one (torch's took twice as long)."""
    if on_host(a):
        np.not_equal(a.numpy(), b.numpy(), out=out.numpy())
        return out
    return torch.ne(a, b, out=out)


def change_of(cur: torch.Tensor, snap: torch.Tensor, scratch: Scratch | None = None) -> Change:
    """The change of a record (its words ``cur``, its snapshot ``snap``) in its cheapest kind (the fewest bytes).

    One pass compares the words, :data:`WIDTH` bytes at a time where the layout allows, into ``scratch``'s flags (a
    fresh buffer without one), and counts them. A record whose ``dense`` bytes are no more than its others' even at the
    fewest changes the flags allow is taken whole. One that is ``sparse`` even at the most has only its flagged wider
    words compared word by word (in time of the changes: the exact count, the positions and the new words at once);
    any other is compared word by word in a second pass (its changes are many: searched, the refine would cost more).
    The kind is chosen from the exact count, a ``mask``'s flags packed at once (the scratch is used again).
    """
    n, item = cur.numel(), cur.element_size()
    snap = snap.view(cur.shape)
    wide = min(_wide(cur), _wide(snap))
    a, b = (cur.view(_WORDS[WIDTH]), snap.view(_WORDS[WIDTH])) if wide > 1 else (cur, snap)
    flags = _ne(a, b, _buffer(scratch, a))
    k = _count(flags)
    if k == 0:
        return Change(SAME, cur.new_empty(0, dtype=torch.int64), cur.new_empty(0))
    low = sizes(n, k, item)  # the fewest changed words: k (exactly k word by word)
    if low[2] <= min(low[:2]):
        return Change(DENSE, None, cur.reshape(-1))
    if wide > 1 and sizes(n, min(n, wide * k), item)[0] > min(low[1:]):  # not surely sparse: word by word
        wide, flags = 1, _ne(cur, snap, _buffer(scratch, cur))
        k = _count(flags)
        sparse, mask, dense = sizes(n, k, item)
        if dense <= min(sparse, mask):
            return Change(DENSE, None, cur.reshape(-1))
    if wide > 1:
        pos, vals = _refine(cur, snap, wide, flags)
    else:
        pos = _positions(flags)
        vals = take(cur, pos)
    sparse, mask, dense = sizes(n, pos.numel(), item)
    if dense <= min(sparse, mask):
        return Change(DENSE, None, cur.reshape(-1))
    if sparse <= mask:
        return Change(SPARSE, pos, vals)
    return Change(MASK, pos, vals, pack(flags) if wide == 1 else bits_at(pos, n))


def _buffer(scratch: Scratch | None, like: torch.Tensor) -> torch.Tensor:
    if scratch is None:
        return torch.empty(like.shape, dtype=torch.bool, device=like.device)
    return scratch.flags(like.shape, like.device)
