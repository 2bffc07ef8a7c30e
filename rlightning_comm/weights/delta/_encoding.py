"""The bytes of a delta: records, and how each record's change (:mod:`._changes`) is laid out and read back.

Small tensors of one word size are grouped into one *record* (one set of torch ops for many of them). A record's bytes:
a header of four ``int64`` (kind, changed words, words, the record's bytes), then its sections, each padded to 8 bytes:

* ``same``: nothing changed (the header alone);
* ``sparse``: the record cut in blocks of 65,536 words, the number of changed words per block (``int32``), each changed
  word's position within its block (16 bits), then the changed words;
* ``mask``: one bit per word (set where it changed, little bit order), then the changed words;
* ``dense``: every word.

A delta is its records' bytes back to back, in an order both sides compute from the plan. On the host the bytes are
read through numpy (a dozen small torch calls per record cost more than a small record).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch

from rlightning_comm.weights.delta._changes import (
    BLOCK,
    BLOCK_BITS,
    DENSE,
    HEADER,
    MASK,
    SAME,
    SPARSE,
    Change,
    bits_at,
    change_of,
    np,
    on_host,
    positions,
    sizes,
    word_count,
    word_dtype,
)

SMALL = 1 << 16  # a tensor of fewer words is grouped with its neighbours of the same word size


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


def encode(cur: torch.Tensor, snap: torch.Tensor) -> tuple[list[torch.Tensor], Change]:
    """The bytes of ``cur``'s changes against ``snap`` (a record's words and their snapshot), as sections to
    concatenate, and the change itself (what the snapshot takes on once the sync succeeded)."""
    change = change_of(cur, snap)
    return sections(cur, change), change


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
        bits = change.bits if change.bits is not None else bits_at(pos, n)
        return [_header(MASK, k, n, size, device), _padded(bits), _padded(vals)]
    blocks = -(-n // BLOCK)
    if on_host(pos):  # numpy's casts wrap: the low 16 bits
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


_NUMPY: dict[torch.dtype, Any] = {}


def _np(word: torch.dtype) -> Any:
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
    host = on_host(payload)
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
        pos = positions(read(body, -(-n // 8), torch.uint8))
    elif host:
        counts = raw[body : body + 4 * blocks].view(np.int32)
        low = raw[body + _align(4 * blocks) : body + _align(4 * blocks) + 2 * k].view(np.uint16)
        if counts.min(initial=0) < 0 or int(counts.sum()) != k:
            raise ValueError(f"a delta record at byte {at}: its blocks do not hold {k} changed words")
        pos = torch.from_numpy(np.repeat(np.arange(blocks, dtype=np.int64) << BLOCK_BITS, counts) + low)
    else:
        counts = read(body, blocks, torch.int32).long()
        if bool((counts < 0).any()) or int(counts.sum()) != k:
            raise ValueError(f"a delta record at byte {at}: its blocks do not hold {k} changed words")
        low = read(body + _align(4 * blocks), k, torch.int16).long() & (BLOCK - 1)
        pos = torch.repeat_interleave(torch.arange(blocks, device=payload.device) << BLOCK_BITS, counts) + low
    if pos.numel() != k or (k and int(pos[-1]) >= n):
        raise ValueError(f"a delta record at byte {at}: its positions do not fit {k} changed words of {n}")
    return Change(kind, pos, values), end
