"""Per-tensor digests of a weight sync: a position-weighted sum of bytes mod 2**64, computed with torch ops as the
bytes pass (on the tensors' own device), never in a second pass over the model.

The definition (the tests compute it independently from this text). A tensor of global shape ``(..., n)`` and element
size ``k`` is a matrix of byte rows: row ``f`` (its row-major index over the leading dimensions; a 0-d tensor is one
row) holds ``L = n * k`` bytes, each read as a signed 8-bit integer ``x[f, p]``. Each row is cut into segments of ``C =
65536`` bytes, ``S = ceil(L / C)`` of them; segment ``s`` of row ``f`` is the virtual row ``v = f * S + s``. With
``mix`` the splitmix64 finaliser on 64 bits (``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *=
0x94D049BB133111EB; z ^= z >> 31``) and ``G = 0x9E3779B97F4A7C15``, for ``j`` in ``0..7``:

* byte weights ``w(b, j) = ((mix((b * 8 + j) * G + 1) >> 56) | (j == 0)) - 128``, for ``b`` in ``0..C-1`` (an 8-bit
  integer; odd for ``j == 0``);
* row weights ``h(v, j) = mix((v * 8 + j) * G + 2) | (j == 0)`` (odd for ``j == 0``);
* ``digest = sum over f, s, j of h(f * S + s, j) * sum over b of x[f, s * C + b] * w(b, j)``, mod 2**64 (an unsigned
  int; every product and sum in two's complement, so the order does not matter).

It is a sum over bytes, each weighted by its global position, so any block of the tensor contributes its own part and
the parts add up: the digest does not depend on the bucketing, on how a tensor is cut into pieces, nor on which member
sent which piece. The inner sums are one ``int8`` matrix product per block (``torch._int_mm``, exact in ``int32``), a
pass at about memory speed on the host and on a GPU; no host copy of a device tensor. :class:`Digests` computes them on
a thread of its own (torch releases the GIL in its kernels), overlapped with the transfer where a core is free.

What it detects: any change of one byte, always (its weight is odd for ``j == 0``); random corruption and bytes from the
wrong place or the wrong tensor (misplaced offsets, swapped pieces, a stale bucket) except with a probability of about
``2**-64`` for a random change. What it does not: it is not a cryptographic hash; someone who wants to forge a collision
can.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from rlightning_comm.weights.core._memory import hash_key

SEGMENT = 1 << 16  # bytes per segment: 128 * 128 * SEGMENT < 2**31, so the int8 product is exact in int32
COLUMNS = 8
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x


def _shr(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's is arithmetic)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = z ^ _shr(z, 30)
    z = z * _signed(_M1)
    z = z ^ _shr(z, 27)
    z = z * _signed(_M2)
    return z ^ _shr(z, 31)


def _weights(index: torch.Tensor, salt: int) -> torch.Tensor:
    """``mix((index * 8 + j) * G + salt)`` for ``j`` in ``0..7``: ``index``'s shape plus a trailing 8."""
    j = torch.arange(COLUMNS, dtype=torch.int64, device=index.device)
    return _mix((index.unsqueeze(-1) * COLUMNS + j) * _signed(_GOLDEN) + salt)


_byte_weights: dict[torch.device, torch.Tensor] = {}


def _bytes_w(device: torch.device) -> torch.Tensor:
    w = _byte_weights.get(device)
    if w is None:
        top = _shr(_weights(torch.arange(SEGMENT, dtype=torch.int64, device=device), 1), 56)
        top[:, 0] |= 1
        w = _byte_weights[device] = (top - 128).to(torch.int8)
    return w


def _row_w(rows: torch.Tensor) -> torch.Tensor:
    h = _weights(rows, 2)
    h[..., 0] |= 1
    return h


def _int_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` of int8 matrices, exact (in int32, or in int64 where the CUDA kernel does not take the shapes)."""
    if x.is_cpu:
        return torch._int_mm(x, w)
    m, k = x.shape
    if m > 16 and k % 8 == 0 and x.stride(1) == 1:  # what the CUDA kernel takes (written to its docs: unverified)
        try:
            return torch._int_mm(x, w)
        except RuntimeError:  # a layout or device it refuses: the exact fallback below
            pass
    # Small or odd blocks: exact in float64 (|sum| < 2**53), no faster path needed for them.
    return (x.to(torch.float64) @ w.to(torch.float64)).to(torch.int64)


# Row weights per (block rows, segment): a model's blocks recur sync after sync, and computing the weights is most of
# the cost of a small block. Bounded: cleared when it holds more than _CACHE_ROWS rows.
_CACHE_ROWS = 1 << 20
_row_cache: dict[tuple, torch.Tensor] = {}
_cached_rows = 0


def _rows_of(
    offsets: Sequence[int], block: Sequence[int], shape: Sequence[int], segments: int, s: int, m: int, device: Any
) -> torch.Tensor:
    """Row weights ``(rows, 8)`` of the block's rows (leading dims at ``offsets``, sizes ``block``, of ``shape``) for
    segment ``s`` (``m`` consecutive segments of one row: ``(m, 8)``)."""
    global _cached_rows
    key = (tuple(offsets), tuple(block), tuple(shape), segments, s, m, device)
    h = _row_cache.get(key)
    if h is not None:
        return h
    lead = len(shape)
    rows = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in range(lead - 1, -1, -1):
        idx = torch.arange(offsets[d], offsets[d] + block[d], dtype=torch.int64, device=device) * stride
        rows = rows.unsqueeze(0) + idx.view(-1, *([1] * (lead - 1 - d)))
        stride *= shape[d]
    rows = rows.reshape(-1)
    if m > 1:
        virtual = rows[0] * segments + s + torch.arange(m, dtype=torch.int64, device=device)
    else:
        virtual = rows * segments + s
    h = _row_w(virtual)
    if _cached_rows + h.shape[0] > _CACHE_ROWS:
        _row_cache.clear()
        _cached_rows = 0
    _row_cache[key] = h
    _cached_rows += h.shape[0]
    return h


def block_digest(view: torch.Tensor, offsets: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """The contribution of ``view``, the block at ``offsets`` of a tensor of global ``shape``, to its digest: an int64
    tensor of no dimensions on ``view``'s device (add contributions; ``digest_int`` reads the sum)."""
    v = view.detach()
    if len(shape) == 0:
        shape, offsets, v = (1,), (0,), v.reshape(1)
    if v.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=v.device)
    if v.is_conj() or v.is_neg():
        v = v.resolve_conj().resolve_neg()
    if v.stride(-1) != 1 and v.shape[-1] != 1:
        v = v.contiguous()
    k = v.element_size()
    x = v.view(torch.int8) if v.dtype != torch.int8 else v
    if x.shape[-1] != v.shape[-1] * k:  # a column of stride != 1: view() did not widen it
        x = v.contiguous().view(torch.int8)
    block = v.shape[:-1]
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    segments = -(-shape[-1] * k // SEGMENT)
    w = _bytes_w(v.device)
    start, stop = offsets[-1] * k, offsets[-1] * k + x.shape[1]
    lead = (tuple(offsets[:-1]), tuple(block), tuple(shape[:-1]))
    if start == 0 and segments == 1:  # whole rows of one segment (most tensors of a model): one product
        return (_int_mm(x, w[:stop]) * _rows_of(*lead, 1, 0, 1, v.device)).sum()
    total = None
    s = start // SEGMENT
    while s * SEGMENT < stop:
        a, b = max(start, s * SEGMENT), min(stop, (s + 1) * SEGMENT)
        full = a == s * SEGMENT and b == (s + 1) * SEGMENT
        if full and x.shape[0] == 1 and (stop - a) >= 2 * SEGMENT:  # a long row: its whole segments as one matrix
            m = (stop - a) // SEGMENT
            part = _int_mm(x[0, a - start : a - start + m * SEGMENT].view(m, SEGMENT), w)
            h = _rows_of(*lead, segments, s, m, v.device)
            s += m
        else:
            part = _int_mm(x[:, a - start : b - start], w[a - s * SEGMENT : b - s * SEGMENT])
            h = _rows_of(*lead, segments, s, 1, v.device)
            s += 1
        value = (part * h).sum()
        total = value if total is None else total + value
    return total


def where_block(shape: Sequence[int], where: tuple[Any, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, block shape)`` of ``tensor[where]`` for a tensor of ``shape``, where ``where`` is leading ints and at
    most one final slice (a piece of a broadcast plan); ``()`` is the whole tensor."""
    offsets, block = [], []
    for d, size in enumerate(shape):
        if d < len(where):
            w = where[d]
            if isinstance(w, slice):
                lo, hi, _ = w.indices(size)
                offsets.append(lo)
                block.append(hi - lo)
            else:
                offsets.append(int(w))
                block.append(1)
        else:
            offsets.append(0)
            block.append(size)
    return tuple(offsets), tuple(block)


def tensor_digest(tensor: torch.Tensor) -> int:
    """The digest of a whole tensor: what a sync reports for it."""
    return digest_int(block_digest(tensor, (0,) * tensor.dim(), tuple(tensor.shape)))


def content_key(tensors: Sequence[torch.Tensor], digests: Sequence[int] | None = None) -> tuple[int, int]:
    """What ``tensors`` hold, by content: each one's dtype, shape and digest (one pass over their bytes, one device
    read for all of them; none with ``digests``, their digests as a verified sync reported them).

    A delta applies only onto the bytes it was computed against, so a destination proves what it holds by this key, not
    by which tensors they are: a receive that moves no version counter, an op under ``torch.inference_mode``, a fresh
    tensor at a reused address or a write torch does not see all change the key.
    """
    if digests is None:
        sums = [block_digest(t, (0,) * t.dim(), tuple(t.shape)) for t in tensors]
        values = torch.stack([s.reshape(()).to(sums[0].device) for s in sums]).tolist() if sums else []
        digests = [v & _MASK for v in values]
    return hash_key([(str(t.dtype), tuple(t.shape)) for t in tensors] + list(digests))


def digest_int(value: torch.Tensor) -> int:
    """An accumulated contribution as the unsigned int a report shows (reads the device: call once per sync)."""
    return int(value.item()) & _MASK


class Digests:
    """Digests accumulated per index (a tensor, or a name), fed with blocks in any order with :meth:`update`.

    Args:
        names: The name of each index, in the transfer's order.
        shapes: The global shape of each index.
        aliases: ``(index, index of the tensor it is)``: an alias reports its target's digest (it is never fed).
    """

    def __init__(
        self, names: Sequence[str], shapes: Sequence[Sequence[int]], aliases: Sequence[tuple[int, int]] = ()
    ) -> None:
        self._names = tuple(names)
        self._shapes = tuple(tuple(s) for s in shapes)
        self._aliases = tuple(aliases)
        self._sums: dict[int, torch.Tensor] = {}
        self._worker: ThreadPoolExecutor | None = None
        self._last: Future | None = None

    def _add(self, index: int, data: torch.Tensor, offsets: Sequence[int]) -> None:
        part = block_digest(data, offsets, self._shapes[index])
        kept = self._sums.get(index)
        self._sums[index] = part if kept is None else kept + part

    def update(self, index: int, data: torch.Tensor, offsets: Sequence[int]) -> None:
        """Add the block ``data`` (with the tensor's dtype and the block's shape) at ``offsets`` of tensor ``index``,
        on the digests' thread (torch releases the GIL in its kernels): ``data`` must hold its bytes until
        :meth:`settle`."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="rlightning_comm-digests")
        self._last = self._worker.submit(self._add, index, data, offsets)  # one thread: in order

    def update_piece(self, index: int, data: torch.Tensor, where: tuple[Any, ...], dtype: torch.dtype) -> None:
        """Add a broadcast plan's piece ``tensor[where]``: ``data`` is its view, or its bytes (``uint8``) as they
        travel."""
        offsets, block = where_block(self._shapes[index], where)
        if data.dtype != dtype:
            data = data.view(dtype)
        self.update(index, data.reshape(block) if block else data.reshape(()), offsets)

    def settle(self) -> None:
        """Wait until every block fed so far is added (their memory may then be reused)."""
        last, self._last = self._last, None
        if last is not None:
            last.result()

    def close(self) -> None:
        """Stop the digests' thread (after the work queued so far)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def result(self) -> dict[str, int]:
        """Every name's digest (a tensor never fed has no bytes: digest 0); one read of the device."""
        self.settle()
        self.close()
        got: dict[int, int] = {}
        by_device: dict[torch.device, list[int]] = {}
        for i, value in self._sums.items():
            by_device.setdefault(value.device, []).append(i)
        for indices in by_device.values():  # one read per device
            got.update(zip(indices, torch.stack([self._sums[i] for i in indices]).tolist()))
        out = [got.get(i, 0) & _MASK for i in range(len(self._names))]
        for index, target in self._aliases:
            out[index] = out[target]
        return dict(zip(self._names, out))


def fingerprint(digests: dict[str, int]) -> list[int]:
    """Two signed 64-bit words that stand for every digest at once (exchanged in place of the full list)."""
    raw = hashlib.sha256(repr(sorted(digests.items())).encode()).digest()
    return [int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:16], "little", signed=True)]


def differing(reference: dict[str, int], mine: dict[str, int]) -> list[str]:
    """The names whose digest in ``mine`` is not ``reference``'s, sorted."""
    return sorted(name for name, d in reference.items() if mine.get(name) != d)
