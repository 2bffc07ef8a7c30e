"""Broadcast a model's weights from one rank to others in a few flat buckets, loading them in place."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from rlightning_comm.communicators._objects import all_gather_objects
from rlightning_comm.context import CommContext
from rlightning_comm.modes import CommMode, ParallelMode

DEFAULT_BUCKET_BYTES = 64 * 2**20

StateDictLike = Mapping[str, torch.Tensor] | nn.Module | Sequence[tuple[str, torch.Tensor]]
# name -> (dtype, shape) as plain picklable data.
_Manifest = list[tuple[str, str, tuple[int, ...]]]


def _named_tensors(state_dict: Any) -> tuple[list[tuple[str, torch.Tensor]], None] | tuple[None, tuple[type[Exception], str]]:
    """The named tensors of any accepted input, or the exception type and message of what is wrong with it."""
    if isinstance(state_dict, nn.Module):
        items = list(state_dict.state_dict().items())
    elif isinstance(state_dict, Mapping):
        items = list(state_dict.items())
    elif isinstance(state_dict, Sequence) and not isinstance(state_dict, (str, bytes)):
        items = list(state_dict)
        for i, item in enumerate(items):
            if not (isinstance(item, tuple) and len(item) == 2):
                return None, (TypeError, f"a list of named tensors must hold (name, tensor) pairs; item {i} is {type(item).__name__}")
    else:
        return None, (TypeError, f"state_dict must be a Mapping of names to tensors, an nn.Module or a list of (name, tensor); got {type(state_dict).__name__}")
    seen: set[str] = set()
    for name, tensor in items:
        if not isinstance(name, str):
            return None, (TypeError, f"tensor names must be str; got {type(name).__name__} {name!r}")
        if name in seen:
            return None, (ValueError, f"tensor name {name!r} appears more than once")
        seen.add(name)
        if not isinstance(tensor, torch.Tensor):
            return None, (TypeError, f"{name!r} must be a torch.Tensor; got {type(tensor).__name__}")
        if tensor.layout != torch.strided or tensor.is_quantized:
            return None, (ValueError, f"{name!r} must be a dense tensor; got layout {tensor.layout}{' (quantized)' if tensor.is_quantized else ''}")
    return items, None


def _manifest(items: list[tuple[str, torch.Tensor]]) -> _Manifest:
    return [(name, str(t.dtype), tuple(t.shape)) for name, t in items]


def _mismatch(source: _Manifest, mine: _Manifest) -> str | None:
    """What differs between this rank's tensors and the source's, or ``None``."""
    theirs = {name: (dtype, shape) for name, dtype, shape in source}
    ours = {name: (dtype, shape) for name, dtype, shape in mine}
    lines = []
    missing = [n for n in theirs if n not in ours]
    unexpected = [n for n in ours if n not in theirs]
    differ = [f"{n!r}: source {theirs[n][0]} {list(theirs[n][1])}, here {ours[n][0]} {list(ours[n][1])}" for n in theirs if n in ours and theirs[n] != ours[n]]
    for label, names in (("missing here", missing), ("not on the source", unexpected), ("differ", differ)):
        if names:
            lines.append(f"{len(names)} {label}: {', '.join(map(str, names[:5]))}{', ...' if len(names) > 5 else ''}")
    return "; ".join(lines) or None


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _spans(sizes: list[int], start: int, stop: int, cursor: list[int]) -> Iterator[tuple[int, int, int, int]]:
    """``(index, lo, hi, offset)``: bytes ``[lo, hi)`` of tensor ``index`` lie at ``offset`` in the bucket ``[start, stop)``.

    ``cursor`` holds ``[index, its first byte in the stream]`` and advances, so
    walking every bucket in order costs one pass over the tensors.
    """
    index, base = cursor
    while index < len(sizes) and base < stop:
        lo, hi = max(start, base), min(stop, base + sizes[index])
        if hi > lo:
            yield index, lo - base, hi - base, lo - start
        if base + sizes[index] > stop:
            break
        base += sizes[index]
        index += 1
    cursor[:] = [index, base]


def _raise_problems(problems: list[tuple[int, tuple[type[Exception], str] | None]]) -> None:
    found = [(rank, p) for rank, p in problems if p is not None]
    if found:
        detail = "; ".join(f"rank {rank}: {msg}" for rank, (_, msg) in found)
        raise found[0][1][0](f"broadcast_state_dict: nothing was transferred; {detail}")


def broadcast_state_dict(
    state_dict: StateDictLike,
    comm_mode: CommMode | ParallelMode | str = ParallelMode.WEIGHT_TRANSFER,
    src: int | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Copy every tensor of ``state_dict`` from global rank ``src`` into the same-named tensors of every other rank of ``comm_mode``.

    Every member of the group calls this, the source with the weights to
    send, each destination with tensors of the same names, dtypes and shapes
    to overwrite in place (a module's parameters and buffers, through its
    ``state_dict()``). The tensors travel as one byte stream cut into
    buckets of at most ``bucket_bytes`` (the source's value), one broadcast
    per bucket, whatever their number and dtypes, so destinations end
    bit-identical to the source. Before any bucket moves, the source's
    manifest (names, dtypes, shapes) goes to every rank and every rank's
    verdict comes back: a mismatch or a bad input anywhere raises the same
    error on every member, and nothing is transferred. The source's tensors
    are only read. Non-members return at once.

    Args:
        state_dict: A mapping of names to tensors, an ``nn.Module`` or a list
            of ``(name, tensor)`` pairs. Tensors may live on any device; they
            are staged through buckets on the communicator's device.
        comm_mode: The mode to broadcast over.
        src: Global rank that sends; ``None`` means the source declared to
            :meth:`CommContext.init_weight_transfer_group` for this mode.
        bucket_bytes: Largest bucket, in bytes (memory used on each rank).

    Raises:
        TypeError, ValueError: bad arguments (raised locally), or a bad input
            or mismatch on any member (raised on every member).
        ModeNotBoundError: ``comm_mode`` is not bound.
    """
    comm = CommContext().get_communicator(comm_mode)
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int; got {bucket_bytes!r}")
    if not comm.is_member:
        return
    if src is None:
        src = CommContext().get_transfer_source(comm_mode)
        if src is None:
            raise ValueError(f"src is required: mode {comm.mode!r} was not bound by init_weight_transfer_group, so it has no declared source")
    if isinstance(src, bool) or src not in comm.ranks:
        raise ValueError(f"src={src!r} is not a global rank of mode {comm.mode!r}; expected one of {list(comm.ranks)}")
    is_source = CommContext().get_global_rank() == src
    items, problem = _named_tensors(state_dict)
    offer = [(_manifest(items), bucket_bytes) if is_source and items is not None else None]
    comm.broadcast_object_list(offer, src=src)
    if offer[0] is not None and items is not None and not is_source:
        mismatch = _mismatch(offer[0][0], _manifest(items))
        problem = (ValueError, f"these tensors do not match the source's ({mismatch})") if mismatch else None
    verdicts = all_gather_objects(problem, comm.group, comm.device)
    _raise_problems(list(zip(comm.ranks, verdicts)))
    manifest, bucket_bytes = offer[0]
    with torch.no_grad():
        _transfer(comm, items, manifest, bucket_bytes, src, is_source)


def _transfer(comm: Any, items: list[tuple[str, torch.Tensor]], manifest: _Manifest, bucket_bytes: int, src: int, is_source: bool) -> None:
    by_name = dict(items)
    tensors = [by_name[name] for name, _, _ in manifest]  # the source's order, on every rank
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(sizes)
    if not total:
        return
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    if is_source:
        streams = [_byte_view(t.detach()) for t in tensors]
    else:
        # Contiguous destinations receive in place; others through a contiguous copy written back at the end.
        streams = []
        for t in tensors:
            if not t.is_contiguous():
                stage = torch.empty_like(t, memory_format=torch.contiguous_format)
                staged.append((t, stage))
                t = stage
            streams.append(_byte_view(t.detach()))
    buffer = torch.empty(min(bucket_bytes, total), dtype=torch.uint8, device=comm.device)
    cursor = [0, 0]
    for start in range(0, total, bucket_bytes):
        stop = min(start + bucket_bytes, total)
        bucket = buffer[: stop - start]
        spans = list(_spans(sizes, start, stop, cursor))
        if is_source:
            for i, lo, hi, at in spans:
                bucket[at : at + hi - lo].copy_(streams[i][lo:hi])
        comm.broadcast(bucket, src=src)
        if not is_source:
            for i, lo, hi, at in spans:
                streams[i][lo:hi].copy_(bucket[at : at + hi - lo])
    for t, stage in staged:
        t.copy_(stage)
