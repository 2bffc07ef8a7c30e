"""The collectives behind the autograd ops: one contiguous buffer each way, uneven chunks along any dim.

Nothing here records autograd history; ``ops.py`` wraps these in Functions.
Every function takes the chunk length of each rank along ``dim`` (``sizes``,
one entry per rank of the group) and returns a new tensor, never a view of
its input.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rlightning_comm.sequence_parallel._resolve import Group

# torch 2.13 renamed the single-buffer collectives and deprecated the old names; older torch has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _collective(op: str, fn: Callable[..., Any], group: Group, *args: Any) -> None:
    """Run one torch.distributed collective on ``group``; a backend failure becomes the library's error, naming ``op``."""
    try:
        fn(*args, group=group.pg)
    except RuntimeError as err:
        raise group.failure(op, err) from err


def _with(shape: torch.Size | tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = size
    return tuple(out)


def _leading(shape: torch.Size | tuple[int, ...], dim: int) -> bool:
    """Whether chunks along ``dim`` of a contiguous tensor of ``shape`` are contiguous and in order."""
    return math.prod(shape[:dim]) == 1


def _pack(x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
    """One flat buffer holding the chunks of ``x`` along ``dim``, each contiguous, in rank order (a view when it can be)."""
    ws = len(sizes)
    if x.numel() == 0:
        return x.new_empty(0)
    if sizes.count(sizes[0]) == ws:
        if x.is_contiguous():
            pre = math.prod(x.shape[:dim])
            if pre == 1:
                return x.view(-1)  # the chunks already lie in order
            # [pre, ws, rest] -> [ws, pre, rest]: one strided copy
            buf = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
            buf.view(ws, pre, -1).copy_(x.view(pre, ws, -1).transpose(0, 1))
            return buf
        return x.unflatten(dim, (ws, sizes[0])).movedim(dim, 0).reshape(-1)
    if _leading(x.shape, dim) and x.is_contiguous():
        return x.view(-1)
    buf = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    offset = 0
    for chunk in x.split(sizes, dim):
        n = chunk.numel()
        buf[offset : offset + n].view(chunk.shape).copy_(chunk)
        offset += n
    return buf


def _unpack(buf: torch.Tensor, shapes: list[tuple[int, ...]], dim: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate along ``dim`` the consecutive blocks of ``buf`` with the given shapes (a view when it can be, unless ``out`` is given)."""
    out_shape = _with(shapes[0], dim, sum(s[dim] for s in shapes))
    if out is None and _leading(out_shape, dim):
        return buf.view(out_shape)
    blocks, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        blocks.append(buf[offset : offset + n].view(shape))
        offset += n
    return torch.cat(blocks, dim) if out is None else torch.cat(blocks, dim, out=out)


def _pack_many(xs: list[torch.Tensor], dim: int, sizes: list[list[int]], in_splits: list[int]) -> torch.Tensor:
    """One flat buffer holding, for each rank j in turn, chunk j of every tensor of ``xs`` along ``dim``."""
    ws = len(in_splits)
    buf = torch.empty(sum(in_splits), dtype=xs[0].dtype, device=xs[0].device)
    if buf.numel() and all(len(set(s)) == 1 for s in sizes):
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


def _unpack_many(buf: torch.Tensor, shapes: list[list[tuple[int, ...]]], dim: int, out_splits: list[int]) -> list[torch.Tensor]:
    """Inverse layout of :func:`_pack_many`: ``shapes[t][j]`` is the block of tensor t from rank j; concatenate along ``dim``."""
    ws = len(out_splits)
    outs = []
    if buf.numel() and all(len(set(ts)) == 1 for ts in shapes):
        rows, col = buf.view(ws, -1), 0
        for ts in shapes:
            n = math.prod(ts[0])
            blocks = rows[:, col : col + n].view(ws, *ts[0])
            outs.append(blocks.movedim(0, dim).reshape(_with(ts[0], dim, ws * ts[0][dim])))
            col += n
        return outs
    starts = [sum(out_splits[:j]) for j in range(ws)]
    for t, ts in enumerate(shapes):
        blocks = []
        for j, shape in enumerate(ts):
            offset = starts[j] + sum(math.prod(shapes[u][j]) for u in range(t))
            blocks.append(buf[offset : offset + math.prod(shape)].view(shape))
        outs.append(torch.cat(blocks, dim))
    return outs


def all_to_all_one(x: torch.Tensor, send_dim: int, send_sizes: list[int], recv_dim: int, recv_sizes: list[int], group: Group) -> torch.Tensor:
    """Send chunk j of ``x`` along ``send_dim`` to rank j; concatenate what arrives along ``recv_dim``.

    ``send_sizes`` is the same list on every rank; ``recv_sizes[j]`` is rank
    j's ``x.shape[recv_dim]``. One ``all_to_all_single`` on one flat buffer.
    This is Ulysses' hot path, kept to integer arithmetic besides the copies:
    on small tensors the Python around the collective is what costs.
    """
    shape = x.shape
    mine = send_sizes[group.rank]
    n, m = shape[send_dim], shape[recv_dim]
    other = x.numel() // (n * m) if n and m else math.prod(_with(_with(shape, send_dim, 1), recv_dim, 1))
    block = _with(shape, send_dim, mine)
    out = torch.empty(_with(block, recv_dim, sum(recv_sizes)), dtype=x.dtype, device=x.device)
    send = _pack(x, send_dim, send_sizes)
    even = send_sizes.count(mine) == len(send_sizes) and recv_sizes.count(m) == len(recv_sizes)
    # Equal splits use the collective's plain form; otherwise, element counts per rank.
    in_splits = None if even else [other * m * s for s in send_sizes]
    out_splits = None if even else [other * mine * r for r in recv_sizes]
    if _leading(block, recv_dim) or out.numel() == 0:  # the received blocks lie in order: receive straight into the result
        _collective("all_to_all", dist.all_to_all_single, group, out.view(-1), send, out_splits, in_splits)
        return out
    recv = torch.empty(out.numel(), dtype=x.dtype, device=x.device)
    _collective("all_to_all", dist.all_to_all_single, group, recv, send, out_splits, in_splits)
    if even:  # [ws, pre, rest] -> [pre, ws, rest]: one strided copy into the result
        pre = math.prod(block[:recv_dim])
        out.view(pre, len(recv_sizes), -1).copy_(recv.view(len(recv_sizes), pre, -1).transpose(0, 1))
        return out
    return _unpack(recv, [_with(block, recv_dim, r) for r in recv_sizes], recv_dim, out=out)


def all_to_all(
    xs: list[torch.Tensor], send_dim: int, send_sizes: list[list[int]], recv_dim: int, recv_sizes: list[list[int]], group: Group
) -> list[torch.Tensor]:
    """:func:`all_to_all_one` for each tensor of ``xs``, all in one collective.

    ``send_sizes[t]`` and ``recv_sizes[t]`` are tensor t's lists. The tensors
    share a dtype and device and travel together: one ``all_to_all_single``
    on one flat buffer, chunk j of each tensor in turn for rank j.
    """
    if len(xs) == 1:
        return [all_to_all_one(xs[0], send_dim, send_sizes[0], recv_dim, recv_sizes[0], group)]
    rank, ws = group.rank, group.world_size
    shapes = [[_with(_with(x.shape, send_dim, ss[rank]), recv_dim, n) for n in rs] for x, ss, rs in zip(xs, send_sizes, recv_sizes)]
    in_splits = [sum(math.prod(_with(x.shape, send_dim, ss[j])) for x, ss in zip(xs, send_sizes)) for j in range(ws)]
    out_splits = [sum(math.prod(ts[j]) for ts in shapes) for j in range(ws)]
    send = _pack_many(xs, send_dim, send_sizes, in_splits)
    recv = torch.empty(sum(out_splits), dtype=xs[0].dtype, device=xs[0].device)
    _collective("all_to_all", dist.all_to_all_single, group, recv, send, out_splits, in_splits)
    return _unpack_many(recv, shapes, recv_dim, out_splits)


def split(x: torch.Tensor, dim: int, sizes: list[int], group: Group) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (a contiguous copy); no communication."""
    offset = sum(sizes[: group.rank])
    return x.narrow(dim, offset, sizes[group.rank]).clone(memory_format=torch.contiguous_format)


def scatter_from_first(x: torch.Tensor, dim: int, sizes: list[int], group: Group) -> torch.Tensor:
    """Chunk r of the group's first rank's ``x`` along ``dim``, on rank r. Other ranks' values are not read."""
    ws, rank = group.world_size, group.rank
    out = torch.empty(_with(x.shape, dim, sizes[rank]), dtype=x.dtype, device=x.device)
    if rank == 0:
        send = _pack(x, dim, sizes)
        per_row = math.prod(_with(x.shape, dim, 1))
        in_splits = [per_row * s for s in sizes]
    else:
        send = x.new_empty(0)
        in_splits = [0] * ws
    out_splits = [out.numel() if j == 0 else 0 for j in range(ws)]
    _collective("scatter (all_to_all)", dist.all_to_all_single, group, out.view(-1), send, out_splits, in_splits)
    return out


def gather_to_first(x: torch.Tensor, dim: int, sizes: list[int], group: Group) -> torch.Tensor:
    """On the group's first rank the concatenation along ``dim`` of every rank's ``x``; zeros of that shape elsewhere."""
    ws, rank = group.world_size, group.rank
    shapes = [_with(x.shape, dim, n) for n in sizes]
    send = x.reshape(-1)
    in_splits = [send.numel() if j == 0 else 0 for j in range(ws)]
    out_splits = [math.prod(s) for s in shapes] if rank == 0 else [0] * ws
    recv = torch.empty(sum(out_splits), dtype=x.dtype, device=x.device)
    _collective("gather (all_to_all)", dist.all_to_all_single, group, recv, send, out_splits, in_splits)
    if rank == 0:
        return _unpack(recv, shapes, dim)
    return x.new_zeros(_with(x.shape, dim, sum(sizes)))


def all_gather_flat(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's ``x`` (same shape everywhere), flattened and concatenated in rank order."""
    x = x.contiguous()
    out = torch.empty(group.world_size * x.numel(), dtype=x.dtype, device=x.device)
    _collective("all_gather", _all_gather_single, group, out, x.view(-1))
    return out


def all_gather(x: torch.Tensor, dim: int, sizes: list[int], group: Group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``; ``sizes[j]`` is rank j's length there (padded to the longest on the wire)."""
    longest = max(sizes)
    if longest == x.shape[dim]:
        padded = x
    else:
        padded = x.new_zeros(_with(x.shape, dim, longest))
        padded.narrow(dim, 0, x.shape[dim]).copy_(x)
    flat = all_gather_flat(padded, group)
    if min(sizes) == longest:
        return _unpack(flat, [tuple(padded.shape)] * group.world_size, dim)
    blocks = flat.view(group.world_size, *padded.shape).unbind(0)
    return torch.cat([b.narrow(dim, 0, n) for b, n in zip(blocks, sizes)], dim)


def reduce_scatter(x: torch.Tensor, dim: int, sizes: list[int], group: Group) -> torch.Tensor:
    """Sum ``x`` (same shape everywhere) over the group and keep chunk r along ``dim`` on rank r (padded to the longest on the wire)."""
    ws, rank = group.world_size, group.rank
    longest = max(sizes)
    if min(sizes) == longest:
        send = _pack(x, dim, sizes)
    else:
        padded = x.new_zeros((ws, *_with(x.shape, dim, longest)))
        for j, chunk in enumerate(x.split(sizes, dim)):
            padded[j].narrow(dim, 0, sizes[j]).copy_(chunk)
        send = padded.view(-1)
    out = torch.empty(_with(x.shape, dim, longest), dtype=x.dtype, device=x.device)
    _collective("reduce_scatter", _reduce_scatter_single, group, out.view(-1), send)
    if sizes[rank] == longest:
        return out
    return out.narrow(dim, 0, sizes[rank]).contiguous()
