"""Copies between a member's tensors and a staging buffer of bytes: what a weight sync packs before it sends a bucket
and unpacks once it has received one (both weight-sync calls stage this way).

A piece is anything with ``at`` (its offset in the buffer) and ``nbytes``.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from rlightning_comm.weights.core._checks import plain

DIRECT_BYTES = 256 * 2**10
"""Pieces of at least this many bytes (or of a whole bucket, if smaller) travel in place; the rest are coalesced."""


def dtype_of(name: str) -> torch.dtype:
    """The dtype a manifest names (``"torch.float32"``)."""
    return getattr(torch, name.removeprefix("torch."))


def typed(buffer: torch.Tensor, piece: Any, like: torch.Tensor) -> torch.Tensor:
    """The bytes of ``piece`` in ``buffer``, viewed with ``like``'s dtype and shape."""
    return buffer[piece.at : piece.at + piece.nbytes].view(like.dtype).view(like.shape)


def copy_pieces(buffer: torch.Tensor, views: list[tuple[Any, torch.Tensor]], pack: bool) -> None:
    """Copy each piece's view into ``buffer`` (``pack``) or out of it.

    Between plain host bytes a single-threaded ``memmove`` on the pieces' addresses, with no tensor made per piece:
    torch's ``copy_`` would split a large copy over its intra-op threads, which on a host whose cores are all busy (the
    ranks of one machine, each with its own thread pool) costs several times a plain copy, and making two views per
    piece cost as much as copying a small one. Anything else (strided, conjugate or negative views, other devices)
    through ``copy_``, which reads and writes logical values.
    """
    base = buffer.data_ptr() if buffer.is_cpu else None
    for piece, view in views:
        if base is not None and view.is_cpu and plain(view):
            bucket, own = base + piece.at, view.data_ptr()
            to, from_ = (bucket, own) if pack else (own, bucket)
            ctypes.memmove(to, from_, piece.nbytes)
        elif pack:
            typed(buffer, piece, view).copy_(view)
        else:
            view.copy_(typed(buffer, piece, view))
