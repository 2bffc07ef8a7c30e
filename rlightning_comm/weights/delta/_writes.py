"""Writing a delta's changes (:class:`~._changes.Change`) into tensors and into a snapshot: the writing half of a delta
sync's bit work, by position (a tensor of any strides written through the memory it spans), or whole for ``dense``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlightning_comm.weights.delta._changes import DENSE, SAME, Change, offsets, span


def writable(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose words (:func:`~._changes.words`) share memory with it and hold ``t``'s values: ``t`` itself, or
    (a lazy conjugate or negation, a 16-byte element whose last dimension is strided) a copy to write into and copy
    back."""
    if t.is_conj() or t.is_neg() or (t.element_size() > 8 and t.dim() and t.stride(-1) != 1):
        return t.resolve_conj().resolve_neg().contiguous()
    return t


def apply(targets: Sequence[Sequence[torch.Tensor]], record_sizes: Sequence[int], change: Change) -> None:
    """Write ``change`` (of one record) into the word views of its pieces (any strides), in place: ``targets[i]`` are
    the views that each take piece ``i``'s words (a tensor and the tensors tied to it)."""
    if change.kind == SAME:
        return
    bounds = [0]
    for n in record_sizes:
        bounds.append(bounds[-1] + n)
    if change.kind == DENSE:
        cuts = bounds
    elif len(targets) == 1:
        cuts = [0, change.pos.numel()]
    else:
        edges = torch.tensor(bounds[1:], dtype=torch.int64, device=change.pos.device)
        cuts = [0, *torch.searchsorted(change.pos, edges).tolist()]
    for views, a, c0, c1 in zip(targets, bounds, cuts, cuts[1:]):
        if c1 == c0:
            continue
        vals = change.vals[c0:c1]
        for target in views:
            if change.kind == DENSE:
                target.copy_(vals.view(target.shape))
            else:
                _scatter(target, change.pos[c0:c1] - a, vals)


def _scatter(target: torch.Tensor, pos: torch.Tensor, vals: torch.Tensor) -> None:
    """``target``'s words at flat (row-major) positions ``pos`` set to ``vals``, in place, whatever its strides."""
    if pos.device != target.device:
        pos, vals = pos.to(target.device), vals.to(target.device)
    if target.is_contiguous():
        target.view(-1).index_copy_(0, pos, vals)
    else:
        span(target).index_copy_(0, offsets(target, pos), vals)


def advance(snap: torch.Tensor, change: Change) -> None:
    """A snapshot's words (flat) take on ``change``."""
    if change.kind == SAME:
        return
    if change.kind == DENSE:
        snap.copy_(change.vals)
    else:
        snap.index_copy_(0, change.pos.cpu(), change.vals.cpu())
