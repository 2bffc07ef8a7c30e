"""The collectives behind the autograd ops: one contiguous buffer each way, uneven chunks along any dim.

Nothing here records autograd history; ``ops.py`` wraps these in Functions.
Every function takes the chunk length of each rank along ``dim`` (``sizes``,
one entry per rank of the group) and returns a new tensor, never a view of
its input.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rlightning_comm.sequence_parallel._resolve import Group

# torch 2.13 renamed the single-buffer collectives and deprecated the old names; older torch has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _with(shape: torch.Size | tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = size
    return tuple(out)


def _leading(shape: torch.Size | tuple[int, ...], dim: int) -> bool:
    """Whether chunks along ``dim`` of a contiguous tensor of ``shape`` are contiguous and in order."""
    return math.prod(shape[:dim]) == 1


def _pack(x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
    """One flat buffer holding the chunks of ``x`` along ``dim``, each contiguous, in rank order (a view when it can be)."""
    if len(set(sizes)) == 1:
        # One strided copy (none when the chunks already lie in order).
        return x.unflatten(dim, (len(sizes), sizes[0])).movedim(dim, 0).reshape(-1)
    if _leading(x.shape, dim) and x.is_contiguous():
        return x.view(-1)
    buf = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    offset = 0
    for chunk in x.split(sizes, dim):
        n = chunk.numel()
        buf[offset : offset + n].view(chunk.shape).copy_(chunk)
        offset += n
    return buf


def _unpack(buf: torch.Tensor, shapes: list[tuple[int, ...]], dim: int) -> torch.Tensor:
    """Concatenate along ``dim`` the consecutive blocks of ``buf`` with the given shapes (a view when it can be)."""
    out_shape = _with(shapes[0], dim, sum(s[dim] for s in shapes))
    if _leading(out_shape, dim):
        return buf.view(out_shape)
    blocks, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        blocks.append(buf[offset : offset + n].view(shape))
        offset += n
    return torch.cat(blocks, dim)


def all_to_all(x: torch.Tensor, send_dim: int, send_sizes: list[int], recv_dim: int, recv_sizes: list[int], group: Group) -> torch.Tensor:
    """Send chunk j of ``x`` along ``send_dim`` to rank j; concatenate what arrives along ``recv_dim``.

    ``send_sizes`` is the same list on every rank; ``recv_sizes[j]`` is rank
    j's ``x.shape[recv_dim]``. One ``all_to_all_single`` on one flat buffer.
    """
    rank = group.rank
    send = _pack(x, send_dim, send_sizes)
    per_row = math.prod(_with(x.shape, send_dim, 1))
    in_splits = [per_row * s for s in send_sizes]
    shapes = [_with(_with(x.shape, send_dim, send_sizes[rank]), recv_dim, n) for n in recv_sizes]
    out_splits = [math.prod(s) for s in shapes]
    recv = torch.empty(sum(out_splits), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group.pg)
    return _unpack(recv, shapes, recv_dim)


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
    dist.all_to_all_single(out.view(-1), send, out_splits, in_splits, group=group.pg)
    return out


def gather_to_first(x: torch.Tensor, dim: int, sizes: list[int], group: Group) -> torch.Tensor:
    """On the group's first rank the concatenation along ``dim`` of every rank's ``x``; zeros of that shape elsewhere."""
    ws, rank = group.world_size, group.rank
    shapes = [_with(x.shape, dim, n) for n in sizes]
    send = x.reshape(-1)
    in_splits = [send.numel() if j == 0 else 0 for j in range(ws)]
    out_splits = [math.prod(s) for s in shapes] if rank == 0 else [0] * ws
    recv = torch.empty(sum(out_splits), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group.pg)
    if rank == 0:
        return _unpack(recv, shapes, dim)
    return x.new_zeros(_with(x.shape, dim, sum(sizes)))


def all_gather_flat(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's ``x`` (same shape everywhere), flattened and concatenated in rank order."""
    x = x.contiguous()
    out = torch.empty(group.world_size * x.numel(), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.view(-1), group=group.pg)
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
    _reduce_scatter_single(out.view(-1), send, group=group.pg)
    if sizes[rank] == longest:
        return out
    return out.narrow(dim, 0, sizes[rank]).contiguous()
