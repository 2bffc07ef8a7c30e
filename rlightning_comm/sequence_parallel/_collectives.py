"""The collectives behind the autograd ops: one contiguous buffer each way, uneven chunks along any dim.

Nothing here records autograd history; ``_functions.py`` wraps these in Functions. Every function takes the chunk length
of each rank along ``dim`` (``sizes``, one entry per rank of the group), reads its input in any layout (expanded,
transposed, sliced: what autograd hands a backward) and returns a new tensor, never a view of its input. The group
object issues the one collective (a :class:`~._resolve.Group` through the communicator, a
:class:`~._resolve.TracedGroup` through the functional collectives), so the same code runs eagerly and under
torch.compile.

Equal lengths put a ``[world_size, length, rest]`` view on the wire: debug mode's fingerprint then shows every rank's
length, and a rank whose length differs is named before anything is sent.
"""

from __future__ import annotations

import math
from typing import Any

import torch

Group = Any  # a _resolve.Group or _resolve.TracedGroup


def _with(shape: torch.Size | tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = size
    return tuple(out)


def _leading(shape: torch.Size | tuple[int, ...], dim: int) -> bool:
    """Whether chunks along ``dim`` of a contiguous tensor of ``shape`` are contiguous and in order."""
    return math.prod(shape[:dim]) == 1


def _uniform(sizes: list[int]) -> bool:
    return sizes.count(sizes[0]) == len(sizes)


def _rows(flat: torch.Tensor, ws: int, length: int) -> torch.Tensor:
    """``flat`` as ``[ws, length, rest]`` (what debug mode's fingerprint shows)."""
    per = flat.numel() // ws
    return flat.view(ws, length, per // length if length else 0)


def _stacked(x: torch.Tensor, dim: int, ws: int) -> torch.Tensor:
    """``x`` split evenly along ``dim`` and stacked: ``[ws, *chunk]``, contiguous (a view when it can be)."""
    if _leading(x.shape, dim) and x.is_contiguous():
        return x.view(ws, *_with(x.shape, dim, x.shape[dim] // ws))
    return torch.stack(x.chunk(ws, dim)) if x.shape[dim] else x.unflatten(dim, (ws, 0)).movedim(dim, 0).contiguous()


def _unstacked(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`_stacked`: ``[ws, *block]`` concatenated along ``dim``, contiguous (a view when it can be)."""
    shape = blocks.shape[1:]
    out = _with(shape, dim, blocks.shape[0] * shape[dim])
    if _leading(shape, dim) and blocks.is_contiguous():
        return blocks.view(out)
    return blocks.movedim(0, dim).reshape(out).contiguous()


def _pack_many(xs: list[torch.Tensor], dim: int, sizes: list[list[int]], in_splits: list[int]) -> torch.Tensor:
    """One flat buffer holding, for each rank j in turn, chunk j of every tensor of ``xs`` along ``dim``."""
    ws = len(in_splits)
    if len(xs) == 1 and _uniform(sizes[0]):
        return _stacked(xs[0], dim, ws).view(-1)
    buf = torch.empty(sum(in_splits), dtype=xs[0].dtype, device=xs[0].device)
    if buf.numel() and all(_uniform(s) for s in sizes):
        # Every rank gets the same amount: one strided copy per tensor into its columns of a [ws, per-rank] view.
        rows, col = buf.view(ws, -1), 0
        for x, s in zip(xs, sizes):
            chunk = _with(x.shape, dim, s[0])
            n = math.prod(chunk)
            rows[:, col : col + n].view(ws, *chunk).copy_(x.unflatten(dim, (ws, s[0])).movedim(dim, 0))
            col += n
        return buf
    offset = 0
    starts = [[sum(s[:j]) for j in range(ws)] for s in sizes]
    for j in range(ws):
        for x, s, st in zip(xs, sizes, starts):
            chunk = x.narrow(dim, st[j], s[j])
            buf[offset : offset + chunk.numel()].view(chunk.shape).copy_(chunk)
            offset += chunk.numel()
    return buf


def _unpack_many(
    buf: torch.Tensor, shapes: list[list[tuple[int, ...]]], dim: int, out_splits: list[int]
) -> list[torch.Tensor]:
    """Inverse layout of :func:`_pack_many`: ``shapes[t][j]`` is the block of tensor t from rank j; concatenate along
    ``dim``."""
    ws = len(out_splits)
    if buf.numel() and all(ts.count(ts[0]) == ws for ts in shapes):
        rows, col, outs = buf.view(ws, -1), 0, []
        for ts in shapes:
            n = math.prod(ts[0])
            outs.append(_unstacked(rows[:, col : col + n].view(ws, *ts[0]), dim))
            col += n
        return outs
    starts = [sum(out_splits[:j]) for j in range(ws)]
    outs = []
    for t, ts in enumerate(shapes):
        blocks = []
        for j, shape in enumerate(ts):
            offset = starts[j] + sum(math.prod(shapes[u][j]) for u in range(t))
            blocks.append(buf[offset : offset + math.prod(shape)].view(shape))
        outs.append(torch.cat(blocks, dim))
    return outs


def all_to_all(
    xs: list[torch.Tensor],
    send_dim: int,
    send_sizes: list[list[int]],
    recv_dim: int,
    recv_sizes: list[list[int]],
    group: Group,
) -> list[torch.Tensor]:
    """Send chunk j of each tensor of ``xs`` along ``send_dim`` to rank j; concatenate what arrives along ``recv_dim``.

    ``send_sizes[t]`` (the same on every rank) and ``recv_sizes[t]`` (rank j's ``xs[t].shape[recv_dim]`` at entry j) are
    tensor t's lists. The tensors share a dtype and device and travel together: one ``all_to_all_single`` on one flat
    buffer, chunk j of each tensor in turn for rank j.
    """
    rank, ws = group.rank, group.world_size
    if len(xs) == 1 and _uniform(send_sizes[0]) and _uniform(recv_sizes[0]):
        # The hot path (Ulysses, equal lengths): few torch calls, at most a copy each way. The wire tensor [ws, *block]
        # shows every rank's block shape (its length included) to debug mode.
        send = _stacked(xs[0], send_dim, ws)
        return [_unstacked(group.all_to_all(send, None, None), recv_dim)]
    shapes = [
        [_with(_with(x.shape, send_dim, ss[rank]), recv_dim, n) for n in rs]
        for x, ss, rs in zip(xs, send_sizes, recv_sizes)
    ]
    in_splits = [sum(math.prod(_with(x.shape, send_dim, ss[j])) for x, ss in zip(xs, send_sizes)) for j in range(ws)]
    out_splits = [sum(math.prod(ts[j]) for ts in shapes) for j in range(ws)]
    send = _pack_many(xs, send_dim, send_sizes, in_splits)
    lengths = {n for rs in recv_sizes for n in rs}
    if _uniform(in_splits) and _uniform(out_splits) and len(lengths) == 1:
        # Equal everywhere: the plain form, with every rank's length on the wire shape for debug mode.
        recv = group.all_to_all(_rows(send, ws, lengths.pop()), None, None).view(-1)
    else:
        recv = group.all_to_all(send, out_splits, in_splits)
    return _unpack_many(recv, shapes, recv_dim, out_splits)


def split(x: torch.Tensor, dim: int, sizes: list[int], group: Group) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (a contiguous copy); no communication."""
    offset = sum(sizes[: group.rank])
    return x.narrow(dim, offset, sizes[group.rank]).clone(memory_format=torch.contiguous_format)


def _positions(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` contiguous with ``dim`` first: one row per position along ``dim`` (a view when it can be)."""
    return x.movedim(dim, 0).contiguous()


def scatter_from_first(x: torch.Tensor, dim: int, sizes: list[int], group: Group) -> torch.Tensor:
    """Chunk r of the group's first rank's ``x`` along ``dim``, on rank r. Other ranks' values are not read.

    Rows on the wire are positions along ``dim``, so the split sizes are lengths.
    """
    ws, rank = group.world_size, group.rank
    if rank == 0:
        send, in_splits = _positions(x, dim), list(sizes)
    else:
        # An empty slice of x, not a new tensor: a send that does not depend on x would let compile's partitioner hoist
        # this backward collective into the forward graph on this rank only.
        send, in_splits = _positions(x.narrow(dim, 0, 0), dim), [0] * ws
    out_splits = [sizes[rank] if j == 0 else 0 for j in range(ws)]
    return group.all_to_all(send, out_splits, in_splits).movedim(0, dim).contiguous()


def gather_to_first(x: torch.Tensor, dim: int, sizes: list[int], group: Group, length: int) -> torch.Tensor:
    """On the group's first rank the concatenation along ``dim`` of every rank's ``x``; elsewhere zeros, ``length`` long
    along ``dim``."""
    ws, rank = group.world_size, group.rank
    in_splits = [x.shape[dim] if j == 0 else 0 for j in range(ws)]
    out_splits = list(sizes) if rank == 0 else [0] * ws
    recv = group.all_to_all(_positions(x, dim), out_splits, in_splits)
    if rank == 0:
        return recv.movedim(0, dim).contiguous()
    return x.new_zeros(_with(x.shape, dim, length))


def all_gather(x: torch.Tensor, dim: int, sizes: list[int], group: Group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``; ``sizes[j]`` is rank j's length there (padded to the longest on
    the wire)."""
    longest = max(sizes)
    if longest == x.shape[dim]:
        padded = x.contiguous()
    else:
        padded = x.new_zeros(_with(x.shape, dim, longest))
        padded.narrow(dim, 0, x.shape[dim]).copy_(x)
    blocks = group.all_gather(padded)
    if min(sizes) == longest:
        return _unstacked(blocks, dim)
    return torch.cat([b.narrow(dim, 0, n) for b, n in zip(blocks.unbind(0), sizes)], dim)


def reduce_scatter(x: torch.Tensor, dim: int, sizes: list[int], group: Group) -> torch.Tensor:
    """Sum ``x`` (same shape everywhere) over the group and keep chunk r along ``dim`` on rank r (padded to the longest
    on the wire)."""
    ws, rank = group.world_size, group.rank
    longest = max(sizes)
    if min(sizes) == longest:
        return group.reduce_scatter(_stacked(x, dim, ws))
    padded = x.new_zeros((ws, *_with(x.shape, dim, longest)))
    for j, chunk in enumerate(x.split(sizes, dim)):
        padded[j].narrow(dim, 0, sizes[j]).copy_(chunk)
    out = group.reduce_scatter(padded)
    return out.narrow(dim, 0, sizes[rank]).contiguous()
